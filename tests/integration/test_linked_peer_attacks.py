"""Hostile frames from a peer that linked legitimately (it holds the link secret and passed
the handshake), and hostile answers from a PROMPT an honest decoder linked to.

A raw peer performs the real handshake with the project's own ``wire.encode`` (the
authenticated opening with the shared secret, HELLO, HELLO_ACK, ATTACH) and then sends
post-link request frames by hand.  Throughout, the engine must survive, answer with an
error or close that one link, keep serving an honest decoder with correct bytes within its
deadline, never answer with bytes from outside its registered caches, keep its RSS
bounded, and keep its caches unchanged.  The reverse direction links a real decoder to a
raw hostile PROMPT server.  Every attack runs on loopback, bounded in count and time.
"""
from __future__ import annotations

import os
import random
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, cast

import numpy as np
import pytest

from datadist.engine import auth, wire
from datadist.engine.errors import Fault
from datadist.engine.handshake import ClientAuth
from harness import (DECODER_ID, PROMPT_ID, Desc, Peer, PeerError, Ref, base_config, blocks_key, close_peers,
                     expect_blocks, free_port, rss_bytes)
from waiting import PACED, until

pytestmark = pytest.mark.timeout(120)

SECRET = "linked but hostile"
TIMEOUT_MS = 1000
#: 2 KiB tensors (the transfers) and 2 MiB tensors (what a plan half may name many times).
BLOCKS = Desc(2, (4, 8, 32), "fp16")
BIG = Desc(2, (4, 256, 1024), "fp16")
RSS_GROWTH_LIMIT = 64 << 20
#: Longest a refused or served request may take to be answered (the deadline and slack).
ANSWER_S = 1.5
U64MAX = (1 << 64) - 1
_HDR = struct.Struct("<4sBBHII")


def frame(mtype: int, body: bytes = b"", arrays: bytes = b"", *, blen: Optional[int] = None,
          alen: Optional[int] = None, version: int = wire.VERSION, magic: bytes = b"DDKV", reserved: int = 0) -> bytes:
    """A frame built by hand (header fields as given, lengths from the parts by default)."""
    return _HDR.pack(magic, version, int(mtype), reserved, len(body) if blen is None else blen,
                     len(arrays) if alen is None else alen) + body + arrays


def u64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


# --------------------------------------------------------------------------- a raw linked peer


class RawPeer:
    """A peer linked by hand: the real handshake, then whatever frames the test sends on
    its request stream (``req``: the victim's agent serves it)."""

    def __init__(self, port: int, remote_id: int, my_id: int, *, secret: Optional[str] = SECRET,
                 pid: int = 4242, host: str = "attacker") -> None:
        self.my_id = my_id
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.req = s
        self.attach: Optional[socket.socket] = None
        hello = wire.Hello(cluster_id=my_id, remote_cluster_id=remote_id, host=host, pid=pid,
                           ctrl={"fd": 3, "size": 4096, "base": 4096, "nonce": 1}, backend="tcp")
        if secret is not None:
            state = ClientAuth(auth.Secret(secret.encode()), str(my_id).encode(), str(remote_id).encode())
            s.sendall(wire.encode(wire.Hello(cluster_id=my_id, remote_cluster_id=remote_id, nonce=state.nonce_hex)))
            challenge = wire.read_message(s)
            assert isinstance(challenge, wire.HelloAck) and challenge.challenge, challenge
            proof = state.answer(challenge.nonce, challenge.proof)
            assert proof is not None, "the engine did not prove the secret"
            hello.nonce, hello.proof = state.nonce_hex, proof
        s.sendall(wire.encode(hello))
        ack = wire.read_message(s)
        assert isinstance(ack, wire.HelloAck) and not ack.status, ack
        a = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.attach = a
        a.sendall(wire.encode(wire.Attach(cluster_id=my_id, token=ack.attach_token)))
        reply = wire.read_message(a)
        assert isinstance(reply, wire.Reply) and not reply.status, reply

    def send(self, data: bytes) -> None:
        self.req.sendall(data)

    def answer(self, timeout: float = 5.0) -> wire.Message:
        self.req.settimeout(timeout)
        return wire.read_message(self.req)

    def rpc(self, msg: wire.Message, timeout: float = 5.0) -> wire.Message:
        self.send(wire.encode(msg))
        return self.answer(timeout)

    def recv_exact(self, n: int, timeout: float = 5.0) -> bytes:
        self.req.settimeout(timeout)
        buf = bytearray()
        while len(buf) < n:
            got = self.req.recv(min(n - len(buf), 1 << 20))
            if not got:
                raise ConnectionResetError(f"end of stream after {len(buf)} of {n} bytes")
            buf += got
        return bytes(buf)

    def ended(self, timeout: float) -> bool:
        """Whether the victim ends this link's request stream within ``timeout`` (bytes it
        still sends are discarded)."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.req], [], [], left)
            if ready:
                try:
                    if not self.req.recv(65536):
                        return True
                except OSError:
                    return True

    def close(self) -> None:
        for s in (self.req, self.attach):
            if s is not None:
                s.close()


# --------------------------------------------------------------------------- the victim


class Target:
    """A PROMPT (link secret set) with two registered blocks caches, and an honest decoder
    linked to it that pulls and checks bytes."""

    def __init__(self) -> None:
        self.port = free_port()
        self.peers: List[Peer] = []
        self.raws: List[RawPeer] = []
        self._ids = iter(range(100, 1 << 20))
        self.prompt = self._spawn(Peer("prompt", "PROMPT", PROMPT_ID,
                                       base_config("tcp", listen_port=self.port, sync_kv_timeout=TIMEOUT_MS,
                                                   link_secret=SECRET)))
        self.decoder = self._spawn(Peer("honest", "DECODER", DECODER_ID,
                                        base_config("tcp", sync_kv_timeout=TIMEOUT_MS, link_secret=SECRET)))
        self.prompt.wait_ready()
        self.prompt.register("kv", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
        self.prompt.register("big", BIG, blocks=True, bkey=blocks_key(PROMPT_ID, 2))
        self.data = self.prompt.fill("kv", BLOCKS, 17)
        self.big = self.prompt.fill("big", BIG, 18)
        self.decoder.wait_ready()
        self.decoder.alloc("dst", BLOCKS, blocks=True)
        self.decoder.link(self.prompt, port=self.port)

    def _spawn(self, peer: Peer) -> Peer:
        self.peers.append(peer)
        return peer

    def alive(self) -> bool:
        return all(p.alive for p in self.peers)

    def heal(self) -> None:
        """Close the raw peers of the last test and link the honest decoder afresh (a test
        may have broken its link).  Its destination cache is allocated again too: the
        transfer it kept for the old one would run over the old link first (see
        test_honest_decoder_is_served_right_after_relinking)."""
        for raw in self.raws:
            raw.close()
        self.raws = []
        self.decoder.call("unlink", [(PROMPT_ID, "127.0.0.1", self.port)])
        self.decoder.link(self.prompt, port=self.port)
        self.decoder.call("free", "dst")
        self.decoder.alloc("dst", BLOCKS, blocks=True)

    def raw(self, **kwargs: Any) -> RawPeer:
        peer = RawPeer(self.port, PROMPT_ID, kwargs.pop("my_id", None) or next(self._ids), **kwargs)
        self.raws.append(peer)
        return peer

    def lookup(self, peer: RawPeer, model_id: int = 1) -> wire.Resolved:
        got = peer.rpc(wire.Resolve(kind="blocks", cluster_id=PROMPT_ID, model_id=model_id))
        assert isinstance(got, wire.Resolved) and not got.status, got
        return got

    def honest_pull(self) -> Optional[str]:
        """The honest decoder pulls blocks [1, 3] into [0, 2]: None if it got the right
        bytes, else what went wrong."""
        base = self.decoder.fill("dst", BLOCKS, 1)
        try:
            self.decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [1, 3], [0, 2])
        except PeerError as exc:
            return f"{exc.exc_type}({exc.status_code}): {exc.message[:160]}"
        want = expect_blocks(base, self.data, [1, 3], [0, 2], BLOCKS.row_bytes)
        return None if np.array_equal(self.decoder.read("dst"), want) else "wrong bytes"

    def serves(self) -> None:
        assert self.honest_pull() is None

    def intact(self) -> None:
        np.testing.assert_array_equal(self.prompt.read("kv"), self.data)
        np.testing.assert_array_equal(self.prompt.read("big"), self.big)

    def close(self) -> None:
        for raw in self.raws:
            raw.close()
        close_peers(reversed(self.peers))


class _Holder:
    def __init__(self) -> None:
        self.target: Optional[Target] = None

    def get(self) -> Target:
        if self.target is not None and not self.target.alive():
            self.close()
        if self.target is None:
            self.target = Target()
        else:
            self.target.heal()
        return self.target

    def close(self) -> None:
        target, self.target = self.target, None
        if target is not None:
            target.close()


@pytest.fixture(scope="module")
def holder() -> Iterator[_Holder]:
    h = _Holder()
    yield h
    h.close()


@pytest.fixture
def target(holder: _Holder) -> Target:
    return holder.get()


class RssPeak:
    """The largest RSS of ``pid`` seen while the block runs (polled from a thread)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = rss_bytes(pid)
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except (OSError, AssertionError):
                return

    def __enter__(self) -> "RssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base


