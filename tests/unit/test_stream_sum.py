"""The checksum of a stream summed while it moves (:class:`datadist.engine.checksum.StreamSum`)
equals the checksum of the bytes, however the stream is cut and whichever side sums it."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from datadist.engine import native
from datadist.engine.checksum import StreamSum
from datadist.engine.layout import Plan
from ems.pool.checksum import checksum

pytestmark = pytest.mark.timeout(60)


def _run(src: int, dst: int, lo: int, hi: int) -> Plan:
    one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
    return Plan(one(src), one(dst), one(lo), one(lo), one(hi - lo))


@pytest.mark.parametrize("n", [0, 5, 4096, 4097, 100_003, 3 << 20])
def test_sums_of_a_socket_stream_match_the_bytes(n):
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n, dtype=np.uint8)
    out = np.zeros(n, dtype=np.uint8)
    cuts = sorted({0, n, *map(int, rng.integers(0, n + 1, 3))})
    sent, got = StreamSum(n), StreamSum(n)
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    plans = [_run(data.ctypes.data, out.ctypes.data, lo, hi) for lo, hi in zip(cuts, cuts[1:])]
    errors = []

    def receive() -> None:
        try:
            for p in plans:
                native.sock_recv(b.fileno(), p, 10_000, got)
        except Exception as exc:  # shown by the assertion below
            errors.append(exc)

    t = threading.Thread(target=receive)
    t.start()
    for p in plans:
        native.sock_send(a.fileno(), p, 10_000, None, sent)
    t.join(30)
    a.close()
    b.close()
    assert not errors and np.array_equal(out, data)
    assert sent.checksum() == got.checksum() == checksum(data)
    staged = StreamSum(n)
    for lo, hi in zip(cuts, cuts[1:]):
        staged.add(data[lo:hi])
    assert staged.checksum() == checksum(data)


def test_a_changed_or_moved_word_changes_the_sum():
    data = np.arange(8192, dtype=np.uint8)
    swapped = data.copy()
    swapped[0:8], swapped[8:16] = data[8:16], data[0:8]
    flipped = data.copy()
    flipped[5000] ^= 1
    assert len({checksum(data), checksum(swapped), checksum(flipped)}) == 3


def test_bytes_past_the_stream_are_refused_and_incomplete_streams_have_no_sum():
    s = StreamSum(10)
    with pytest.raises(OSError):
        s.add(np.zeros(11, dtype=np.uint8))
    s.add(np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match="4 of the stream's 10 bytes"):
        s.checksum()
    with pytest.raises(ValueError, match="size"):
        StreamSum(-1)


@pytest.mark.parametrize("seed", range(6))
def test_a_copy_summed_in_plan_order_matches_the_owners_sum_of_its_half(seed):
    """``copy_plan_stream`` (the copier of a one-sided copy) and ``sum_plan`` (the owner,
    reading its half) give the checksum of the plan's runs in plan order, as a socket would
    carry them, and the copy lands; runs of any length, tensors, threads."""
    rng = np.random.default_rng(seed)
    nt, nu = int(rng.integers(1, 4)), int(rng.integers(1, 7))
    lens = rng.integers(0, 9000, nu).astype(np.uint64)
    if seed == 0:
        lens[0] = 3 << 20  # large enough for the copy's threads and streaming stores
    offs = np.concatenate([[0], np.cumsum(lens[:-1] + rng.integers(0, 7, nu - 1).astype(np.uint64))]).astype(np.uint64)
    span = int(offs[-1] + lens[-1]) + 16
    src = rng.integers(0, 256, (nt, span), dtype=np.uint8)
    dst = np.zeros_like(src)
    sb = np.array([src[t].ctypes.data for t in range(nt)], np.uint64)
    db = np.array([dst[t].ctypes.data for t in range(nt)], np.uint64)
    plan = Plan(sb, db, offs, offs, lens)
    runs = [(t, int(o), int(o + n)) for t in range(nt) for o, n in zip(offs, lens)]
    stream = np.concatenate([src[t, lo:hi] for t, lo, hi in runs])
    copier, owner = StreamSum(plan.nbytes), StreamSum(plan.nbytes)
    assert native.copy_plan_stream(plan, copier, threads=1 + seed % 2) == plan.nbytes
    assert native.sum_plan(sb, offs, lens, owner) == plan.nbytes
    assert copier.checksum() == owner.checksum() == checksum(stream)
    np.testing.assert_array_equal(np.concatenate([dst[t, lo:hi] for t, lo, hi in runs]), stream)
    with pytest.raises(OSError):
        native.copy_plan_stream(plan, StreamSum(plan.nbytes - 1))


@pytest.mark.parametrize("runs", [[(0, 16 << 20), (20 << 20, (8 << 20) + 4095), (40 << 20, 3)], [(5, 40 << 20)]])
def test_a_plan_summed_by_threads_sums_as_one_thread_does(runs):
    """``sum_plan`` over several threads (chunks of the stream) gives the sums and tail of
    one thread, with runs that cut blocks and a tail; a changed byte changes it."""
    rng = np.random.default_rng(len(runs))
    tensors = [rng.integers(0, 256, 48 << 20, dtype=np.uint8) for _ in range(2)]
    bases = np.array([t.ctypes.data for t in tensors], dtype=np.uint64)
    offs = np.array([o for o, _ in runs], dtype=np.uint64)
    lens = np.array([n for _, n in runs], dtype=np.uint64)
    n = int(lens.sum()) * 2

    def summed(threads: int) -> int:
        s = StreamSum(n)
        assert native.sum_plan(bases, offs, lens, s, threads) == n
        return s.checksum()

    one = summed(1)
    assert summed(3) == summed(4) == one
    tensors[1][int(offs[-1]) + int(lens[-1]) - 1] ^= 1
    assert summed(4) != one


@pytest.mark.parametrize("n", [5, 4096, 4097, 100_003, native.FAST_SUMMED_MAX])
def test_a_summed_payload_in_one_c_call_carries_the_checksum_of_its_bytes(n):
    """send_summed / recv_summed (payload and checksum in one call each, the CRC in C) agree
    with the checksum of the bytes as the pool and StreamSum compute it (zlib's CRC)."""
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n + 64, dtype=np.uint8)
    out = np.zeros(n + 64, dtype=np.uint8)
    # two runs, the second before the first in memory: plan order is stream order
    half = n // 2
    one = lambda *v: np.array(v, dtype=np.uint64)  # noqa: E731
    plan = Plan(one(data.ctypes.data), one(out.ctypes.data), one(64 + half, 0), one(0, n - half + 64),
                one(n - half, half))
    stream = np.concatenate([data[64 + half:64 + n], data[:half]])
    a, b = socket.socketpair()
    a.settimeout(10)  # non-blocking descriptors, as the C calls need; Python's own calls wait
    b.settimeout(10)
    with a, b:
        got: list = []
        t = threading.Thread(target=lambda: got.append(native.recv_summed(b.fileno(), plan, 10_000)))
        t.start()
        sent = native.send_summed(a.fileno(), plan, 10_000, b"")
        t.join(30)
        assert got == [(sent, sent)] and sent == checksum(stream)
        assert np.array_equal(np.concatenate([out[:n - half], out[n - half + 64:n + 64]]), stream)

        def corrupted() -> None:  # the payload as sent, a checksum one bit off
            native.sock_send(a.fileno(), plan, 10_000)
            a.sendall((sent ^ 1).to_bytes(8, "little"))

        t = threading.Thread(target=corrupted)
        t.start()
        mine, theirs = native.recv_summed(b.fileno(), plan, 10_000)
        t.join(30)
        assert (mine, theirs) == (sent, sent ^ 1)


