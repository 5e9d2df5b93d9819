"""Hostile bytes at a live engine's listening address: malformed, truncated, oversized and
random frames, slow senders and idle floods.  Throughout, the engine keeps serving a
legitimate decoder (real links and pulls, bytes checked), its RSS grows by less than
64 MiB and its thread count does not grow, and no byte of its registered cache changes.
Every attack runs on loopback, bounded in count and time.
"""
from __future__ import annotations

import os
import random
import socket
import struct
import time
from typing import Any, List

import numpy as np
import pytest

from datadist.engine import wire
from harness import (DECODER_ID, PROMPT_ID, Desc, Ref, base_config, blocks_key, expect_blocks, free_port,
                     rss_bytes)

pytestmark = pytest.mark.timeout(180)

BLOCKS = Desc(2, (4, 8, 32), "fp16")
RSS_GROWTH_LIMIT = 64 << 20


def _hello() -> bytes:
    return wire.encode(wire.Hello(cluster_id=99, remote_cluster_id=PROMPT_ID, host="attacker", pid=1,
                                  ctrl={"fd": 3, "size": 4096, "base": 4096, "nonce": 1}))


def _send(port: int, data: bytes, linger: float = 0.0) -> None:
    """Connect, send ``data``, and close (after reading what the engine answers, if any)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            s.settimeout(linger or 0.2)
            while s.recv(65536):
                pass
        except OSError:
            pass  # the engine closing on us is the expected answer


class Target:
    """A PROMPT engine with a registered cache, and a way to check it still serves."""

    def __init__(self, peer_factory: Any) -> None:
        self.port = free_port()
        self.peer = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID, base_config("tcp", listen_port=self.port))
        self.peer.register("kv", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
        self.data = self.peer.fill("kv", BLOCKS, 17)
        self.factory = peer_factory
        self.rounds = 0
        self.threads = len(self.peer.snapshot()["threads"])
        self.rss = rss_bytes(self.peer.pid)

    def serves(self) -> None:
        """A new decoder links, pulls two blocks (bytes checked) and unlinks."""
        self.rounds += 1
        dec = self.factory("peer", f"decoder{self.rounds}", "DECODER", DECODER_ID + self.rounds, base_config("tcp"))
        dec.alloc("dst", BLOCKS, blocks=True)
        base = dec.fill("dst", BLOCKS, 1)
        t0 = time.monotonic()
        dec.link(self.peer, port=self.port)
        assert time.monotonic() - t0 < 3.0, "linking was held up"
        dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [1, 3], [0, 2])
        np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, self.data, [1, 3], [0, 2],
                                                                      BLOCKS.row_bytes))
        dec.call("unlink", [(PROMPT_ID, "127.0.0.1", self.port)])
        dec.shutdown()

    def intact(self) -> None:
        np.testing.assert_array_equal(self.peer.read("kv"), self.data)
        assert rss_bytes(self.peer.pid) - self.rss < RSS_GROWTH_LIMIT
        assert len(self.peer.snapshot()["threads"]) <= self.threads


def test_malformed_and_oversized_first_frames(peer_factory: Any) -> None:
    t = Target(peer_factory)
    good = _hello()
    head = good[:wire.HEADER_SIZE]
    magic, version, mtype, res, blen, alen = struct.unpack("<4sBBHII", head)
    attacks: List[bytes] = [
        # the 66-byte frame: an array section shorter than its count
        struct.pack("<4sBBHII", magic, version, int(wire.MsgType.ATTACH), 0, 8, 42) + struct.pack("<Q", 99)
        + struct.pack("<Q", 1 << 40) + b"\0" * 26,
        struct.pack("<4sBBHII", magic, version, mtype, 0, 0xFFFFFFF0, 0),           # 4 GiB body before any hello
        struct.pack("<4sBBHII", magic, version, mtype, 0, blen, 0xFFFFFFF8),         # 4 GiB of arrays
        struct.pack("<4sBBHII", magic, version, int(wire.MsgType.PUSH), 0, 40, 1 << 20),  # a request before a link
        struct.pack("<4sBBHII", b"XXXX", version, mtype, 0, blen, alen) + good[16:],
        struct.pack("<4sBBHII", magic, version + 1, mtype, 0, blen, alen) + good[16:],
        good[:-3],                                                                    # truncated
        head + b"\xff" * blen,                                                        # garbage body
        good.replace(b'"fd":3', b'"fd":"x"'),                                         # wrong JSON types
        good.replace(b'{"fd"', b'["fd"'),                                             # not JSON
    ]
    for data in attacks:
        _send(t.port, data)
    t.serves()
    t.intact()


def test_random_and_mutated_frames(peer_factory: Any) -> None:
    t = Target(peer_factory)
    rng = random.Random(1234)
    good = _hello()
    deadline = time.monotonic() + 20
    for i in range(150):
        if time.monotonic() > deadline:
            break
        if i % 3 == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        else:
            data = bytearray(good)
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data[:rng.randrange(1, len(data) + 1)]) if i % 3 == 2 else bytes(data)
        _send(t.port, data)
        if i % 50 == 49:
            t.serves()
    t.serves()
    t.intact()


def test_slow_senders_and_idle_floods_delay_nobody(peer_factory: Any) -> None:
    t = Target(peer_factory)
    held: List[socket.socket] = []
    try:
        for i in range(40):  # slowloris: one byte of a header, then silence
            s = socket.create_connection(("127.0.0.1", t.port), timeout=5)
            s.sendall(_hello()[:1 + i % 10])
            held.append(s)
        for _ in range(200):  # an idle flood beyond the engine's pending limit
            held.append(socket.create_connection(("127.0.0.1", t.port), timeout=5))
        t.serves()  # a legitimate peer links and pulls at once
        t.intact()
        # the engine let go of the idle connections: they see the end of their streams
        closed = 0
        for s in held[:40]:
            s.settimeout(10)
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == 40
    finally:
        for s in held:
            s.close()
    t.serves()
    assert os.path.exists(f"/proc/{t.peer.pid}")


def test_nothing_an_agent_step_raises_ends_the_agent(peer_factory: Any) -> None:
    """An exception escaping one step of the agent's loop (a bug, a call queued from another
    thread) is logged and the loop goes on: the engine still answers new links."""
    target = Target(peer_factory)
    assert target.peer.call("agent_faults", 3)
    target.serves()
    assert target.peer.call("agent_faults", 0)  # the agent thread still runs
