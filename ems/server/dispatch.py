"""Serving many connections with a few threads.

Idle client connections (clients keep several open, pooled) cost the daemon an epoll
entry, never a thread.  A bounded set of worker threads all wait on one epoll set; each
connection is in it armed for one event (``EPOLLONESHOT``), so the kernel wakes exactly one
worker when a request arrives, and that worker answers it and arms the connection again.
A request wakes one thread, as a thread per connection would, and each connection's
requests are served in order (it is armed only once its answer is out).

A request is served only once it has arrived whole (:meth:`Served.request_waiting`): a
peer that sends part of a frame and stops is set aside with a keeper thread, which looks
at it every few milliseconds and closes it when ``read_timeout`` passes, so a trickling or
stalled peer never holds a worker while others wait.  A value's bytes behind a WRITE are
taken as they flow; once they stop (:attr:`Served.receiving`) the session waits with the
keeper the same way.  The keeper also shuts down
connections idle longer than ``idle_timeout`` (clients notice and reconnect); it never
closes an armed connection's descriptor itself, so an event a worker already holds can
never name a descriptor reused by another connection: the shut-down connection wakes a
worker, which reads the end of stream and ends the session.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Protocol, Tuple

from datadist.engine import tls

__all__ = ["Dispatcher", "Served"]

log = logging.getLogger("ems.server")

#: How often set-aside partial requests are looked at again.
_PARTIAL_POLL_S = 0.01
#: How often idle connections are looked for when no partial request is set aside.
_IDLE_POLL_S = 1.0
#: How long :meth:`Dispatcher.close` waits for a worker to return after the cut.
_JOIN_S = 10.0
_ARMED = select.EPOLLIN | select.EPOLLONESHOT
#: Armed to fire at once (a socket is writable): a TLS session holding decrypted bytes a
#: poll would not show, or a request the keeper saw complete.
_READY = _ARMED | select.EPOLLOUT


class Served(Protocol):
    """What the dispatcher needs of a session."""

    sock: socket.socket
    #: When the connection was accepted (``time.monotonic``).
    accepted: float

    @property
    def greeted(self) -> bool:
        """Whether the client has said HELLO (authenticated, where a secret is set)."""

    def request_waiting(self) -> Optional[bool]:
        """Whether the next request has arrived whole (never blocks once the socket is
        readable); None: nothing has arrived (a TLS session that just finished its
        handshake): watch it as idle."""

    @property
    def receiving(self) -> bool:
        """Whether a request's payload has stopped arriving mid-way, or an answer leaving
        (the session waits with the keeper, as a partial frame does, until
        :meth:`request_waiting`)."""

    @property
    def answering(self) -> bool:
        """Whether it is an answer that has stopped leaving (the client has not read it)."""

    def settle(self, until: float) -> None:
        """Send the rest of an answer set aside, waiting for the client, until ``until``."""

    def serve_one(self) -> bool:
        """Answer the request whose bytes are waiting (or take more of its payload);
        False ends the session."""

    def end(self) -> None:
        """Release the session (idempotent)."""

    def kick(self) -> None:
        """Shut the connection down (its descriptor stays open until :meth:`end`)."""


class Dispatcher:
    """The worker threads, their epoll set and the keeper (see the module docstring)."""

    def __init__(self, workers: int, idle_timeout: float, read_timeout: float) -> None:
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout
        self._ep = select.epoll()
        # Written once, at close, and never drained: level-triggered, it wakes every worker.
        self._stop_r, self._stop_w = socket.socketpair()
        self._ep.register(self._stop_r.fileno(), select.EPOLLIN)
        self._lock = threading.Lock()
        #: Armed sessions by descriptor, with when each became idle (inf once kicked).
        self._armed: Dict[int, Tuple[Served, float]] = {}
        #: Sessions with part of a request in, by when that was first seen (the keeper's).
        self._partial: Dict[Served, float] = {}
        self._stop = False
        self._busy = 0  # requests being served
        self._idle = threading.Condition(self._lock)  # notified when _busy drops to 0
        self._tick = threading.Condition(self._lock)  # wakes the keeper (a partial, stop)
        self._workers = [threading.Thread(target=self._work, name=f"ems-worker_{i}", daemon=True)
                         for i in range(workers)]
        self._keeper = threading.Thread(target=self._keep, name="ems-keeper", daemon=True)
        for t in self._workers + [self._keeper]:
            t.start()

    def watch(self, session: Served, ready: bool = False) -> None:
        """Wait for the session's next request (any thread); ``ready``: look at it at once."""
        with self._lock:
            if self._stop:
                session.end()
                return
            self._arm(session, ready or tls.buffered(session.sock))

    def _arm(self, session: Served, ready: bool) -> None:
        """Put the session in the epoll set for one event (the lock held)."""
        try:
            fd = session.sock.fileno()
            self._armed[fd] = (session, time.monotonic())
            try:
                self._ep.modify(fd, _READY if ready else _ARMED)
            except FileNotFoundError:  # first time, or a new connection on a reused number
                self._ep.register(fd, _READY if ready else _ARMED)
        except (ValueError, OSError):  # closed meanwhile
            self._armed.pop(fd, None)
            session.end()

    def close(self, drain_s: float = 0.0, cut: Callable[[], None] = lambda: None) -> int:
        """Stop dispatching (no new request is taken), let the requests in flight finish
        (each session ends after its answer) for up to ``drain_s`` seconds; then ``cut``
        (which breaks the remaining sessions' sockets, so their workers return) and wait
        for them; end every idle session.  Returns how many were cut."""
        with self._lock:
            self._stop = True
            self._tick.notify_all()
        try:
            self._stop_w.send(b"x")
        except OSError:
            pass
        until = time.monotonic() + drain_s
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0, timeout=drain_s)
            left = self._busy
        self._keeper.join(_JOIN_S)  # it moves no session aside or back while answers settle
        left += self._settle_answers(until)
        if left:
            cut()
        deadline = time.monotonic() + _JOIN_S
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            rest = [s for s, _ in self._armed.values()] + list(self._partial)
            self._armed.clear()
            self._partial.clear()
        for session in rest:
            session.end()
        self._ep.close()
        self._stop_r.close()
        self._stop_w.close()
        return left

    def _settle_answers(self, until: float) -> int:
        """Let the answers set aside (clients that had not read them all) finish, each on a
        thread of its own, until ``until``; how many did not (they are cut)."""
        with self._lock:  # aside with the keeper, or armed again by it just before the stop
            answering = [s for s in list(self._partial) + [s for s, _ in self._armed.values()] if s.answering]
        threads = [threading.Thread(target=s.settle, args=(until,), name="ems-settle", daemon=True)
                   for s in answering]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, until - time.monotonic()) + _JOIN_S)
        for s in answering:
            if s.answering:
                s.kick()
        return sum(s.answering for s in answering)

    def _work(self) -> None:
        stop_fd = self._stop_r.fileno()
        while True:
            try:
                events = self._ep.poll(-1, 1)
            except OSError:  # the set was closed
                return
            for fd, _ in events:
                with self._lock:
                    if fd == stop_fd or self._stop:
                        return
                    entry = self._armed.pop(fd, None)
                    if entry is None:
                        continue
                    self._busy += 1
                try:
                    self._take(entry[0])
                except Exception:  # a bug must not cost the daemon a worker; it is logged
                    log.exception("a session failed")
                    entry[0].end()
                finally:
                    with self._idle:
                        self._busy -= 1
                        if not self._busy:
                            self._idle.notify_all()

    def _take(self, session: Served) -> None:
        waiting = session.request_waiting()
        if waiting is None:
            self.watch(session)
        elif not waiting:  # part of a frame: wait for the rest with the keeper, not here
            with self._lock:
                self._partial[session] = time.monotonic()
                self._tick.notify()
        else:
            self._serve(session)

    def _serve(self, session: Served) -> None:
        if not session.serve_one():
            session.end()
        elif session.receiving:  # a value's bytes stopped arriving: wait with the keeper
            with self._lock:
                self._partial[session] = time.monotonic()
                self._tick.notify()
        else:
            self.watch(session)  # ends it instead once stopping

    def _keep(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
                self._tick.wait(_PARTIAL_POLL_S if self._partial else _IDLE_POLL_S)
                if self._stop:
                    return
                partial = list(self._partial.items())
            self._check_partial(partial)
            self._kick_idle()

    def _check_partial(self, partial: List[Tuple[Served, float]]) -> None:
        now = time.monotonic()
        for session, since in partial:
            try:
                waiting = session.request_waiting()
            except Exception:  # a bug must not cost the daemon its keeper; it is logged
                log.exception("a session failed")
                waiting, since = False, -float("inf")  # ended below
            if waiting is None or waiting:
                with self._lock:
                    del self._partial[session]
                self.watch(session, ready=bool(waiting))
            elif now - since > self.read_timeout:
                with self._lock:
                    del self._partial[session]
                log.debug("closed a connection whose request did not arrive whole within %.1f s", self.read_timeout)
                session.end()

    def _kick_idle(self) -> None:
        """Shut down connections idle past ``idle_timeout``, and those that have not said
        HELLO within ``read_timeout`` of being accepted, whatever they sent meanwhile (a
        stranger must not keep a connection slot, pinging or not)."""
        now = time.monotonic()
        limit = now - self.idle_timeout if self.idle_timeout > 0 else -float("inf")
        with self._lock:
            idle = [(fd, s) for fd, (s, since) in self._armed.items()
                    if since < limit or (s.accepted < now - self.read_timeout and not s.greeted)]
            for fd, s in idle:
                self._armed[fd] = (s, float("inf"))
        for _, session in idle:
            session.kick()  # a worker reads the end of stream and ends it