def test_a_small_summed_payload_and_its_checksum_travel_in_one_system_call():
    """Within the sum window (256 KiB) the checksum leaves in the payload's own writev, and
    the payload's readv takes the checksum behind it: over a socket that keeps each call's
    bytes as one record (SOCK_SEQPACKET, whose read takes a record whole or drops the rest
    of it), head, payload and checksum are one record, and such a record is read whole."""
    n = 64 << 10
    data = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    out = np.zeros(n, dtype=np.uint8)
    one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
    plan = Plan(one(data.ctypes.data), one(out.ctypes.data), one(0), one(0), one(n))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    a.settimeout(10)
    b.settimeout(10)
    with a, b:
        sent = native.send_summed(a.fileno(), plan, 10_000, b"head")
        trailer = sent.to_bytes(8, "little")
        assert b.recv(2 * n) == b"head" + data.tobytes() + trailer
        assert sent == checksum(data.tobytes())
        a.send(data.tobytes() + trailer)
        assert native.recv_summed(b.fileno(), plan, 10_000) == (sent, sent)
        assert np.array_equal(out, data)


def test_summed_payloads_of_no_bytes_or_past_the_limit_are_refused():
    one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
    a, b = socket.socketpair()
    with a, b:
        for length in (0, native.FAST_SUMMED_MAX + 1):
            plan = Plan(one(0), one(0), one(0), one(0), one(length))
            with pytest.raises(ValueError, match="FAST_SUMMED_MAX"):
                native.send_summed(a.fileno(), plan, 100)
            with pytest.raises(ValueError, match="FAST_SUMMED_MAX"):
                native.recv_summed(b.fileno(), plan, 100)
