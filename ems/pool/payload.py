"""A value's raw bytes on a pool connection over TCP (after a WRITE frame, or after the
reply to a READ), plain or TLS, summed as they go.

Both ends sum what they move (:class:`~datadist.engine.checksum.StreamSum`): the saving
client what it sends, the daemon what it receives, the loading client what it receives.
On a plain socket the C loop sums each system call's bytes right after moving them; on a
TLS socket (:mod:`datadist.engine.tls`) the bytes go through a staging buffer and are
summed there.  Failures come back as the pool's errors: :class:`PoolTimeout` at the
deadline, :class:`PoolDisconnected` for a connection that broke (the caller closes it).
"""
from __future__ import annotations

import fcntl
import select
import socket
import ssl
import termios
import time
from typing import Optional, Sequence

import numpy as np

from datadist.engine import native, tls
from datadist.engine.checksum import StreamSum
from datadist.engine.layout import Plan

from .._errors import PoolDisconnected, PoolTimeout

__all__ = ["send_plan", "recv_plan", "recv_into", "Arriving", "Leaving"]

#: The deadline of a transfer given none (seconds).
_NO_DEADLINE_S = 60.0


def _deadline(deadline: Optional[float]) -> float:
    if deadline is None:
        return time.monotonic() + _NO_DEADLINE_S
    if deadline <= time.monotonic():
        raise PoolTimeout("deadline passed during a transfer")
    return deadline


def _move(sock: socket.socket, plan: Plan, deadline: Optional[float], summed: Optional[StreamSum],
          send: bool) -> None:
    end = _deadline(deadline)
    try:
        if isinstance(sock, ssl.SSLSocket):
            if send:
                tls.send_plan(sock, plan, end, summed=summed)
            else:
                tls.recv_plan(sock, plan, end, summed)
            return
        left = end - time.monotonic()
        sock.settimeout(max(left, 0.001))  # the C loop needs a non-blocking descriptor
        ms = max(1, int(left * 1000))
        if send:
            native.sock_send(sock.fileno(), plan, ms, None, summed)
        else:
            native.sock_recv(sock.fileno(), plan, ms, summed)
    except TimeoutError:
        raise PoolTimeout("deadline passed during a transfer") from None
    except OSError as exc:
        raise PoolDisconnected(f"connection to the pool broke during a transfer: {exc}") from None


def send_plan(sock: socket.socket, plan: Plan, deadline: Optional[float], summed: Optional[StreamSum]) -> None:
    """Send the plan's source runs, in order, before ``deadline`` (None: a minute)."""
    _move(sock, plan, deadline, summed, True)


def recv_plan(sock: socket.socket, plan: Plan, deadline: Optional[float], summed: Optional[StreamSum]) -> None:
    """Receive into the plan's destination runs, in order, before ``deadline``."""
    _move(sock, plan, deadline, summed, False)


_ZERO = np.zeros(1, dtype=np.uint64)


def recv_into(sock: socket.socket, buf: memoryview, deadline: Optional[float], summed: Optional[StreamSum]) -> None:
    """Receive ``len(buf)`` bytes into the writable ``buf`` before ``deadline``."""
    n = len(buf)
    if not n:
        return
    addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    run = np.array([n], dtype=np.uint64)
    recv_plan(sock, Plan(_ZERO, np.array([addr], dtype=np.uint64), _ZERO, _ZERO, run), deadline, summed)


#: How long a worker waits for more of a value that is flowing, and the grace before the
#: flow's rate is judged (seconds).
_STALL_S = 0.005
#: Below this rate (bytes a second since the value started) a worker no longer waits for
#: the rest: the value is set aside until more of it has arrived.
_MIN_RATE = 16 << 20


def _flowing(start: float, moved: int, now: float) -> bool:
    """Whether bytes moving since ``start`` (``moved`` of them by ``now``) still flow: worth
    a short wait for the next ones rather than a return to the caller."""
    return now - start < _STALL_S or moved / (now - start) >= _MIN_RATE


