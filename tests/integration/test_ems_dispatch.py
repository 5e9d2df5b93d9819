"""How a live ``ems-server`` shares its worker threads among connections: requests a
connection sends back to back are answered in order, more connections than workers are
all served, an idle connection is closed after ``--idle-timeout`` while a busy one is not,
and the daemon stops promptly with connections armed and half-sent requests held."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import List

import pytest

from ems_helpers import daemon_factory  # noqa: F401

from ems.pool import wire

pytestmark = pytest.mark.timeout(120)

#: More connections than the daemon's worker threads (16).
CONNECTIONS = 40


def _hello(daemon) -> socket.socket:
    """A raw connection past HELLO (the daemon's descriptors closed at once)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(Path(daemon.dir) / "ems.sock"))
    deadline = time.monotonic() + 10
    wire.send_msg(s, wire.Hello(pid=os.getpid()), deadline)
    reply, fds = wire.recv_msg(s, deadline, want_fds=2)
    for fd in fds:
        os.close(fd)
    assert isinstance(reply, wire.HelloReply), reply
    return s


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_back_to_back_requests_on_many_connections_are_answered_in_order(daemon_factory) -> None:
    daemon = daemon_factory()
    socks: List[socket.socket] = [_hello(daemon) for _ in range(CONNECTIONS)]
    try:
        # PING and STATS alternate: a reply out of order has the wrong type
        frames = b"".join(wire.encode(wire.Ping() if i % 2 == 0 else wire.Stats()) for i in range(30))
        for s in socks:
            s.sendall(frames)
        for n, s in enumerate(socks):
            for i in range(30):
                reply, _ = wire.recv_msg(s, time.monotonic() + 10)
                want = wire.Pong if i % 2 == 0 else wire.StatsReply
                assert isinstance(reply, want), f"connection {n}, reply {i}: {type(reply).__name__}"
    finally:
        for s in socks:
            s.close()


def test_an_idle_connection_is_closed_after_idle_timeout_and_a_busy_one_is_not(daemon_factory) -> None:
    daemon = daemon_factory(extra=["--idle-timeout", "1"])
    idle, busy = _hello(daemon), _hello(daemon)
    try:
        start = time.monotonic()
        idle.settimeout(0.2)  # paces the busy connection's requests while the idle one waits
        while True:
            try:
                if _closed(idle):
                    break
            except socket.timeout:
                pass
            assert time.monotonic() - start < 10, "the idle connection was never closed"
            wire.send_msg(busy, wire.Ping(), time.monotonic() + 5)
            reply, _ = wire.recv_msg(busy, time.monotonic() + 5)
            assert isinstance(reply, wire.Pong)
        waited = time.monotonic() - start
        assert 0.9 <= waited < 5, f"closed after {waited:.2f} s with --idle-timeout 1"
        wire.send_msg(busy, wire.Stats(), time.monotonic() + 5)
        reply, _ = wire.recv_msg(busy, time.monotonic() + 5)
        assert isinstance(reply, wire.StatsReply)
    finally:
        idle.close()
        busy.close()


def test_stop_with_armed_connections_and_half_sent_requests_is_prompt(daemon_factory) -> None:
    daemon = daemon_factory()
    socks = [_hello(daemon) for _ in range(CONNECTIONS)]
    try:
        for s in socks[::2]:
            s.sendall(wire.encode(wire.Stats())[:5])  # part of a header, then nothing
        wire.send_msg(socks[1], wire.Ping(), time.monotonic() + 5)
        assert isinstance(wire.recv_msg(socks[1], time.monotonic() + 5)[0], wire.Pong)
        start = time.monotonic()
        assert daemon.stop() == 0
        assert time.monotonic() - start < 10
        for s in socks:
            assert _closed(s)
    finally:
        for s in socks:
            s.close()
