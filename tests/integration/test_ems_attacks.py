"""Hostile bytes at a live ``ems-server``: oversized, malformed and random frames before
HELLO, slow senders, idle floods and too many connections.  Throughout, a legitimate
client keeps saving and loading (bytes checked), the daemon's RSS grows by less than
64 MiB, it runs fewer than 100 threads with 300 idle connections, and stored values do
not change.  Loopback only, bounded in count and time.
"""
from __future__ import annotations

import random
import socket
import struct
import time
from pathlib import Path
from typing import List

import pytest
import torch

from ems_helpers import daemon_factory, init_cc, kvcache  # noqa: F401
from harness import rss_bytes
from waiting import PACED, until

from ems import Ems, EmsErrorCode, EmsException
from ems.pool import wire

pytestmark = pytest.mark.timeout(180)

BLOCK = 4
RSS_GROWTH_LIMIT = 64 << 20


def _threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def _connect(daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(Path(daemon.dir) / "ems.sock"))
    return s


def _send(daemon, data: bytes) -> None:
    with _connect(daemon) as s:
        try:
            s.sendall(data)
            s.settimeout(0.5)
            while s.recv(65536):
                pass
        except OSError:
            pass


class Client:
    """A legitimate client with one saved value, able to prove the daemon still serves."""

    def __init__(self, daemon) -> None:
        self.cc = init_cc(daemon.dir)
        self.kv = kvcache(layers=2, kv=2, blocks=8, block_size=BLOCK, seed=9)
        self.cc.register_kvcache(self.kv)
        self.saved = [[t[1].clone() for t in layer] for layer in self.kv]
        assert self.cc.save(slot_mapping=list(range(BLOCK, 2 * BLOCK)), hashes=[11], offsets=[BLOCK]).success == 1
        self.round = 0

    def serves(self) -> None:
        self.round += 1
        for layer in self.kv:
            for t in layer:
                t[2 + self.round % 4].zero_()
        dst = 2 + self.round % 4
        assert self.cc.load(slot_mapping=list(range(dst * BLOCK, (dst + 1) * BLOCK)), hashes=[11],
                            offsets=[BLOCK]).success == 1
        for layer, saved in zip(self.kv, self.saved):
            for t, s in zip(layer, saved):
                assert torch.equal(t[dst], s)


@pytest.fixture
def served(daemon_factory):
    daemon = daemon_factory(extra=["--read-timeout", "1"])
    client = Client(daemon)
    yield daemon, client
    Ems._shutdown()


def _head(op: int, blen: int, alen: int = 0, magic: bytes = wire.MAGIC,
          version: int = wire.PROTOCOL_VERSION) -> bytes:
    """A frame header of the pool protocol (datadist.engine.codec.HEADER)."""
    return struct.pack("<4sBBHII", magic, version, op, 0, blen, alen)


def test_bad_frames_before_hello(served) -> None:
    daemon, client = served
    rss = rss_bytes(daemon.pid)
    hello = wire.encode(wire.Hello(access_id=None, access_key=None, pid=1))
    named = wire.encode(wire.Hello(access_id="ab", access_key=None, pid=1))
    nested = b"[" * 60000  # JSON nested past the recursion limit (the one JSON field: STATS_REPLY)
    attacks: List[bytes] = [
        _head(wire.Op.HELLO, (64 << 20) - 1),              # a 64 MiB frame announced before HELLO
        _head(wire.Op.HELLO, 0xFFFFFFFF),
        _head(wire.Op.HELLO, 0, 0xFFFFFFF8),                # an array section the protocol has none of
        _head(wire.Op.HELLO, 20) + b"\x00" * 20,           # a body too short for HELLO's fields
        struct.pack(">I", 20) + b"\x00" * 20,             # the previous protocol's framing
        _head(200, 4) + b"\x00" * 4,                       # an op no message has
        _head(wire.Op.HELLO, len(hello) - 16, magic=b"XXXX") + hello[16:],
        _head(wire.Op.HELLO, len(hello) - 16, version=wire.PROTOCOL_VERSION - 1) + hello[16:],
        hello[:-5],                                        # truncated
        named.replace(b"ab", b"\xff\xfe"),                # access_id that is not UTF-8
        # after the header (16 bytes) and HELLO's fixed fields (17): access_id's length, overrunning
        hello[:33] + struct.pack("<I", 0xFFFFFFF0) + hello[37:],
        _head(wire.Op.STATS_REPLY, 4 + len(nested)) + struct.pack("<I", len(nested)) + nested,
    ]
    held = []
    for data in attacks * 5:
        _send(daemon, data)
    for _ in range(40):  # announce 64 MiB each and send nothing more
        s = _connect(daemon)
        s.sendall(_head(wire.Op.HELLO, (64 << 20) - 1))
        held.append(s)
    client.serves()
    assert rss_bytes(daemon.pid) - rss < RSS_GROWTH_LIMIT
    for s in held:
        s.close()
    client.serves()


def test_random_frames(served) -> None:
    daemon, client = served
    rng = random.Random(99)
    hello = wire.encode(wire.Hello(access_id=None, access_key=None, pid=1))
    for i in range(150):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        else:
            mutated = bytearray(hello)
            for _ in range(rng.randrange(1, 6)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            data = bytes(mutated)
        _send(daemon, data)
        if i % 50 == 49:
            client.serves()
    client.serves()


def test_idle_flood_and_slow_senders_use_no_thread_each(served) -> None:
    daemon, client = served
    held: List[socket.socket] = []
    try:
        for i in range(300):
            s = _connect(daemon)
            if i % 3 == 0:
                s.sendall(b"\x40")  # one byte of a header, then silence
            held.append(s)
        client.serves()
        assert _threads(daemon.pid) < 100
        # slow senders are cut off after --read-timeout (1 s); idle ones simply wait
        for s in held[:30:3]:
            s.settimeout(10)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        for s in held:
            s.close()
    client.serves()


def test_connection_cap_refuses_clearly(daemon_factory) -> None:
    daemon = daemon_factory(extra=["--max-connections", "4"])
    held = [_connect(daemon) for _ in range(4)]
    try:
        extra = _connect(daemon)
        reply, _ = wire.recv_msg(extra, time.monotonic() + 5)
        assert isinstance(reply, wire.Error) and reply.kind == wire.ErrorKind.BUSY
        assert "--max-connections" in reply.message
        extra.close()
        Ems._shutdown()
        with pytest.raises(EmsException) as err:
            init_cc(daemon.dir)
        assert err.value.status_code() == EmsErrorCode.EMS_IO_ERROR
        assert "max-connections" in err.value.message()
    finally:
        for s in held:
            s.close()
    Ems._shutdown()

    def admitted() -> bool:  # the daemon frees the slots as it sees the connections end
        try:
            init_cc(daemon.dir)
            return True
        except EmsException:
            return False
    until(admitted, 10, "a client admitted once connections closed", every=PACED)
    cc = Ems.get_cc()
    assert cc.exists([1]).success == 0
    Ems._shutdown()
