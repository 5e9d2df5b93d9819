"""The agent's memory of admitted transfer frames (``RequestHandler.handle_frame``), over a
real socket pair: a frame byte for byte equal to one admitted before is served without
decoding it again, but only while the registry is unchanged, and never on another
cache's behalf."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import numpy as np
import pytest

from datadist.engine import native, requests, wire
from datadist.engine.checksum import StreamSum
from datadist.engine.errors import Fault
from datadist.engine.link import Link
from datadist.engine.notes import NoteBox
from datadist.engine.registry import Registry
from datadist.engine.requests import RequestHandler
from datadist.engine.transports.base import STALE

pytestmark = pytest.mark.timeout(30)

BLOCK = 256


@pytest.fixture
def served() -> Iterator[tuple[RequestHandler, Registry, np.ndarray, socket.socket, socket.socket]]:
    reg = Registry(5, 1)
    memory = np.zeros((2, 4 * BLOCK), dtype=np.uint8)  # 2 tensors of 4 blocks
    reg.add(dict(num_tensors=2, tensor_size=4 * BLOCK, batch_size=4, is_blocks=True, dtype="INT8",
                 addrs=np.array([memory[0].ctypes.data, memory[1].ctypes.data], np.uint64)))
    ours, peer = socket.socketpair()
    ours.settimeout(5)
    peer.settimeout(5)
    try:
        yield requests.RequestHandler(reg, NoteBox(), 5000), reg, memory, ours, peer
    finally:
        ours.close()
        peer.close()


def _push(handler: RequestHandler, reg: Registry, memory: np.ndarray, ours: socket.socket, peer: socket.socket,
          epoch: int, fill: int) -> wire.Message:
    """Send a PUSH of block 1 of both tensors (fill bytes) and serve it; the reply."""
    base = np.array([memory[0].ctypes.data, memory[1].ctypes.data], np.uint64)
    frame = wire.encode(wire.Push(cache_id=1, epoch=epoch, nbytes=2 * BLOCK,
                                  arrays=[base, np.array([BLOCK], np.uint64), np.array([BLOCK], np.uint64)]))
    peer.sendall(frame + bytes([fill]) * (2 * BLOCK))
    link = Link(remote_cluster_id=9, remote_role=0, peer_pid=0, timeout_ms=5000, is_client=False)
    frame = handler.serve_known(link, ours)
    if frame is None:  # served by the fast path: it answered OK on the stream
        assert peer.recv(len(wire.OK_FRAME)) == wire.OK_FRAME
        return requests.OK
    with contextlib.ExitStack() as scope:
        reply = handler.handle_frame(link, frame, ours, scope)
    assert reply is not None
    return reply


def test_a_repeated_frame_is_served_without_decoding_it_again(served, monkeypatch: pytest.MonkeyPatch) -> None:
    handler, reg, memory, ours, peer = served
    assert _push(handler, reg, memory, ours, peer, reg.epoch, 7) is requests.OK
    assert (memory[:, BLOCK:2 * BLOCK] == 7).all()
    decoded = []
    real = wire.decode_frame
    monkeypatch.setattr(wire, "decode_frame", lambda *a: decoded.append(a) or real(*a))
    assert _push(handler, reg, memory, ours, peer, reg.epoch, 9) is requests.OK
    assert (memory[:, BLOCK:2 * BLOCK] == 9).all() and not decoded
    assert not memory[:, :BLOCK].any() and not memory[:, 2 * BLOCK:].any()


def test_a_changed_registry_makes_the_same_frame_stale(served) -> None:
    handler, reg, memory, ours, peer = served
    epoch = reg.epoch
    assert _push(handler, reg, memory, ours, peer, epoch, 3) is requests.OK
    other = np.zeros(BLOCK, dtype=np.uint8)
    gone = reg.add(dict(num_tensors=1, tensor_size=BLOCK, batch_size=1, is_blocks=True, dtype="INT8",
                        addrs=np.array([other.ctypes.data], np.uint64)))
    reg.remove(gone.cache_id)  # any change of the caches moves the epoch
    reply = _push(handler, reg, memory, ours, peer, epoch, 4)
    assert isinstance(reply, wire.Reply) and reply.status == STALE
    assert (memory[:, BLOCK:2 * BLOCK] == 3).all()  # the refused payload was drained, not written
    assert native.spin_readable(ours.fileno(), 1000) is False  # and the stream is in step


def test_a_refused_frame_is_never_remembered(served) -> None:
    handler, reg, memory, ours, peer = served
    reply = _push(handler, reg, memory, ours, peer, reg.epoch + 1, 5)  # planned at an epoch not reached
    assert isinstance(reply, wire.Reply) and reply.status == STALE
    assert not handler._known
    assert not memory.any()


def test_spin_readable_sees_data_and_times_out() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert native.spin_readable(a.fileno(), 0) is False
        assert native.spin_readable(a.fileno(), 200) is False
        b.send(b"x")
        assert native.spin_readable(a.fileno(), 10_000) is True


def test_int_keys_are_equal_exactly_for_equal_lists_of_exact_ints() -> None:
    k = native.int_key([1, 2, 3], 8)
    assert k is not None
    assert k == native.int_key((1, 2, 3), 8) and hash(k) == hash(native.int_key((1, 2, 3), 8))
    assert {k: "plan"}.get(native.int_key([1, 2, 3], 8)) == "plan"
    for other in ([1, 2, 4], [1, 2], [3, 2, 1], [1, 2, 3, 0], [-1, 2, 3]):
        assert native.int_key(other, 8) != k
    assert native.int_key([1 << 40, -(1 << 40), -7], 8) == native.int_key([1 << 40, -(1 << 40), -7], 8)
    assert native.int_key([-7], 8) != native.int_key([7], 8)
    assert native.int_key([], 8) == native.int_key((), 8)
    assert k != (1, 2, 3) and k != [1, 2, 3]
    for not_ints in ([1.0], [True], [1, "2"], [np.int64(1)], [1 << 70], range(3), np.arange(3), "12", None):
        assert native.int_key(not_ints, 8) is None
    assert native.int_key(list(range(9)), 8) is None


def test_int_keys_of_long_lists_tell_one_changed_entry() -> None:
    base = list(range(4096))
    seen = {native.int_key(base, 1 << 16)}
    for i in (0, 1, 2047, 4095):
        changed = list(base)
        changed[i] += 4096
        assert native.int_key(changed, 1 << 16) not in seen
    swapped = list(base)
    swapped[10], swapped[11] = swapped[11], swapped[10]
    assert native.int_key(swapped, 1 << 16) not in seen  # order matters
    assert native.int_key(list(base), 1 << 16) in seen


def test_read_answer_reads_no_byte_past_its_frame() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.sendall(wire.OK_FRAME + b"payload")  # a pull's payload follows its answer
        assert wire.read_answer(a) is wire.OK
        assert a.recv(16) == b"payload"
        refusal = wire.Reply(status=5, message="cache 3 does not exist")
        b.sendall(wire.encode(refusal) + b"next")
        assert wire.read_answer(a) == refusal
        assert a.recv(16) == b"next"
        resolved = wire.Resolved(cache_id=4, arrays=[np.arange(3, dtype=np.uint64)])
        b.sendall(wire.encode(resolved))
        got = wire.read_answer(a)
        assert isinstance(got, wire.Resolved) and got.cache_id == 4 and list(got.arrays[0]) == [0, 1, 2]


def test_read_answer_refuses_a_frame_shorter_than_any_answer() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        short = wire.encode(wire.Note(text=""))
        assert len(short) < len(wire.OK_FRAME)
        b.sendall(short + b"\0" * len(wire.OK_FRAME))
        with pytest.raises(wire.WireError):
            wire.read_answer(a)


def test_remember_drops_the_oldest_entry_when_full() -> None:
    from datadist.engine.memo import remember

    memory: dict[int, str] = {}
    for k in range(5):
        remember(memory, k, str(k), 3)
    assert memory == {2: "2", 3: "3", 4: "4"}
    remember(memory, 4, "four", 3)  # a key already held: only its value changes
    assert memory == {2: "2", 3: "3", 4: "four"}


def _frame(cache_id: int, memory: np.ndarray, pull: bool = False) -> bytes:
    base = np.array([memory[0].ctypes.data, memory[1].ctypes.data], np.uint64)
    cls = wire.Pull if pull else wire.Push
    return wire.encode(cls(cache_id=cache_id, epoch=0, nbytes=2 * BLOCK,
                           arrays=[base, np.array([BLOCK], np.uint64), np.array([BLOCK], np.uint64)]))


def test_the_fast_path_serves_a_known_pull_with_its_answer_and_payload(served) -> None:
    handler, reg, memory, ours, peer = served
    memory[:, BLOCK:2 * BLOCK] = 5
    frame = _frame(1, memory, pull=True)
    link = Link(remote_cluster_id=9, remote_role=0, peer_pid=0, timeout_ms=5000, is_client=False)
    peer.sendall(frame)
    first = handler.serve_known(link, ours)  # not known yet: read, for the Python path
    assert first is not None and first.cls is wire.Pull and first.raw == frame
    with contextlib.ExitStack() as scope:
        assert handler.handle_frame(link, first, ours, scope) is requests.OK
    peer.sendall(frame)
    assert handler.serve_known(link, ours) is None  # known now: served in C
    got = bytearray()
    while len(got) < len(wire.OK_FRAME) + 2 * BLOCK:
        got += peer.recv(65536)
    assert bytes(got[:len(wire.OK_FRAME)]) == wire.OK_FRAME
    assert bytes(got[len(wire.OK_FRAME):]) == bytes([5]) * (2 * BLOCK)


def test_the_fast_path_reads_nothing_past_a_long_frames_header(served) -> None:
    handler, _, _, ours, peer = served
    link = Link(remote_cluster_id=9, remote_role=0, peer_pid=0, timeout_ms=5000, is_client=False)
    note = wire.encode(wire.Note(text="n" * 5000))  # longer than a frame worth remembering
    peer.sendall(note + b"next")
    frame = handler.serve_known(link, ours)
    assert frame is not None and frame.cls is wire.Note and frame.raw is None
    assert wire.decode_frame(frame.cls, frame.data, frame.blen).text == "n" * 5000
    assert ours.recv(4) == b"next"  # the stream is in step


def test_hostile_lengths_are_bounded_before_anything_is_read_or_allocated(served) -> None:
    handler, _, _, ours, peer = served
    link = Link(remote_cluster_id=9, remote_role=0, peer_pid=0, timeout_ms=5000, is_client=False)
    head = bytearray(wire.encode(wire.Note(text="x"))[:wire.HEADER_SIZE])
    head[-8:] = (0xFFFFFFFF).to_bytes(4, "little") * 2  # 8 GiB announced
    peer.sendall(bytes(head))
    with pytest.raises(wire.WireError):
        handler.serve_known(link, ours)  # the header, checked by the codec: out of bounds
    peer.sendall(bytes(head))
    status, got = native.serve_known(ours.fileno(), {}, 0, wire.HEADER_SIZE, 4096, 1000, wire.OK_FRAME)
    assert status == 1 and got == bytes(head)  # only the header was read, nothing allocated for the rest


def test_a_known_frame_of_another_epoch_is_read_not_served(served) -> None:
    handler, reg, memory, ours, peer = served
    frame = _frame(1, memory)
    admitted = ("not an epoch", True, None, np.zeros(2, np.uint64), np.zeros(1, np.uint64), np.zeros(1, np.uint64),
                False)
    peer.sendall(frame)
    status, got = native.serve_known(ours.fileno(), {frame: admitted}, reg.epoch, wire.HEADER_SIZE, 4096, 1000,
                                     wire.OK_FRAME)
    assert (status, got) == (2, frame)
    assert not memory.any()


def test_a_request_writes_frame_and_runs_and_returns_the_answers_first_bytes() -> None:
    from datadist.engine.layout import Plan

    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        payload = np.arange(64, dtype=np.uint8)
        zero = np.zeros(1, np.uint64)
        plan = Plan(np.array([payload.ctypes.data], np.uint64), zero, np.array([16], np.uint64), zero,
                    np.array([32], np.uint64))
        b.sendall(b"answer+more")  # already waiting: returned at once, nothing past 6 bytes read
        assert native.request(a.fileno(), b"HEAD", plan, 6, 1000) == b"answer"
        assert b.recv(64) == b"HEAD" + payload[16:48].tobytes()
        assert a.recv(16) == b"+more"
        with pytest.raises(TimeoutError):
            native.request(a.fileno(), b"x", None, 4, 50)  # nobody answers
        b.close()
        with pytest.raises(OSError):
            native.request(a.fileno(), b"y", None, 4, 1000)  # the peer is gone
    finally:
        a.close()
        b.close()


#: Blocks of the summed transfers: 2 tensors x 2 blocks of 5000 bytes cross 4 KiB blocks
#: of the stream and end inside one (a tail).
SUMMED = 5000


@pytest.fixture
def summed_cache() -> Iterator[tuple[RequestHandler, Registry, np.ndarray, socket.socket, socket.socket, Link]]:
    reg = Registry(5, 1)
    memory = np.zeros((2, 3 * SUMMED), dtype=np.uint8)
    reg.add(dict(num_tensors=2, tensor_size=3 * SUMMED, batch_size=3, is_blocks=True, dtype="INT8",
                 addrs=np.array([memory[0].ctypes.data, memory[1].ctypes.data], np.uint64)))
    ours, peer = socket.socketpair()
    ours.settimeout(5)
    peer.settimeout(5)
    link = Link(remote_cluster_id=9, remote_role=0, peer_pid=0, timeout_ms=5000, is_client=False)
    with ours, peer:
        yield requests.RequestHandler(reg, NoteBox(), 5000), reg, memory, ours, peer, link


def _summed_frame(reg: Registry, memory: np.ndarray, pull: bool) -> bytes:
    """Blocks 1 and 2 of both tensors, summed."""
    base = np.array([memory[0].ctypes.data, memory[1].ctypes.data], np.uint64)
    cls = wire.Pull if pull else wire.Push
    return wire.encode(cls(cache_id=1, epoch=reg.epoch, nbytes=4 * SUMMED, summed=True,
                           arrays=[base, np.array([SUMMED], np.uint64), np.array([2 * SUMMED], np.uint64)]))


def _checksum(data: bytes) -> int:
    summed = StreamSum(len(data))
    summed.add(np.frombuffer(data, dtype=np.uint8))
    return summed.checksum()


def _recv(sock: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        got += sock.recv(n - len(got))
    return bytes(got)


def test_the_fast_path_checks_a_known_summed_push(summed_cache) -> None:
    handler, reg, memory, ours, peer, link = summed_cache
    frame = _summed_frame(reg, memory, pull=False)
    rng = np.random.default_rng(5)

    def push(payload: bytes, trailer: int) -> "wire.Frame | None":
        peer.sendall(frame + payload + trailer.to_bytes(8, "little"))
        return handler.serve_known(link, ours)

    first = rng.integers(0, 256, 4 * SUMMED, dtype=np.uint8).tobytes()
    read = push(first, _checksum(first))  # not known yet: read, and checked by the Python path
    assert read is not None
    with contextlib.ExitStack() as scope:
        assert handler.handle_frame(link, read, ours, scope) is requests.OK
    second = rng.integers(0, 256, 4 * SUMMED, dtype=np.uint8).tobytes()
    assert push(second, _checksum(second)) is None  # known now: served and checked in C
    assert _recv(peer, len(wire.OK_FRAME)) == wire.OK_FRAME
    assert memory[:, SUMMED:].tobytes() == second

    third = rng.integers(0, 256, 4 * SUMMED, dtype=np.uint8).tobytes()
    assert push(third, _checksum(third[:-1] + bytes([third[-1] ^ 1]))) is None  # one bit off
    peer.settimeout(5)
    reply = wire.read_answer(peer)
    assert isinstance(reply, wire.Reply) and reply.status == int(Fault.LINK_FAILED)
    assert "checksum mismatch" in reply.message and "not written" in reply.message
    assert native.spin_readable(ours.fileno(), 1000) is False  # the stream is in step
    assert push(second, _checksum(second)) is None  # and the next push is served again
    assert _recv(peer, len(wire.OK_FRAME)) == wire.OK_FRAME
    assert memory[:, SUMMED:].tobytes() == second


def test_the_fast_path_sums_a_known_summed_pull(summed_cache) -> None:
    handler, reg, memory, ours, peer, link = summed_cache
    memory[:] = np.random.default_rng(6).integers(0, 256, memory.shape, dtype=np.uint8)
    frame = _summed_frame(reg, memory, pull=True)
    peer.sendall(frame)
    first = handler.serve_known(link, ours)  # admitted by the Python path (which sends nothing here)
    assert first is not None
    with contextlib.ExitStack() as scope:
        assert handler.handle_frame(link, first, ours, scope) is requests.OK
    peer.sendall(frame)
    assert handler.serve_known(link, ours) is None  # served in C
    got = _recv(peer, len(wire.OK_FRAME) + 4 * SUMMED + 8)
    payload = got[len(wire.OK_FRAME):-8]
    assert got[:len(wire.OK_FRAME)] == wire.OK_FRAME and payload == memory[:, SUMMED:].tobytes()
    assert int.from_bytes(got[-8:], "little") == _checksum(payload)


def test_a_summed_request_puts_the_payloads_checksum_behind_it() -> None:
    from datadist.engine.layout import Plan

    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(5)
    with a, b:
        payload = np.random.default_rng(7).integers(0, 256, 3 * SUMMED, dtype=np.uint8)
        zero = np.zeros(1, np.uint64)
        plan = Plan(np.array([payload.ctypes.data], np.uint64), zero, np.array([100, 2 * SUMMED], np.uint64),
                    np.zeros(2, np.uint64), np.array([SUMMED, SUMMED - 100], np.uint64))
        b.sendall(b"answer")
        assert native.request(a.fileno(), b"HEAD", plan, 6, 1000, 0, True) == b"answer"
        sent = payload[100:100 + SUMMED].tobytes() + payload[2 * SUMMED:3 * SUMMED - 100].tobytes()
        got = _recv(b, 4 + len(sent) + 8)
        assert got[:4] == b"HEAD" and got[4:-8] == sent
        assert int.from_bytes(got[-8:], "little") == _checksum(sent)
        big = Plan(plan.src_bases, zero, zero, zero, np.array([native.FAST_SUMMED_MAX + 1], np.uint64))
        for bad in (None, big):
            with pytest.raises(ValueError, match="summed"):
                native._native.request(a.fileno(), b"x", *((None,) * 3 if bad is None else
                                                          (bad.src_bases, bad.src_offs, bad.lens)), 4, 0, 100, True)
        assert native.spin_readable(b.fileno(), 1000) is False  # nothing was sent for them


WRAP = 1 << 64


@pytest.mark.parametrize("cls", [wire.Pull, wire.Push, wire.Sum])
@pytest.mark.parametrize("offs, lens", [
    ([WRAP - 64], [128]),          # off + len wraps to 64: would reach 64 bytes below the tensor
    ([64], [WRAP - 32]),           # len wraps off + len to 32
    ([0, WRAP - 8], [8, 16]),      # one run of two
    ([1 << 62], [8]),              # no wrap, but past any address a process maps
])
def test_plan_halves_whose_sums_wrap_are_refused(served, cls: type, offs: list[int], lens: list[int]) -> None:
    """A peer's offsets and lengths near 2^64 make ``off + len`` wrap around and look small:
    without a bound first, a pull would send (a SUM would read) memory below the tensor and
    a push would write there.  Each is refused before any byte moves, and the link goes on
    (a push's payload drained), except for a push announcing more bytes than the cache
    holds: answered, it ends the link without its payload being read."""
    handler, reg, memory, ours, peer = served
    memory[:] = 3
    before = memory.copy()
    nbytes = sum(lens) % WRAP  # what a wrapping sum gives: the size a forger would announce
    base = np.array([memory[1].ctypes.data], np.uint64)
    frame = wire.encode(cls(cache_id=1, epoch=reg.epoch, nbytes=nbytes,
                            arrays=[base, np.array(offs, np.uint64), np.array(lens, np.uint64)]))
    drained = cls is wire.Push and nbytes <= memory.size  # a size the cache could take: read
    peer.sendall(frame + (bytes(nbytes) if drained else b""))
    link = Link(remote_cluster_id=9, remote_role=0, peer_pid=0, timeout_ms=5000, is_client=False)
    got = handler.serve_known(link, ours)
    assert got is not None
    with contextlib.ExitStack() as scope:
        if cls is wire.Push and not drained:
            with pytest.raises(wire.WireError, match="outside cache 1"):
                handler.handle_frame(link, got, ours, scope)
            reply = wire.read_answer(peer)
        else:
            reply = handler.handle_frame(link, got, ours, scope)
    assert isinstance(reply, (wire.Reply, wire.Summed)) and reply.status == int(Fault.PARAM_INVALID), reply
    assert "outside cache 1" in reply.message
    assert handler.payload is None  # a pull's refusal carries no bytes
    assert not handler._known
    np.testing.assert_array_equal(memory, before)
    if drained:
        assert native.spin_readable(ours.fileno(), 1000) is False  # in step: the payload was read


def test_half_extent_bounds_a_peers_plan_half() -> None:
    u = lambda *v: np.array(v, np.uint64)  # noqa: E731
    assert native.half_extent(u(4096, 8192), u(0, 100), u(50, 20)) == (70, 120)
    assert native.half_extent(u(), u(), u()) == (0, 0)              # nothing to move
    assert native.half_extent(u(4096), u(), u()) is None            # a base and no run (crashed the send loop)
    assert native.half_extent(u(), u(0), u(8)) is None              # runs and no base
    assert native.half_extent(u(4096), u(0, 8), u(8, 0)) is None    # an empty run (plans drop them)
    assert native.half_extent(u(1), u(0, 1), u(5)) is None          # offs and lens differ in length
    assert native.half_extent(u(1 << 62), u(0), u(1)) is None       # a base past any mapping
    assert native.half_extent(u(1), u(WRAP - 1), u(2)) is None      # an offset that would wrap
    assert native.half_extent(u(1), u(0, 0, 0, 0, 0), u(*[(1 << 62) - 1] * 5)) is None  # a sum that would


@pytest.mark.parametrize("cluster_id, t_lo, t_hi", [(9, 5, 1 << 62), (9, 1, 0), (9, -1, 1), (7, 0, 1)])
def test_a_notify_naming_tensors_the_cache_lacks_or_another_cluster_ends_the_link(served, cluster_id: int,
                                                                                  t_lo: int, t_hi: int) -> None:
    """Watchers trust a notice's source and tensors (a wait intersects its range with
    theirs: [5, 2^62) froze the whole process).  A NOTIFY outside the cache's tensors, or
    from a link naming another cluster, is a protocol error: the agent ends that link."""
    handler, reg, _, ours, peer = served
    board = reg.watch(1)
    assert board is not None
    link = Link(remote_cluster_id=9, remote_role=0, peer_pid=0, timeout_ms=5000, is_client=False)
    peer.sendall(wire.encode(wire.Notify(cluster_id=cluster_id, cache_id=1, t_lo=t_lo, t_hi=t_hi)))
    frame = handler.serve_known(link, ours)
    assert frame is not None
    with contextlib.ExitStack() as scope, pytest.raises(wire.WireError, match="a NOTIFY from cluster 9"):
        handler.handle_frame(link, frame, ours, scope)
    peer.sendall(wire.encode(wire.Notify(cluster_id=9, cache_id=1, t_lo=0, t_hi=2, nbytes=8)))  # a sound one
    frame = handler.serve_known(link, ours)
    assert frame is not None
    with contextlib.ExitStack() as scope:
        assert handler.handle_frame(link, frame, ours, scope) is None
    assert board.wait(range(0, 2), time.monotonic() + 5, None) is not None


def test_a_refused_push_is_drained_within_one_timeout_however_it_trickles(served) -> None:
    """A stale push's payload is read to keep the stream in step, but within the engine's
    timeout as a whole: a peer sending a little at a time cannot hold the agent longer."""
    handler, reg, memory, ours, peer = served
    handler.timeout_ms = 300
    base = np.array([memory[0].ctypes.data, memory[1].ctypes.data], np.uint64)
    frame = wire.encode(wire.Push(cache_id=1, epoch=reg.epoch + 1, nbytes=64 << 20,  # stale: drained
                                  arrays=[base, np.array([0], np.uint64), np.array([BLOCK], np.uint64)]))
    peer.sendall(frame)
    link = Link(remote_cluster_id=9, remote_role=0, peer_pid=0, timeout_ms=300, is_client=False)
    got = handler.serve_known(link, ours)
    assert got is not None
    stop = threading.Event()

    def trickle() -> None:  # 1 MiB every 100 ms: each 1 MiB read finishes within its own 300 ms
        chunk = bytes(1 << 20)
        while not stop.wait(0.1):
            try:
                peer.sendall(chunk)
            except OSError:
                return
    threading.Thread(target=trickle, daemon=True).start()
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as scope, pytest.raises(TimeoutError):
            handler.handle_frame(link, got, ours, scope)
    finally:
        stop.set()
    assert time.monotonic() - started < 2.0
    assert not memory.any()
