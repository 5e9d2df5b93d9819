"""A graceful stop of ``ems-server`` (SIGTERM): it refuses new connections at once, lets
a request in flight finish (a READ whose reader is slow gets every byte), takes no new
request, gives back reservations that were not committed, spills what was committed and
exits 0 within its bound."""
from __future__ import annotations

import signal
import socket
import time

import numpy as np
import pytest

from ems_helpers import daemon_factory, daemon_queues  # noqa: F401
from waiting import PACED, until

from ems.client.address import parse_address
from ems.client.conn import Connection
from ems.pool import wire
from ems.pool.checksum import checksum

pytestmark = pytest.mark.timeout(120)

#: Larger than the loopback socket buffers, so the daemon's READ is blocked mid-send.
SIZE = 48 << 20


def _connect(address: str) -> Connection:
    return Connection(parse_address(address), wire.Hello(pid=1), time.monotonic() + 10)


def _put(conn: Connection, key: str, data: np.ndarray, commit: bool = True) -> int:
    off = conn.call(wire.Reserve([key], [data.size]), None, wire.ReserveReply).offsets[0]
    assert off >= 0
    conn.send(wire.Write(off, data.size), None)
    conn.sock.sendall(memoryview(data))
    if commit:
        stored = conn.call(wire.Commit([key], [off], [checksum(data)]), None, wire.CommitReply).stored
        assert stored == [True]
    return off


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def _daemon_read_all(sock: socket.socket) -> bool:
    """Whether the daemon's end of ``sock`` has nothing left unread."""
    return daemon_queues(sock)[1] == 0


def test_sigterm_finishes_the_read_in_flight_and_exits_0(daemon_factory, tmp_path):  # noqa: F811
    d = daemon_factory(tcp=True, capacity="256M", disk_dir=tmp_path / "disk",
                       extra=["--drain-timeout", "30", "--log-level", "INFO"])
    host, _, port = d.tcp[len("tcp://"):].rpartition(":")
    data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    writer = _connect(d.tcp)
    _put(writer, "kept", data[:1 << 20])
    _put(writer, "pending", data[:1 << 20], commit=False)  # reserved and written, never committed
    reader = _connect(d.tcp)
    _put(reader, "big", data)
    got = reader.call(wire.Get(["big"]), None, wire.GetReply)
    assert list(got.sizes) == [SIZE]
    reader.send(wire.Read(got.offsets[0], SIZE), None)
    head, _ = wire.recv_msg(reader.sock, time.monotonic() + 10)
    assert isinstance(head, wire.ReadReply) and head.size == SIZE
    out = np.zeros(SIZE, dtype=np.uint8)
    view = memoryview(out)
    first = reader.sock.recv_into(view[:1 << 20])  # the daemon is now blocked sending the rest

    d.proc.send_signal(signal.SIGTERM)
    until(lambda: "new connections are refused" in d.log.read_text(), every=PACED)
    assert _refused(host, int(port))  # at once: none waits in the closing listener's backlog
    assert d.alive()  # still sending to the reader
    reader.sock.settimeout(30)
    wire.recv_exact(reader.sock, view[first:], time.monotonic() + 30)
    assert checksum(out) == checksum(data)  # every byte, none cut
    with pytest.raises(Exception):  # no new request is taken: the connection ends
        reader.call(wire.Ping(), time.monotonic() + 10, wire.Pong)
    assert d.proc.wait(30) == 0
    log = d.log.read_text()
    assert "aborted 1 puts reserved but not committed" in log and "cut" not in log
    writer.close()
    reader.close()

    again = daemon_factory(tmp_path / "d2", tcp=True, disk_dir=tmp_path / "disk")
    conn = _connect(again.tcp)
    hits = conn.call(wire.Exists(["kept", "pending"], False), None, wire.ExistsReply).hits
    assert hits == 1  # the committed value was spilled; the uncommitted one never existed
    conn.close()


def test_a_stalled_request_is_cut_at_the_drain_bound(daemon_factory):  # noqa: F811
    """A READ of 32 MiB whose client stops reading holds its worker in the send; SIGTERM
    cuts it at --drain-timeout.  A WRITE whose bytes stopped holds no worker (the session
    waits aside): it is not one of the requests cut, and does not delay the stop."""
    d = daemon_factory(tcp=True, capacity="128M", extra=["--drain-timeout", "1", "--read-timeout", "60"])
    conn = _connect(d.tcp)
    size = 32 << 20
    _put(conn, "big", np.zeros(size, dtype=np.uint8))
    got = conn.call(wire.Get(["big"]), None, wire.GetReply)
    conn.send(wire.Read(got.offsets[0], size), None)  # and then read nothing: the READ stays in flight
    until(lambda: daemon_queues(conn.sock)[0] > 0, every=0.01)  # it could not send it all
    stalled = _connect(d.tcp)
    off = stalled.call(wire.Reserve(["k"], [1 << 20]), None, wire.ReserveReply).offsets[0]
    stalled.send(wire.Write(off, 1 << 20), None)
    stalled.sock.sendall(b"\0" * 4096)  # and then nothing
    until(lambda: _daemon_read_all(stalled.sock), every=0.01)
    started = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    assert time.monotonic() - started < 15
    assert "cut 1 requests still in flight" in d.log.read_text()
    stalled.close()
    conn.close()
