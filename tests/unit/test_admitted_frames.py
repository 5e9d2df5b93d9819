"""The agent's memory of admitted transfer frames (``RequestHandler.handle_frame``), over a
real socket pair: a frame byte for byte equal to one admitted before is served without
decoding it again, but only while the registry is unchanged, and never on another
cache's behalf."""
from __future__ import annotations

import contextlib
import socket
from typing import Iterator

import numpy as np
import pytest

from datadist.engine import native, requests, wire
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
    cls, data, blen = wire.read_frame(ours)
    with contextlib.ExitStack() as scope:
        reply = handler.handle_frame(link, cls, data, blen, ours, scope)
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
    assert not handler._admitted_frames
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
