"""Serving many connections with a few threads.

Idle client connections (clients keep several open, pooled) cost the daemon a selector
entry, never a thread: one dispatcher thread waits on every idle socket, and when one
becomes readable it hands that session's next request to a bounded pool of worker threads.
A session is watched again only after its request is answered, so each connection's
requests are served in order.  A request goes to a worker only once it has arrived whole
(:meth:`Served.request_waiting`): a peer that sends part of a frame and stops is set
aside, checked every few milliseconds, and closed when ``read_timeout`` passes, so a
trickling or stalled peer never holds a worker while others wait.  A connection idle
longer than ``idle_timeout`` is closed (clients notice and reconnect).
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Protocol

from datadist.engine import tls

__all__ = ["Dispatcher", "Served"]

log = logging.getLogger("ems.server")

#: How often set-aside partial requests are looked at again.
_PARTIAL_POLL_S = 0.01


class Served(Protocol):
    """What the dispatcher needs of a session."""

    sock: socket.socket

    def request_waiting(self) -> Optional[bool]:
        """Whether the next request has arrived whole (never blocks); None: nothing has
        arrived (a TLS session that just finished its handshake): watch it as idle."""

    def serve_one(self) -> bool:
        """Answer the request whose bytes are waiting; False ends the session."""

    def end(self) -> None:
        """Release the session (idempotent)."""


class Dispatcher:
    """The dispatcher thread and its worker pool (see the module docstring)."""

    def __init__(self, workers: int, idle_timeout: float, read_timeout: float) -> None:
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout
        #: Sessions with part of a request in, by when that was first seen.
        self._partial: Dict[Any, float] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._incoming: List[Served] = []
        self._since: Dict[int, float] = {}  # fd -> when the session became idle
        self._stop = False
        self._busy = 0  # requests being served
        self._idle = threading.Condition(self._lock)  # notified when _busy drops to 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ems-worker")
        self._thread = threading.Thread(target=self._run, name="ems-dispatch", daemon=True)
        self._thread.start()

    def watch(self, session: Served) -> None:
        """Wait for the session's next request (any thread)."""
        with self._lock:
            if self._stop:
                session.end()
                return
            self._incoming.append(session)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def close(self, drain_s: float = 0.0, cut: Callable[[], None] = lambda: None) -> int:
        """Stop dispatching (no new request is taken), end every idle session, and let the
        requests in flight finish (each session ends after its answer) for up to
        ``drain_s`` seconds; then ``cut`` (which breaks the remaining sessions' sockets,
        so their workers return) and wait for them.  Returns how many were cut."""
        with self._lock:
            self._stop = True
        self._wake()
        self._thread.join(10.0)
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0, timeout=drain_s)
            left = self._busy
        if left:
            cut()
        self._pool.shutdown(wait=True)
        self._wake_r.close()
        self._wake_w.close()
        return left

    def _submit(self, session: Served) -> None:
        with self._lock:
            self._busy += 1
        self._pool.submit(self._serve, session)

    def _run(self) -> None:
        try:
            while not self._stop:
                events = self._sel.select(_PARTIAL_POLL_S if self._partial else 1.0)
                self._take_incoming()
                for key, _ in events:
                    if key.data is None:
                        self._drain()
                    else:
                        self._dispatch(key.data)
                self._check_partial()
                self._close_idle()
        finally:
            for key in list(self._sel.get_map().values()):
                if key.data is not None:
                    key.data.end()
            with self._lock:
                leftover, self._incoming = self._incoming, []
            for session in leftover + list(self._partial):
                session.end()
            self._partial.clear()
            self._sel.close()

    def _drain(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _take_incoming(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
        now = time.monotonic()
        for session in incoming:
            if tls.buffered(session.sock):  # decrypted bytes a poll would not show
                self._partial[session] = now
                continue
            try:
                self._sel.register(session.sock, selectors.EVENT_READ, session)
                self._since[session.sock.fileno()] = now
            except (ValueError, OSError, KeyError):  # closed meanwhile
                session.end()

    def _dispatch(self, session: Any) -> None:
        self._forget(session)
        waiting = session.request_waiting()
        if waiting:
            self._submit(session)
        elif waiting is None:
            self.watch(session)
        else:  # part of a frame: wait for the rest here, not in a worker
            self._partial[session] = time.monotonic()

    def _check_partial(self) -> None:
        now = time.monotonic()
        for session, since in list(self._partial.items()):
            waiting = session.request_waiting()
            if waiting or waiting is None:
                del self._partial[session]
                if waiting:
                    self._submit(session)
                else:
                    self.watch(session)
            elif now - since > self.read_timeout:
                del self._partial[session]
                log.debug("closed a connection whose request did not arrive whole within %.1f s", self.read_timeout)
                session.end()

    def _forget(self, session: Any) -> None:
        try:
            self._since.pop(session.sock.fileno(), None)
            self._sel.unregister(session.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _serve(self, session: Served) -> None:
        try:
            try:
                again = session.serve_one()
            except Exception:  # a bug must not take the daemon down; it is logged
                log.exception("a session failed")
                again = False
            if again:
                self.watch(session)  # ends it instead once stopping
            else:
                session.end()
        finally:
            with self._idle:
                self._busy -= 1
                if not self._busy:
                    self._idle.notify_all()

    def _close_idle(self) -> None:
        if self.idle_timeout <= 0:
            return
        limit = time.monotonic() - self.idle_timeout
        for key in list(self._sel.get_map().values()):
            session = key.data
            if session is not None and self._since.get(key.fd, limit) < limit:
                self._forget(session)
                session.end()
