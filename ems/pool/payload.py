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

import socket
import ssl
import time
from typing import Optional

import numpy as np

from datadist.engine import native, tls
from datadist.engine.checksum import StreamSum
from datadist.engine.layout import Plan

from .._errors import PoolDisconnected, PoolTimeout

__all__ = ["send_plan", "recv_plan", "recv_into"]

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