# --------------------------------------------------------------------------- probing


class Prober:
    """Sends hostile frames on a raw link, re-linking whenever the victim closes one, and
    checks every answer: a pull or SUM answered OK must name runs inside the cache (and a
    pull's bytes must be the cache's), every answer must come within ``ANSWER_S``."""

    def __init__(self, target: Target) -> None:
        self.t = target
        self.problems: List[str] = []
        self.counts = {"answered": 0, "closed": 0}
        self._new()

    def _new(self) -> None:
        self.peer = self.t.raw()
        self.r = self.t.lookup(self.peer)

    def inside(self, bases: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> bool:
        addrs = [int(a) for a in self.r.arrays[0]]
        size = self.r.tensor_size
        for b in bases.tolist():
            for o, n in zip(offs.tolist(), lens.tolist()):
                if n and not any(a <= b + o and b + o + n <= a + size for a in addrs):
                    return False
        return True

    def expected(self, bases: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> bytes:
        addrs = [int(a) for a in self.r.arrays[0]]
        out = bytearray()
        for b in bases.tolist():
            for o, n in zip(offs.tolist(), lens.tolist()):
                i = next(i for i, a in enumerate(addrs) if a <= b + o < a + self.r.tensor_size)
                start = b + o - addrs[i]
                out += self.t.data[i][start:start + n].tobytes()
        return bytes(out)

    def probe(self, label: str, data: bytes, payload: bytes = b"", one_way: bool = False) -> None:
        """Send ``data`` (a frame; ``payload`` behind it) and judge the answer; a one-way
        frame is followed by a RESOLVE whose answer shows the link still works."""
        msg: Optional[wire.Message] = None
        try:
            cls, blen, _ = wire.parse_header(data[:wire.HEADER_SIZE])
            msg = wire.decode_frame(cls, memoryview(data)[wire.HEADER_SIZE:], blen)
        except wire.WireError:
            pass
        probe = wire.encode(wire.Resolve(kind="blocks", cluster_id=PROMPT_ID, model_id=1)) if one_way else b""
        t0 = time.monotonic()
        try:
            self.peer.send(data + payload + probe)
            ans = self.peer.answer(ANSWER_S + 1)
            elapsed = time.monotonic() - t0
            self._judge(label, msg, ans, elapsed)
            if one_way:
                assert isinstance(ans, wire.Resolved), f"{label}: a one-way frame was answered with {ans}"
        except (ConnectionError, OSError, wire.WireError) as exc:
            if isinstance(exc, socket.timeout):
                self.problems.append(f"{label}: neither answered nor closed in {ANSWER_S + 1} s")
            self.counts["closed"] += 1
            self.peer.close()
            self._new()

    def _judge(self, label: str, msg: Optional[wire.Message], ans: wire.Message, elapsed: float) -> None:
        self.counts["answered"] += 1
        if elapsed > ANSWER_S:
            self.problems.append(f"{label}: answered after {elapsed:.2f} s")
        ok = getattr(ans, "status", 1) == 0
        plan = tuple(msg.arrays) if isinstance(msg, (wire.Pull, wire.Sum)) and len(msg.arrays) == 3 else None
        if ok and isinstance(msg, wire.Sum) and isinstance(ans, wire.Summed) and plan is not None:
            if not self.inside(*plan):
                self.problems.append(f"{label}: checksum of memory outside the cache answered")
        if ok and isinstance(msg, wire.Pull) and ans is wire.OK and plan is not None:
            nbytes = plan[0].shape[0] * sum(plan[2].tolist())
            if nbytes > (16 << 20):
                self.problems.append(f"{label}: a pull of {nbytes} bytes answered OK")
                raise ConnectionResetError("resynchronise")
            got = self.peer.recv_exact(nbytes)
            if not self.inside(*plan):
                self.problems.append(f"{label}: OK pull of {nbytes} bytes OUTSIDE the cache: {got[:32].hex()}")
            elif got != self.expected(*plan):
                self.problems.append(f"{label}: pull bytes differ from the cache")


def _plan_cases(r: wire.Resolved) -> List[Tuple[str, wire.Message]]:
    a0, a1 = (int(x) for x in r.arrays[0])
    ts, ep = r.tensor_size, r.epoch
    good = [u64(a0, a1), u64(0), u64(64)]
    cases: List[Tuple[str, wire.Message]] = []
    one = [u64(a0), u64(0), u64(64)]
    for cls in (wire.Pull, wire.Sum):
        name = cls.__name__
        cases += [
            (f"{name} 2 arrays", cls(cache_id=1, epoch=ep, nbytes=128, arrays=[u64(a0, a1), u64(0)])),
            (f"{name} 4 arrays", cls(cache_id=1, epoch=ep, nbytes=128, arrays=good + [u64(1)])),
            (f"{name} no arrays", cls(cache_id=1, epoch=ep, nbytes=0, arrays=[])),
            (f"{name} offs/lens differ", cls(cache_id=1, epoch=ep, nbytes=128,
                                              arrays=[u64(a0, a1), u64(0, 64), u64(64)])),
            (f"{name} no bases", cls(cache_id=1, epoch=ep, nbytes=0, arrays=[u64(), u64(0), u64(64)])),
            (f"{name} end at tensor end", cls(cache_id=1, epoch=ep, nbytes=64, arrays=[u64(a0), u64(ts - 64), one[2]])),
            (f"{name} past tensor end", cls(cache_id=1, epoch=ep, nbytes=64, arrays=[u64(a0), u64(ts - 63), one[2]])),
            (f"{name} run across tensors", cls(cache_id=1, epoch=ep, nbytes=ts, arrays=[u64(a0), u64(64), u64(ts)])),
            (f"{name} base inside a tensor", cls(cache_id=1, epoch=ep, nbytes=64, arrays=[u64(a0 + 8)] + one[1:])),
            (f"{name} base before", cls(cache_id=1, epoch=ep, nbytes=64, arrays=[u64(a0 - 64), u64(0), u64(64)])),
            (f"{name} base after", cls(cache_id=1, epoch=ep, nbytes=64, arrays=[u64(a1 + ts), u64(0), u64(64)])),
            (f"{name} raw outside", cls(cache_id=-1, epoch=0, nbytes=64, arrays=[u64(a1 + ts), u64(0), u64(64)])),
            (f"{name} raw inside", cls(cache_id=-1, epoch=0, nbytes=64, arrays=[u64(a0), u64(0), u64(64)])),
            (f"{name} raw across a gap", cls(cache_id=-1, epoch=0, nbytes=2 * ts,
                                             arrays=[u64(a0), u64(0), u64(2 * ts)])),
            (f"{name} stale epoch", cls(cache_id=1, epoch=ep + 1, nbytes=128, arrays=good)),
            (f"{name} nbytes off by one", cls(cache_id=1, epoch=ep, nbytes=129, arrays=good)),
            (f"{name} summed", cls(cache_id=1, epoch=ep, nbytes=128, summed=True, arrays=good)),
        ]
        for v in (0, 1, 1 << 31, 1 << 32, (1 << 62) - 1, 1 << 62, 1 << 63, U64MAX):
            cases += [
                (f"{name} off={v}", cls(cache_id=1, epoch=ep, nbytes=64, arrays=[u64(a0), u64(v), u64(64)])),
                (f"{name} len={v}", cls(cache_id=1, epoch=ep, nbytes=v, arrays=[u64(a0), u64(0), u64(v)])),
                (f"{name} base={v}", cls(cache_id=1, epoch=ep, nbytes=64, arrays=[u64(v), u64(0), u64(64)])),
                (f"{name} nbytes={v}", cls(cache_id=1, epoch=ep, nbytes=v, arrays=good)),
                (f"{name} off wraps to {v}", cls(cache_id=1, epoch=ep, nbytes=64,
                                                 arrays=[u64(a0), u64((v - a0) % (1 << 64)), u64(64)])),
            ]
        for v in (0, -2, 2, 1 << 31, (1 << 63) - 1, -(1 << 63)):
            cases += [(f"{name} cache_id={v}", cls(cache_id=v, epoch=ep, nbytes=128, arrays=good)),
                      (f"{name} via={v}", cls(cache_id=1, epoch=ep, nbytes=128, via=v, arrays=good))]
    return cases


def _one_way_cases(my_id: int) -> List[Tuple[str, wire.Message]]:
    cases: List[Tuple[str, wire.Message]] = []
    for lo, hi in [(0, 0), (0, 2), (-1, 1), (1, 0), (0, 3), (2, 2), (-(1 << 63), (1 << 63) - 1)]:
        for status in (0, -1, 1 << 40):
            cases.append((f"NOTIFY [{lo}, {hi}) status {status}",
                          wire.Notify(cluster_id=my_id, cache_id=1, t_lo=lo, t_hi=hi, status=status, nbytes=U64MAX)))
    cases += [("NOTIFY naming another cluster", wire.Notify(cluster_id=DECODER_ID, cache_id=1, t_lo=0, t_hi=1)),
              ("NOTIFY of no cache", wire.Notify(cluster_id=my_id, cache_id=77, t_lo=0, t_hi=1)),
              ("NOTE of 63 KB", wire.Note(text="\u20ac" * 21000))]
    return cases


def _resolve_cases() -> List[Tuple[str, wire.Message]]:
    cases: List[Tuple[str, wire.Message]] = []
    for cluster in (0, PROMPT_ID, U64MAX):
        for kind in ("id", "key", "blocks", "", "x" * 60000):
            for v in (0, -1, 1 << 31, (1 << 63) - 1):
                cases.append((f"RESOLVE {kind[:6]!r} cluster {cluster} value {v}",
                              wire.Resolve(kind=kind, cluster_id=cluster, cache_id=v, batch_index=v,
                                           model_id=max(v, 0))))
    cases.append(("RELEASE_KEY", wire.ReleaseKey(cluster_id=PROMPT_ID, req_id=U64MAX)))
    return cases


def _raw_cases() -> List[Tuple[str, bytes]]:
    t = wire.MsgType
    cases = [(f"type {k}", frame(k, b"\0" * 40)) for k in (0, 1, 2, 3, 5, 9, 14, 15, 200, 255)]
    resolve = wire.encode(wire.Resolve())
    cases += [
        ("reserved set", frame(t.RESOLVE, resolve[16:], reserved=1)),
        ("old version", frame(t.RESOLVE, resolve[16:], version=wire.VERSION - 1)),
        ("foreign magic", frame(t.RESOLVE, resolve[16:], magic=b"XXXX")),
        ("PULL body short of its fixed fields", frame(t.PULL, b"\0" * 8)),
        ("PULL array section not of words", frame(t.PULL, b"\0" * 33, b"\0" * 12, alen=12)),
        ("PULL array count overruns", frame(t.PULL, b"\0" * 33, struct.pack("<QQ", 5, 1))),
        ("PULL array count 2^64-1", frame(t.PULL, b"\0" * 33, struct.pack("<QQ", U64MAX, 1))),
        ("PULL five arrays", frame(t.PULL, b"\0" * 33, struct.pack("<Q", 0) * 5)),
        ("RESOLVE with a trailing byte", frame(t.RESOLVE, resolve[16:] + b"\0")),
        ("NOTE not UTF-8", frame(t.NOTE, struct.pack("<I", 2) + b"\xff\xfe")),
        ("NOTE length overruns", frame(t.NOTE, struct.pack("<I", 1 << 31) + b"ab")),
    ]
    return cases


# --------------------------------------------------------------------------- request stream: sound


def test_edge_values_are_refused_or_served_inside_the_cache(target: Target) -> None:
    """Plan halves at 0, -1, 2^31, 2^32, 2^62, 2^63, 2^64-1, wrap-arounds, mismatched and
    missing arrays, foreign cache ids, stale epochs; lookups, notices, notes and malformed
    frames: every one is refused, answered inside the cache with its bytes, or costs the
    sender its link, within the deadline."""
    rss = rss_bytes(target.prompt.pid)
    prober = Prober(target)
    for label, msg in _plan_cases(prober.r):
        prober.probe(label, wire.encode(msg))
    for label, msg in _one_way_cases(prober.peer.my_id):
        prober.probe(label, wire.encode(msg), one_way=True)
    for label, msg in _resolve_cases():
        prober.probe(label, wire.encode(msg))
    for label, data in _raw_cases():
        prober.probe(label, data)
    assert not prober.problems, "\n".join(prober.problems)
    assert prober.counts["answered"] > 100 and prober.counts["closed"] > 10, prober.counts
    target.serves()
    target.intact()
    assert rss_bytes(target.prompt.pid) - rss < RSS_GROWTH_LIMIT


def test_refused_pushes_write_nothing(target: Target) -> None:
    """PUSH frames naming memory outside the cache, with their payload behind them, are
    refused (the payload drained or the link closed) and the cache does not change."""
    peer = target.raw()
    r = target.lookup(peer)
    a0, a1 = (int(x) for x in r.arrays[0])
    ts = r.tensor_size
    halves = [[u64(a0), u64(ts - 63), u64(64)], [u64(a0 - 64), u64(0), u64(64)], [u64(a1 + ts), u64(0), u64(64)],
              [u64(a0), u64((1 << 64) - a0 + 8), u64(64)], [u64(a0), u64(0), u64(ts + 64)]]
    for cache_id, epoch in ((1, r.epoch), (-1, 0)):
        for half in halves:
            nbytes = int(half[0].shape[0] * half[2].sum())
            peer.send(wire.encode(wire.Push(cache_id=cache_id, epoch=epoch, nbytes=nbytes, arrays=half))
                      + b"\xaa" * nbytes)
            try:
                ans = peer.answer(ANSWER_S + 1)
            except (ConnectionError, OSError, wire.WireError):
                peer.close()
                peer = target.raw()
                continue
            assert isinstance(ans, wire.Reply) and ans.status, f"push of {half} into cache {cache_id}: {ans}"
    target.intact()
    target.serves()


def test_random_mutations_of_linked_frames(target: Target) -> None:
    """Seeded random mutations of the body and arrays of valid PULL, SUM, RESOLVE, NOTIFY,
    NOTE and RELEASE_KEY frames (their headers kept, so every frame arrives whole): no
    answer from outside the cache, no hang, the cache unchanged, the honest decoder served."""
    rng = random.Random(20240611)
    prober = Prober(target)
    r = prober.r
    half = [r.arrays[0], u64(0, 256), u64(64, 64)]
    seeds = [
        (wire.encode(wire.Pull(cache_id=1, epoch=r.epoch, nbytes=256, arrays=half)), False),
        (wire.encode(wire.Sum(cache_id=1, epoch=r.epoch, nbytes=256, arrays=half)), False),
        (wire.encode(wire.Pull(cache_id=-1, epoch=0, nbytes=256, arrays=half)), False),
        (wire.encode(wire.Resolve(kind="blocks", cluster_id=PROMPT_ID, model_id=1)), False),
        (wire.encode(wire.Resolve(kind="id", cluster_id=PROMPT_ID, cache_id=1, batch_index=2)), False),
        (wire.encode(wire.ReleaseKey(cluster_id=PROMPT_ID, req_id=3)), False),
        (b"notify", True),
        (wire.encode(wire.Note(text="a note")), True),
    ]
    end = time.monotonic() + 8.0
    n = 0
    while time.monotonic() < end:
        seed, one_way = rng.choice(seeds)
        if seed == b"notify":  # from the raw peer linked now (a NOTIFY naming another cluster is refused)
            seed = wire.encode(wire.Notify(cluster_id=prober.peer.my_id, cache_id=1, t_lo=0, t_hi=1, message="n"))
        data = bytearray(seed)
        for _ in range(rng.randrange(1, 5)):
            i = rng.randrange(wire.HEADER_SIZE, len(data))
            data[i] = rng.choice([0, 0xFF, 0x7F, 0x80, 1, rng.randrange(256), data[i] ^ (1 << rng.randrange(8))])
        prober.probe(f"mutant {n} {bytes(data).hex()}", bytes(data), one_way=one_way)
        n += 1
    assert n > 50
    assert not prober.problems, "\n".join(prober.problems[:20])
    target.serves()
    target.intact()


# --------------------------------------------------------------------------- request stream: bugs


def test_plan_half_without_runs_does_not_crash_the_engine(peer_factory: Any) -> None:
    """A PULL whose plan half has one base and no runs (offs = lens = []) passes the checks
    (half_extent (0, 0); runs_inside returns True for no runs) and the C send loop then
    indexes the empty run arrays (fill_iov / cursor_skip_empty with nu == 0): SIGSEGV."""
    port = free_port()
    prompt = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID,
                          base_config("tcp", listen_port=port, sync_kv_timeout=TIMEOUT_MS, link_secret=SECRET))
    prompt.register("kv", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    data = prompt.fill("kv", BLOCKS, 17)
    peer = RawPeer(port, PROMPT_ID, 100)
    try:
        got = peer.rpc(wire.Resolve(kind="blocks", cluster_id=PROMPT_ID, model_id=1))
        assert isinstance(got, wire.Resolved)
        none = u64()
        peer.send(wire.encode(wire.Pull(cache_id=got.cache_id, epoch=got.epoch, nbytes=0,
                                        arrays=[got.arrays[0][:1], none, none])))
        peer.ended(ANSWER_S + 1)  # answered (an empty payload) or refused: either is fine
    finally:
        peer.close()
    prompt.process.join(0.5)
    assert prompt.alive, f"the engine died: exit code {prompt.process.exitcode}"
    np.testing.assert_array_equal(prompt.read("kv"), data)


def test_zero_length_runs_do_not_hold_the_agent(target: Target) -> None:
    """2^16 bases (one tensor address, repeated) x 2^16 zero-length runs: a 1.5 MB PULL that
    passes every check (nbytes 0) and makes the C send loop skip 2^32 empty runs without
    looking at the deadline, on the one agent thread that serves every link."""
    peer = target.raw()
    r = target.lookup(peer)
    n = 1 << 16
    zeros = np.zeros(n, np.uint64)
    t0 = time.monotonic()
    peer.send(wire.encode(wire.Pull(cache_id=r.cache_id, epoch=r.epoch, nbytes=0,
                                    arrays=[np.full(n, int(r.arrays[0][0]), np.uint64), zeros, zeros])))
    honest = target.honest_pull()
    try:
        ans: Any = peer.answer(60)  # whenever it comes: the agent is free again then
    except (ConnectionError, OSError, wire.WireError) as exc:
        ans = exc
    held = time.monotonic() - t0
    assert honest is None, f"an honest pull behind the hostile request failed: {honest}"
    assert held < ANSWER_S, f"the hostile request held the agent for {held:.1f} s ({ans})"
    target.intact()


@pytest.mark.parametrize("message", [wire.Sum, wire.Pull])
@pytest.mark.parametrize("repeated", ["bases", "offsets"])
def test_repeated_runs_do_not_amplify_a_request(target: Target, message: type, repeated: str) -> None:
    """A 512 KiB SUM or PULL naming one 2 MiB tensor 2^16 times (128 GiB), by its base or by
    a run of it repeated, is refused at once: served, the agent would allocate the stream
    sums of 128 GiB (512 MiB) and sum 128 GiB with no deadline, or stream them."""
    peer = target.raw()
    r = target.lookup(peer, model_id=2)
    n = 1 << 16
    base = int(r.arrays[0][0])
    arrays = ([np.full(n, base, np.uint64), u64(0), u64(r.tensor_size)] if repeated == "bases" else
              [u64(base), np.zeros(n, np.uint64), np.full(n, r.tensor_size, np.uint64)])
    frame_bytes = wire.encode(message(cache_id=r.cache_id, epoch=r.epoch, nbytes=n * r.tensor_size, arrays=arrays))
    with RssPeak(target.prompt.pid) as rss:
        t0 = time.monotonic()
        peer.send(frame_bytes)
        honest = target.honest_pull()
        try:
            ans: Any = peer.answer(60)
        except (ConnectionError, OSError, wire.WireError) as exc:
            ans = exc
        waited = time.monotonic() - t0
    assert rss.growth < RSS_GROWTH_LIMIT, f"a {len(frame_bytes)}-byte request grew the engine by {rss.growth >> 20} MiB"
    assert waited < ANSWER_S + 1, f"the request held the agent for {waited:.1f} s ({ans})"
    assert honest is None, f"an honest pull behind the request failed: {honest}"
    assert getattr(ans, "status", None) == int(Fault.PARAM_INVALID), ans
    target.intact()


def test_announced_frame_sizes_are_bounded_before_allocating(target: Target) -> None:
    """A 16-byte PUSH header announcing a 1 GiB array section (the per-type limit) and
    nothing after it: the agent allocates and zeroes the whole section first."""
    peer = target.raw()
    with RssPeak(target.prompt.pid) as rss:
        peer.send(frame(wire.MsgType.PUSH, blen=40, alen=1 << 30))
        closed = peer.ended(10)
    assert closed
    assert rss.growth < RSS_GROWTH_LIMIT, f"a 16-byte header grew the engine by {rss.growth >> 20} MiB"
    target.serves()


def test_notes_are_bounded_in_bytes(target: Target) -> None:
    """4000 NOTE frames of 64 KiB (more than MAX_NOTE_BYTES, which only the sender checks):
    kept until collected, bounded by count (65536) alone: up to 4 GiB per engine."""
    peer = target.raw()
    note = wire.encode(wire.Note(text="n" * ((64 << 10) - 5)))
    rss = rss_bytes(target.prompt.pid)
    for _ in range(4000):
        peer.send(note)
    target.lookup(peer)  # answered: every note before it was filed
    growth = rss_bytes(target.prompt.pid) - rss
    assert growth < RSS_GROWTH_LIMIT, f"4000 notes of {len(note)} bytes grew the engine by {growth >> 20} MiB"
    target.serves()


@pytest.mark.parametrize("started", ["one_byte", "large_header"])
def test_partial_frames_do_not_starve_an_honest_decoder(target: Target, started: str) -> None:
    """Three linked peers each send the start of a request and stop: one byte, or the
    header of a frame too large for a socket buffer to hold whole (70 KiB) and a little of
    it.  The one agent thread once waited sync_kv_timeout for each in turn (every read of
    a started frame blocked it), so an honest pull behind them timed out and its link
    broke; now a small request is read only once whole and a large one as it comes, and
    the stalled links are closed at their deadline."""
    stallers = [target.raw() for _ in range(3)]
    for peer in stallers:
        peer.send(wire.encode(wire.Resolve())[:1] if started == "one_byte" else
                  frame(wire.MsgType.PULL, blen=33, alen=70 << 10) + b"\0" * 40)
    honest = target.honest_pull()
    for peer in stallers:
        assert peer.ended(10)
    assert honest is None, f"an honest pull behind three stalled frames failed: {honest}"


def _push_of_a_big_tensor(target: Target, peer: RawPeer, cls: type = wire.Push, stale: bool = False
                          ) -> Tuple[bytes, bytes]:
    """A PUSH (or ``cls``: a PULL) of the whole first tensor of the target's "big" cache,
    and its payload: the bytes the tensor holds already (whatever of a push lands, the
    cache stays intact).  ``stale``: planned at an epoch not the engine's (refused, its
    payload read and discarded)."""
    r = target.lookup(peer, model_id=2)
    a0 = int(r.arrays[0][0])
    ts = r.tensor_size
    push = cls(cache_id=r.cache_id, epoch=r.epoch + int(stale), nbytes=ts, arrays=[u64(a0), u64(0), u64(ts)])
    return wire.encode(push), target.big[0].tobytes()


@pytest.mark.parametrize("stale", [False, True], ids=["admitted", "stale"])
def test_pushes_whose_payload_stops_hold_no_other_link(target: Target, stale: bool) -> None:
    """Three linked peers each send a 2 MiB push's frame and its first 64 KiB, and stop.
    The agent read a push's payload on the thread that serves every link, so each held
    it for sync_kv_timeout in turn and an honest pull behind them timed out; now a push
    whose payload has not all arrived is received (or, refused as stale, drained) on a
    thread of its own, and the stalled ones end at their deadline."""
    stallers = [target.raw() for _ in range(3)]
    for peer in stallers:
        frame, payload = _push_of_a_big_tensor(target, peer, stale=stale)
        peer.send(frame + payload[:64 << 10])
    honest = target.honest_pull()

    def receiving() -> int:  # what an operator sees
        return int(target.prompt.call("engine", "metrics")["agent"]["handed_off"])

    until(lambda: receiving() == 3, TIMEOUT_MS / 2000, "three pushes received off the agent", every=PACED)
    for peer in stallers:
        assert peer.ended(10)
    assert honest is None, f"an honest pull behind three stalled pushes failed: {honest}"
    until(lambda: receiving() == 0, 5, "the stalled pushes ended", every=PACED)
    target.intact()


def test_a_push_that_pauses_arrives_whole_and_its_link_goes_on(target: Target) -> None:
    """A push whose payload pauses half-way, while an honest decoder pulls, is received
    whole once the rest comes within sync_kv_timeout, answered, and its link serves the
    next request."""
    peer = target.raw()
    frame, payload = _push_of_a_big_tensor(target, peer)
    peer.send(frame + payload[:len(payload) // 2])
    assert target.honest_pull() is None
    peer.send(payload[len(payload) // 2:])
    ans = peer.answer(ANSWER_S)
    assert isinstance(ans, wire.Reply) and not ans.status, ans
    target.lookup(peer)  # the link is served again
    target.intact()
    target.serves()


def test_the_thread_that_served_a_handed_off_push_serves_the_next(target: Target) -> None:
    """Pushes that pause, one after another, are each received off the agent by a thread
    kept from the push before (its name seen while the first paused), not by a new thread
    each: starting a thread costs up to most of a millisecond on a busy machine, waking an
    idle one tens of microseconds."""
    def receiving() -> int:
        return int(target.prompt.call("engine", "metrics")["agent"]["handed_off"])

    seen = []
    for _ in range(3):
        peer = target.raw()
        frame, payload = _push_of_a_big_tensor(target, peer)
        peer.send(frame + payload[:len(payload) // 2])
        until(lambda: receiving() == 1, 10, "the push received off the agent", every=PACED)
        seen.append({name for _ident, name in target.prompt.snapshot()["threads"]
                     if name.startswith("datadist-serve")})
        peer.send(payload[len(payload) // 2:])
        ans = peer.answer(ANSWER_S)
        assert isinstance(ans, wire.Reply) and not ans.status, ans
    assert seen[0] and seen[1] <= seen[0] and seen[2] <= seen[0], seen
    target.intact()


def test_pulls_whose_answer_is_not_read_hold_no_other_link(target: Target) -> None:
    """Three linked peers each ask for two 2 MiB pulls and read nothing.  The agent sent a
    pull's answer on the thread that serves every link, so each held it for
    sync_kv_timeout once the socket's buffers were full; now an answer larger than the
    free send buffer is sent on a thread of its own, and the stalled links end at their
    deadline."""
    def failures() -> int:  # links the target saw break
        return int(target.prompt.call("engine", "metrics")["links"]["failures"])

    before = failures()
    stallers = [target.raw() for _ in range(3)]
    for peer in stallers:
        frame, _payload = _push_of_a_big_tensor(target, peer, wire.Pull)
        peer.send(frame + frame)
    honest = target.honest_pull()
    until(lambda: failures() == before + 3, 10, "the three unread links broken", every=PACED)
    for peer in stallers:
        assert peer.ended(5)  # reads what was sent before, then the end of the stream
    assert honest is None, f"an honest pull behind three unread pulls failed: {honest}"


def test_a_pull_read_late_arrives_whole_and_its_link_goes_on(target: Target) -> None:
    """A 2 MiB pull whose answer its peer starts reading only after an honest decoder has
    pulled: its bytes are the tensor's, and the link serves the next request."""
    peer = target.raw()
    frame, payload = _push_of_a_big_tensor(target, peer, wire.Pull)
    peer.send(frame)
    assert target.honest_pull() is None
    ans = peer.answer(ANSWER_S)
    assert isinstance(ans, wire.Reply) and not ans.status, ans
    assert peer.recv_exact(len(payload), ANSWER_S) == payload
    target.lookup(peer)  # the link is served again
    target.serves()


def test_an_engine_ends_cleanly_while_a_push_is_received_off_its_agent(target: Target) -> None:
    """Finalizing an engine while a stalled push is being received on a thread of its own:
    the push's stream is shut down and its thread waited for before the engine gives its
    memory back (it would otherwise write into unmapped caches); the process exits 0."""
    peer = target.raw()
    frame, payload = _push_of_a_big_tensor(target, peer)
    peer.send(frame + payload[:64 << 10])
    assert target.honest_pull() is None  # the agent serves on while the push waits
    target.prompt.shutdown()  # exit code 0 asserted
    assert peer.ended(5)


def test_hello_claiming_a_linked_cluster_does_not_take_its_link(target: Target) -> None:
    """A peer with the secret HELLOs as the honest decoder's cluster with its pid (visible
    on the host, or guessed).  Only the process that holds a link may replace it, proving
    it with that link's attach token: the impostor is answered ALREADY_LINKED (it once
    replaced the honest link) and the honest decoder keeps its link."""
    with pytest.raises(AssertionError, match="already linked"):
        target.raw(my_id=DECODER_ID, pid=target.decoder.pid)
    honest = target.honest_pull()
    assert honest is None, f"the honest decoder lost its link to an impostor: {honest}"


def test_honest_decoder_is_served_right_after_relinking(target: Target) -> None:
    """What an honest decoder does after an attack broke its link: unlink_clusters and
    link_clusters again, then pull as before.  PreparedTransfer.run finds the plan it kept
    for these block lists (bound to the old, closed link) before _live() rebinds to the new
    link, and runs it: the first pull after relinking fails (EBADF / EPIPE on the old
    socket; over shm the copy runs through the old link's unmapped arena first)."""
    target.serves()
    target.decoder.call("unlink", [(PROMPT_ID, "127.0.0.1", target.port)])
    target.decoder.link(target.prompt, port=target.port)
    assert target.honest_pull() is None


# --------------------------------------------------------------------------- a hostile PROMPT


class HostilePrompt:
    """A raw PROMPT server for one decoder's link (no link secret): its HELLO_ACK carries
    ``ack(hello)``'s fields, and each request is answered with ``answer(msg)`` (bytes)."""

    def __init__(self, answer: Callable[[wire.Message], Optional[bytes]],
                 ack: Callable[[wire.Hello], Dict[str, Any]] = lambda hello: {}) -> None:
        self.answer, self.ack = answer, ack
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(30)
        self.port = self.listener.getsockname()[1]
        self.hello: Optional[wire.Hello] = None
        self.conns: List[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            s, _ = self.listener.accept()
            self.conns.append(s)
            hello = wire.read_message(s)
            assert isinstance(hello, wire.Hello)
            self.hello = hello
            fields: Dict[str, Any] = dict(cluster_id=PROMPT_ID, host="elsewhere", pid=1, backend="tcp", path="tcp",
                                          attach_token="00" * 16)
            fields.update(self.ack(hello))
            s.sendall(wire.encode(wire.HelloAck(**fields)))
            a, _ = self.listener.accept()
            self.conns.append(a)
            wire.read_message(a)
            a.sendall(wire.OK_FRAME)
            while True:
                out = self.answer(wire.read_message(s))
                if out:
                    s.sendall(out)
        except (OSError, wire.WireError, AssertionError):
            return

    def close(self) -> None:
        for s in self.conns + [self.listener]:
            s.close()


def _resolved(addrs: List[int], **fields: Any) -> bytes:
    values: Dict[str, Any] = dict(cache_id=1, row=0, num_tensors=len(addrs), tensor_size=BLOCKS.tensor_bytes,
                                  batch_size=BLOCKS.shape[0], is_blocks=True, dtype="DT_FLOAT16", epoch=0,
                                  arrays=[u64(*addrs)])
    values.update(fields)
    return wire.encode(wire.Resolved(**values))


def _decoder(peer_factory: Any, transport: str = "shm") -> Peer:
    dec = cast(Peer, peer_factory("peer", "decoder", "DECODER", DECODER_ID,
                                  base_config(transport, sync_kv_timeout=TIMEOUT_MS)))
    dec.wait_ready()
    dec.alloc("dst", BLOCKS, blocks=True)
    dec.fill("dst", BLOCKS, 1)
    return dec


def test_prompt_claiming_the_decoders_own_identity_gets_no_memory_access(peer_factory: Any) -> None:
    """A hostile PROMPT answers HELLO with the decoder's own host, pid and epoch page (all
    from the decoder's HELLO): the nonce in "the peer's" page matches (it is the decoder's),
    cross-memory attach to "the peer" works (it is the decoder itself), so the decoder picks
    shm with process_vm_readv/writev on its own pid; RESOLVED then names any address of
    the decoder, and pull_blocks / push_blocks read and write it."""
    dec = _decoder(peer_factory)
    src = dec.fill("dst", BLOCKS, 2)
    dec.alloc("secret", BLOCKS, blocks=True)
    secret = dec.fill("secret", BLOCKS, 3)
    dec.alloc("landing", BLOCKS, blocks=True)
    dec.fill("landing", BLOCKS, 4)
    target = [t["ptr"] for t in dec.call("tensor_info", "secret")]
    hostile = HostilePrompt(lambda msg: _resolved(target) if isinstance(msg, wire.Resolve) else wire.OK_FRAME,
                            ack=lambda h: dict(host=h.host, pid=h.pid, ctrl=h.ctrl, arenas=[], backend="shm",
                                               path="shm"))
    pulled = None
    try:
        ret, rets = dec.call("link", [(PROMPT_ID, "127.0.0.1", hostile.port)], 3000)
        if rets == [0]:  # linked: the transfers must then not reach the decoder's own memory
            try:
                dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("landing"), [0, 1, 2, 3], [0, 1, 2, 3])
                pulled = dec.read("landing")
            except PeerError:
                pass
            try:
                dec.cm("push_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0, 1, 2, 3], [0, 1, 2, 3])
            except PeerError:
                pass
    finally:
        hostile.close()
    assert pulled is None or not np.array_equal(pulled, secret), \
        "a pull from the hostile prompt copied the decoder's own 'secret' cache into 'landing'"
    assert not np.array_equal(dec.read("secret"), src), \
        "a push to the hostile prompt overwrote the decoder's own 'secret' cache with 'dst'"
    np.testing.assert_array_equal(dec.read("secret"), secret)


def test_huge_announced_answer_is_not_allocated(peer_factory: Any) -> None:
    """A hostile PROMPT answers RESOLVE with 28 bytes: a RESOLVED header announcing a 1 GiB
    array section (read_answer takes any message type within its limits): the decoder
    allocates and zeroes the whole section before reading it."""
    dec = _decoder(peer_factory, "tcp")
    answer = frame(wire.MsgType.RESOLVED, blen=200, alen=1 << 30) + b"\0" * 12
    hostile = HostilePrompt(lambda msg: answer if isinstance(msg, wire.Resolve) else None)
    try:
        dec.call("link", [(PROMPT_ID, "127.0.0.1", hostile.port)], 3000)
        with RssPeak(dec.pid) as rss:
            with pytest.raises(PeerError) as info:
                dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0], [0])
    finally:
        hostile.close()
    assert info.value.is_a("LLMException")
    assert rss.growth < RSS_GROWTH_LIMIT, f"a 28-byte answer grew the decoder by {rss.growth >> 20} MiB"


def test_malformed_prompt_answers_fail_as_llm_errors(peer_factory: Any) -> None:
    """A HELLO_ACK whose epoch page or arenas lack fields, and a RESOLVED whose CUDA IPC
    regions lack fields: link_clusters must report LLM_LINK_FAILED and a transfer raise an
    LLMException, not leak KeyError / ValueError out of the API."""
    dec = _decoder(peer_factory)
    bad_acks = [lambda h: dict(host=h.host, pid=h.pid, ctrl={}, backend="shm"),
                lambda h: dict(host=h.host, pid=h.pid, ctrl=h.ctrl, arenas=[{}], backend="shm"),
                lambda h: dict(host=h.host, pid=h.pid, ctrl=h.ctrl, device_regions=[{"handle": "zz"}], backend="shm")]
    raised = []
    for ack in bad_acks:
        hostile = HostilePrompt(lambda msg: None, ack=ack)
        try:
            ret, rets = dec.call("link", [(PROMPT_ID, "127.0.0.1", hostile.port)], 3000)
            assert rets != [0]
        except PeerError as exc:
            raised.append(f"link_clusters raised {exc.exc_type}: {exc.message[:80]}")
        finally:
            hostile.close()
    hostile = HostilePrompt(lambda msg: _resolved([1 << 20, 2 << 20], ipc=[{}]) if isinstance(msg, wire.Resolve)
                            else None)
    try:
        dec.call("link", [(PROMPT_ID, "127.0.0.1", hostile.port)], 3000)
        with pytest.raises(PeerError) as info:
            dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0], [0])
        if not info.value.is_a("LLMException"):
            raised.append(f"pull_blocks raised {info.value.exc_type}: {info.value.message[:80]}")
    finally:
        hostile.close()
    assert not raised, "\n".join(raised)


def test_a_same_host_peer_cannot_shrink_its_arena_under_the_copier(peer_factory: Any) -> None:
    """A PROMPT linked over shm shrinks its pool arena (``ftruncate`` of its own memfd; the
    test does it through ``/proc/<pid>/fd``, as the process itself could): the kernel
    refuses (the arenas' size is sealed), and the decoder's next pull, copying from its
    mapping of that arena, gets the bytes instead of a SIGBUS."""
    p, d = cast(Tuple[Peer, Peer], peer_factory("pair", "shm").peers())
    p.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    src = p.fill("src", BLOCKS, 3)
    d.alloc("dst", BLOCKS, blocks=True)
    dst = d.fill("dst", BLOCKS, 4)
    d.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0], [0])  # mapped now
    assert d.call("links")[PROMPT_ID]["path"] == "shm"
    arenas = [fd for fd in os.listdir(f"/proc/{p.pid}/fd")
              if os.readlink(f"/proc/{p.pid}/fd/{fd}").startswith("/memfd:datadist-")]
    assert arenas
    for fd in arenas:
        other = os.open(f"/proc/{p.pid}/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(other, 0)
        finally:
            os.close(other)
    d.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [1], [1])
    dst = expect_blocks(dst, src, [0, 1], [0, 1], BLOCKS.row_bytes)
    np.testing.assert_array_equal(d.read("dst"), dst)
    assert d.alive and p.alive
