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

An engine with TLS first takes the TLS handshake the same way (non-blocking, within the
same deadline; :meth:`Pending.open_tls`): the connection's first byte is peeked, and one
that does not open a TLS handshake (a peer without TLS) is refused at once, in the link
protocol, so that peer can say why.

Refusals of hostile input are logged through :class:`RateLimitedLog`, so a flood of bad
frames cannot flood the log either.
"""
from __future__ import annotations

import logging
import selectors
import socket
import ssl
import time
from typing import Optional

from . import tls, wire
from .errors import Fault
from .handshake import ServerAuth

__all__ = ["Pending", "Incoming", "RateLimitedLog", "NotTls", "TLS_REFUSAL", "tls_refusal"]

#: What a connection that does not open with TLS gets from an engine that requires it.
TLS_REFUSAL = "this engine accepts TLS links only"
#: The first byte of a TLS handshake record.
_TLS_HANDSHAKE = 0x16
#: Reads that find nothing to take yet on a non-blocking (TLS) socket.
_NOT_YET = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class NotTls(wire.WireError):
    """A connection to an engine that requires TLS opened without a TLS handshake."""


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

    __slots__ = ("sock", "deadline", "buf", "need", "frame", "auth", "tls", "events")

    def __init__(self, sock: socket.socket, deadline: float, tls_config: Optional[tls.TlsConfig] = None) -> None:
        self.sock = sock
        self.deadline = deadline
        #: The engine's TLS while this connection's handshake is still to come (None after).
        self.tls = tls_config
        #: What the selector waits for on this connection (a TLS handshake may need to write).
        self.events = selectors.EVENT_READ
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
            except _NOT_YET:
                return None
            if not chunk:
                raise ConnectionResetError("closed before its first frame")
            self.buf += chunk
            if len(self.buf) < self.need:
                continue
            if self.frame is None:
                cls, blen, alen = self._header()
                self.frame = (cls, blen)
                self.buf = bytearray()
                self.need = blen + alen
                if self.need:
                    continue
            cls, blen = self.frame
            return wire.decode_frame(cls, self.buf, blen)

    def _header(self) -> tuple[type[wire.Message], int, int]:
        try:
            return wire.parse_header(bytes(self.buf), wire.PRE_LINK)
        except wire.WireError:
            if self.buf[0] == _TLS_HANDSHAKE:  # say so: the operator has a mismatch to fix
                raise wire.WireError("a TLS handshake, and this engine has no TLS configured") from None
            raise

    def open_tls(self) -> int:
        """Advance the TLS handshake: 0 once it is done, else the selector events to wait
        for.  Before anything is wrapped, the first byte is peeked: a connection that does
        not open a TLS handshake raises :class:`NotTls`.  ``self.sock`` becomes the TLS
        socket (same descriptor), so the caller registers it anew when it changed.
        Raises ``ssl.SSLError`` (a certificate refused either way) or ``OSError``."""
        assert self.tls is not None
        if not isinstance(self.sock, ssl.SSLSocket):
            try:
                first = self.sock.recv(1, socket.MSG_PEEK)
            except _NOT_YET:
                return selectors.EVENT_READ
            if not first:
                raise ConnectionResetError("closed before the TLS handshake")
            if first[0] != _TLS_HANDSHAKE:
                raise NotTls("no TLS handshake, and this engine requires TLS")
            self.sock = self.tls.accept(self.sock)
        events = tls.handshake_step(self.sock)
        if not events:
            self.tls = None
        return events


def tls_refusal() -> bytes:
    """The frame that tells a peer without TLS why it was refused (it names nothing of
    this engine)."""
    return wire.encode(wire.HelloAck(status=int(Fault.LINK_FAILED), message=TLS_REFUSAL))


class Incoming:
    """The pending connections of one agent (used on the agent thread only)."""

    def __init__(self, handshake_s: float, max_pending: int = 128) -> None:
        self.handshake_s = handshake_s
        self.max_pending = max_pending
        self.pending: dict[int, Pending] = {}

    def admit(self, sock: socket.socket,
              tls_config: Optional[tls.TlsConfig] = None) -> tuple[Pending, Optional[Pending]]:
        """Own a freshly accepted socket (with ``tls_config``: its TLS handshake comes
        first).  When ``max_pending`` already wait, the one that has waited longest is
        given up (released, returned second for the caller to close):
        a legitimate peer sends its frame at once, so idle connections age out first, and
        a flood of them never locks new peers out."""
        evicted = None
        if len(self.pending) >= self.max_pending:
            evicted = min(self.pending.values(), key=lambda p: p.deadline)
            self.release(evicted)
        sock.setblocking(False)
        pend = Pending(sock, time.monotonic() + self.handshake_s, tls_config)
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
