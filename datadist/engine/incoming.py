"""Connections that have not linked yet: read their first frame without ever blocking the
agent thread.

An accepted connection is non-blocking and owned here until its first frame (a ``HELLO``
or an ``ATTACH``) has arrived whole: bytes are taken as they come, the header is checked
before anything is allocated (a frame that opens a link is at most 64 KiB), and a
connection that has not delivered its frame by its deadline is closed.  At most
``max_pending`` connections wait at once; a new one beyond that displaces the one that
has waited longest.
So a peer that sends one byte and stops, or floods connections, costs a few kilobytes
and a file descriptor for a few seconds, and never delays another peer.

Refusals of hostile input are logged through :class:`RateLimitedLog`, so a flood of bad
frames cannot flood the log either.
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Optional

from . import wire
from .handshake import ServerAuth

__all__ = ["Pending", "Incoming", "RateLimitedLog"]


class RateLimitedLog:
    """At most ``burst`` warnings per ``window`` seconds; the rest are counted and the
    count is reported with the next warning that is let through."""

    def __init__(self, log: logging.Logger, burst: int = 10, window: float = 60.0) -> None:
        self.log, self.burst, self.window = log, burst, window
        self._start = 0.0
        self._sent = 0
        self._dropped = 0

    def warning(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._start >= self.window:
            self._start, self._sent = now, 0
        if self._sent >= self.burst:
            self._dropped += 1
            return
        self._sent += 1
        if self._dropped:
            fmt += " (%d similar messages suppressed)"
            args = (*args, self._dropped)
            self._dropped = 0
        self.log.warning(fmt, *args)


class Pending:
    """One accepted connection and the part of its first frame received so far."""

    __slots__ = ("sock", "deadline", "buf", "need", "frame", "auth")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        # The server's half of an authenticated opening and the client's cluster id, once challenged.
        self.auth: Optional[tuple[ServerAuth, int]] = None
        self.buf = bytearray()
        self.need = wire.HEADER_SIZE      # bytes wanted before the next step
        self.frame: Optional[tuple[type[wire.Message], int]] = None  # (class, body bytes) once the header passed

    def feed(self) -> Optional[wire.Message]:
        """Take what the socket has; the decoded frame once complete, else None.  Raises
        ``ConnectionError`` at end of stream and :class:`~datadist.engine.wire.WireError`
        for a frame that may not open a link."""
        while True:
            try:
                chunk = self.sock.recv(self.need - len(self.buf))
            except (BlockingIOError, InterruptedError):
                return None
            if not chunk:
                raise ConnectionResetError("closed before its first frame")
            self.buf += chunk
            if len(self.buf) < self.need:
                continue
            if self.frame is None:
                cls, blen, alen = wire.parse_header(bytes(self.buf), wire.PRE_LINK)
                self.frame = (cls, blen)
                self.buf = bytearray()
                self.need = blen + alen
                if self.need:
                    continue
            cls, blen = self.frame
            return wire.decode_frame(cls, self.buf, blen)


class Incoming:
    """The pending connections of one agent (used on the agent thread only)."""

    def __init__(self, handshake_s: float, max_pending: int = 128) -> None:
        self.handshake_s = handshake_s
        self.max_pending = max_pending
        self.pending: dict[int, Pending] = {}

    def admit(self, sock: socket.socket) -> tuple[Pending, Optional[Pending]]:
        """Own a freshly accepted socket.  When ``max_pending`` already wait, the one that
        has waited longest is given up (released, returned second for the caller to close):
        a legitimate peer sends its frame at once, so idle connections age out first, and
        a flood of them never locks new peers out."""
        evicted = None
        if len(self.pending) >= self.max_pending:
            evicted = min(self.pending.values(), key=lambda p: p.deadline)
            self.release(evicted)
        sock.setblocking(False)
        pend = Pending(sock, time.monotonic() + self.handshake_s)
        self.pending[sock.fileno()] = pend
        return pend, evicted

    def release(self, pend: Pending) -> None:
        """Stop owning ``pend`` (it linked, or it is being closed)."""
        self.pending.pop(pend.sock.fileno(), None)

    def next_timeout(self) -> Optional[float]:
        """Seconds until the earliest deadline (for the selector), None if none waits."""
        if not self.pending:
            return None
        return max(0.0, min(p.deadline for p in self.pending.values()) - time.monotonic())

    def expired(self) -> list[Pending]:
        """The connections past their deadline (released, still open)."""
        now = time.monotonic()
        late = [p for p in self.pending.values() if p.deadline <= now]
        for p in late:
            self.release(p)
        return late