class Arriving:
    """A value's raw bytes arriving on a server's connection, received as they come
    without holding a thread while they do not: :meth:`take` moves what has arrived into
    ``buf``, summed, and waits for more only while the value flows (the last wait shorter
    than a few milliseconds and its rate since the start above 16 MiB/s); otherwise it
    returns False and the caller looks again once more bytes are there (:meth:`waiting`).
    A sender that trickles or stops costs a worker a system call per look, not
    ``read_timeout``; the whole value must still arrive before ``deadline``."""

    def __init__(self, sock: socket.socket, buf: memoryview, deadline: float) -> None:
        self.sock, self.buf, self.deadline = sock, buf, deadline
        self.summed = StreamSum(len(buf))
        self.got = 0
        self._start = time.monotonic()

    def take(self) -> bool:
        """Receive what has arrived; True once every byte has.  :class:`PoolTimeout` past
        the deadline, :class:`PoolDisconnected` if the stream ends first."""
        n = len(self.buf)
        while self.got < n:
            now = time.monotonic()
            if now >= self.deadline:
                raise PoolTimeout(f"a value's bytes did not arrive in time ({self.got} of {n})")
            k = self._take_queued(n - self.got)
            if k:
                self.got += k
                continue
            wait_s = min(_STALL_S, self.deadline - now)
            if not _flowing(self._start, self.got, now) or not _readable(self.sock, wait_s):
                return False
        return True

    def waiting(self) -> bool:
        """Whether more bytes (or the stream's end) are there for :meth:`take`, or the
        deadline has passed (take then raises); never waits."""
        return time.monotonic() >= self.deadline or tls.buffered(self.sock) or _readable(self.sock, 0)

    def _take_queued(self, most: int) -> int:
        """Receive up to ``most`` bytes of those that have arrived, without waiting."""
        view = self.buf[self.got:self.got + most]
        if isinstance(self.sock, ssl.SSLSocket):
            self.sock.settimeout(0)
            try:
                k = self.sock.recv_into(view, most)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return 0
            except OSError as exc:
                raise PoolDisconnected(f"connection to the pool broke during a transfer: {exc}") from None
            if not k:
                raise PoolDisconnected("the peer closed the connection during a transfer")
            self.summed.add(view[:k])
            return k
        queued = _queued(self.sock)
        if queued < 0:
            raise PoolDisconnected("the peer closed the connection during a transfer")
        k = min(queued, most)
        if k:
            recv_into(self.sock, view[:k], self.deadline, self.summed)  # there already: never waits
        return k


class Leaving:
    """An answer (its frame, and a value's raw bytes behind it) leaving on a server's
    connection, sent as the peer takes it without holding a thread while it does not:
    :meth:`give` sends what the socket takes and waits for room only while the answer
    flows (as :class:`Arriving` waits for bytes); otherwise it returns False and the caller
    looks again once there is room (:meth:`waiting`).  A reader that stops reading costs a
    worker a system call per look, not ``read_timeout``; the whole answer must still leave
    before ``deadline``."""

    def __init__(self, sock: socket.socket, parts: "list[bytes | memoryview]", deadline: float,
                 fds: Sequence[int] = ()) -> None:
        """``fds``: descriptors passed with the answer's first bytes (a unix socket's)."""
        self.sock, self.deadline = sock, deadline
        self._parts = [memoryview(p).cast("B") for p in parts if len(p)]
        self._fds = list(fds)
        self.sent = 0
        self._start = time.monotonic()

    def give(self) -> bool:
        """Send what the socket takes; True once all has left.  :class:`PoolTimeout` past
        the deadline, :class:`PoolDisconnected` if the connection broke."""
        while self._parts:
            now = time.monotonic()
            if now >= self.deadline:
                raise PoolTimeout(f"an answer was not taken in time ({self.sent} bytes of it were)")
            k = self._send_now(self._parts[0])
            if k:
                self.sent += k
                self._parts[0] = self._parts[0][k:]
                if not len(self._parts[0]):
                    del self._parts[0]
                continue
            wait_s = min(_STALL_S, self.deadline - now)
            if not _flowing(self._start, self.sent, now) or not _writable(self.sock, wait_s):
                return False
        return True

    def waiting(self) -> bool:
        """Whether there is room for more (or the deadline has passed: :meth:`give` then
        raises); never waits."""
        return time.monotonic() >= self.deadline or _writable(self.sock, 0)

    def wait(self, until: float) -> bool:
        """Wait until there is room for more, at most until ``until``; whether there is."""
        return _writable(self.sock, max(0.0, min(until, self.deadline) - time.monotonic()))

    def _send_now(self, view: memoryview) -> int:
        """Send what the socket takes of ``view`` now, without waiting."""
        timeout = self.sock.gettimeout()
        self.sock.settimeout(0)  # a socket with a timeout would wait for room before sending
        try:
            if not self._fds:
                return self.sock.send(view)
            k = socket.send_fds(self.sock, [view], self._fds)
            self._fds = []  # they went with the first bytes
            return k
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return 0
        except OSError as exc:
            raise PoolDisconnected(f"connection to the pool's client broke during an answer: {exc}") from None
        finally:
            self.sock.settimeout(timeout)


def _queued(sock: socket.socket) -> int:
    """Bytes that have arrived on ``sock`` and not been read; -1 for the end of the stream
    (readable with nothing queued)."""
    queued = _fionread(sock)
    if queued or not _readable(sock, 0):
        return queued
    # Readable: bytes that came after the first count (they stay until read), or the end.
    return _fionread(sock) or -1


def _fionread(sock: socket.socket) -> int:
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), "little")


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    return _ready(sock, select.POLLIN, timeout_s)


def _writable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether ``sock`` has room to send (or an error to report) within ``timeout_s``."""
    return _ready(sock, select.POLLOUT, timeout_s)


def _ready(sock: socket.socket, events: int, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(sock.fileno(), events)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))
