"""Link and transport logic on the in-memory fakes (tests/fakes): no sockets, no peer."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from datadist.engine import wire
from datadist.engine.errors import EngineError, Fault
from datadist.engine.layout import Plan, plan_units
from datadist.engine.link import Link
from datadist.engine.transports.base import STALE, RemoteCache, StaleLookup
from datadist.engine.transports.tcp import TcpTransport
from fakes import FakeChannel, FakeTransport
from waiting import until

pytestmark = pytest.mark.timeout(30)

BLOCK = 64


def _remote(buf: np.ndarray, watched: bool = False) -> RemoteCache:
    """Raw "peer" memory that is really this process's buffer (one tensor of 4 blocks)."""
    return RemoteCache(cache_id=-1, row=0, num_tensors=1, tensor_size=buf.nbytes, batch_size=4, is_blocks=True,
                       dtype="", addrs=np.array([buf.ctypes.data], np.uint64), epoch=0, watched=watched)


def _link(transport: FakeTransport) -> Link:
    return Link(remote_cluster_id=2, remote_role=0, peer_pid=0, timeout_ms=1000, is_client=True,
                local_cluster_id=1, transport=transport)


def _planner(src: np.ndarray, blocks: list[int]):
    def plan(remote: RemoteCache) -> Plan:
        offs = [b * BLOCK for b in blocks]
        return plan_units([src.ctypes.data], offs, [int(remote.addrs[0])], offs, BLOCK)
    return plan


def test_a_push_moves_exactly_the_planned_blocks() -> None:
    src = np.arange(4 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    transport = FakeTransport()
    _link(transport).transfer(_remote(dst), _planner(src, [1, 3]), push=True)
    assert [c[0] for c in transport.calls] == ["push"]
    assert not dst[:BLOCK].any() and not dst[2 * BLOCK:3 * BLOCK].any()
    assert np.array_equal(dst[BLOCK:2 * BLOCK], src[BLOCK:2 * BLOCK])
    assert np.array_equal(dst[3 * BLOCK:], src[3 * BLOCK:])


def test_a_stale_lookup_is_retried_once_then_reported() -> None:
    src = np.ones(4 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    # One stale answer: the second try goes through.
    transport = FakeTransport(failures=(StaleLookup("changed"), None))
    _link(transport).transfer(_remote(dst), _planner(src, [0]), push=True)
    assert len(transport.calls) == 2 and dst[:BLOCK].all()
    # Stale every time: CACHE_NOT_FOUND after the second try, nothing more.
    transport = FakeTransport(failures=(StaleLookup("changed"),) * 5)
    with pytest.raises(EngineError) as caught:
        _link(transport).transfer(_remote(dst), _planner(src, [0]), push=True)
    assert caught.value.fault == Fault.CACHE_NOT_FOUND and "kept changing" in str(caught.value)
    assert len(transport.calls) == 2


def test_a_transport_error_is_raised_with_its_fault_and_the_link_stays_usable() -> None:
    src = np.ones(4 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    link = _link(FakeTransport(failures=(EngineError(Fault.LINK_FAILED, "peer gone"), None)))
    with pytest.raises(EngineError) as caught:
        link.transfer(_remote(dst), _planner(src, [2]), push=False)
    assert caught.value.fault == Fault.LINK_FAILED and not dst.any()
    link.transfer(_remote(dst), _planner(src, [2]), push=False)  # the lock was released
    assert dst[2 * BLOCK:3 * BLOCK].all()


def test_a_planner_refusal_reaches_the_caller_untouched() -> None:
    transport = FakeTransport()

    def refuse(remote: RemoteCache) -> Plan:
        raise ValueError("dst_blocks[0] = 9 is outside [0, 4)")

    with pytest.raises(ValueError, match="outside"):
        _link(transport).transfer(_remote(np.zeros(4 * BLOCK, np.uint8)), refuse, push=True)
    assert transport.calls == []


def test_tcp_push_sends_the_peer_half_of_the_plan_and_maps_the_reply() -> None:
    src = np.arange(4 * BLOCK, dtype=np.uint8)
    remote = RemoteCache(cache_id=5, row=0, num_tensors=1, tensor_size=4 * BLOCK, batch_size=4, is_blocks=True,
                         dtype="", addrs=np.array([0x7000_0000], np.uint64), epoch=9)
    plan = plan_units([src.ctypes.data], [0, 2 * BLOCK], [0x7000_0000], [BLOCK, 3 * BLOCK], BLOCK)
    channel = FakeChannel(answers=(wire.Reply(),
                                   wire.Reply(status=STALE, message="caches changed"),
                                   wire.Reply(status=int(Fault.CACHE_NOT_FOUND), message="cache 5 is gone")))
    assert TcpTransport().push(channel, plan, remote, deadline=1e18) is True
    msg, payload = channel.sent[0]
    assert isinstance(msg, wire.Push) and (msg.cache_id, msg.epoch, msg.nbytes) == (5, 9, 2 * BLOCK)
    assert msg.arrays[0].tolist() == [0x7000_0000] and msg.arrays[1].tolist() == [BLOCK, 3 * BLOCK]
    assert payload is not None and payload.src_offs.tolist() == [0, 2 * BLOCK]  # the local half follows
    with pytest.raises(StaleLookup):
        TcpTransport().push(channel, plan, remote, deadline=1e18)
    with pytest.raises(EngineError) as caught:
        TcpTransport().push(channel, plan, remote, deadline=1e18)
    assert caught.value.fault == Fault.CACHE_NOT_FOUND and "gone" in str(caught.value)


def test_an_unexpected_frame_breaks_the_channel() -> None:
    remote = RemoteCache(cache_id=5, row=0, num_tensors=1, tensor_size=BLOCK, batch_size=1, is_blocks=True,
                         dtype="", addrs=np.array([0x7000_0000], np.uint64), epoch=9)
    src = np.zeros(BLOCK, np.uint8)
    plan = plan_units([src.ctypes.data], [0], [0x7000_0000], [0], BLOCK)
    channel = FakeChannel(answers=(wire.Resolved(),))
    with pytest.raises(EngineError) as caught:
        TcpTransport().push(channel, plan, remote, deadline=1e18)
    assert caught.value.fault == Fault.LINK_FAILED and channel.broken == "unexpected Resolved frame"


def test_tcp_pushes_in_a_batch_go_out_before_any_answer_is_read() -> None:
    src = np.arange(4 * BLOCK, dtype=np.uint8)
    remote = RemoteCache(cache_id=5, row=0, num_tensors=1, tensor_size=4 * BLOCK, batch_size=4, is_blocks=True,
                         dtype="", addrs=np.array([0x7000_0000], np.uint64), epoch=9)
    plans = [plan_units([src.ctypes.data], [b * BLOCK], [0x7000_0000], [b * BLOCK], BLOCK) for b in range(3)]
    channel = FakeChannel(answers=(wire.Reply(), wire.Reply(status=STALE, message="caches changed"),
                                   wire.Reply(status=int(Fault.PARAM_INVALID), message="outside cache 5")))
    events: list[str] = []
    send, read = channel.send_request, channel.read_reply
    channel.send_request = lambda *a, **k: (events.append("send"), send(*a, **k))[1]  # type: ignore[method-assign]
    channel.read_reply = lambda *a, **k: (events.append("read"), read(*a, **k))[1]  # type: ignore[method-assign]
    transport = TcpTransport()
    steps = [transport.prepare(channel, plan, remote, push=True) for plan in plans]
    outcomes = transport.run_batch(channel, steps, deadline=1e18)
    assert events == ["send"] * 3 + ["read"] * 3
    assert outcomes[0] is True and isinstance(outcomes[1], StaleLookup)
    assert isinstance(outcomes[2], EngineError) and outcomes[2].fault == Fault.PARAM_INVALID
    assert [m.arrays[1].tolist() for m, _ in channel.sent] == [[0], [BLOCK], [2 * BLOCK]]


def test_a_batch_redoes_a_stale_plan_alone_and_raises_the_first_other_error_last() -> None:
    src = np.arange(4 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    # Step outcomes in order: ok, stale (redone alone: ok), param invalid, ok.
    transport = FakeTransport(failures=(None, StaleLookup("changed"), EngineError(Fault.PARAM_INVALID, "no"), None,
                                        None))
    link = _link(transport)
    with pytest.raises(EngineError) as caught:
        link.transfer_batch(_remote(dst), [_planner(src, [b]) for b in range(4)], True, [None] * 4)
    assert caught.value.fault == Fault.PARAM_INVALID
    assert dst[:2 * BLOCK].tolist() == src[:2 * BLOCK].tolist() and dst[3 * BLOCK:].tolist() == src[3 * BLOCK:].tolist()
    assert not dst[2 * BLOCK:3 * BLOCK].any()
    link.transfer(_remote(dst), _planner(src, [2]), push=True)  # the lock was released
    assert dst.tolist() == src.tolist()


def test_a_queued_transfer_whose_holder_is_interrupted_fails_with_an_engine_error() -> None:
    """The thread holding the link runs the transfers queued behind it; if it is
    interrupted there (KeyboardInterrupt), each queued caller gets LLM_FAILED, not the
    turn-taking's own exception, and the interruption stays with the holder."""
    src = np.arange(4 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    link = _link(FakeTransport())
    known = link.transfer(_remote(dst), _planner(src, [0]), push=True)
    assert link.turns.acquire(blocking=False)
    outcome: list[BaseException] = []

    def queued() -> None:
        try:
            link.transfer(_remote(dst), _planner(src, [0]), push=True, prepared=known)
        except BaseException as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcome.append(exc)

    def interrupted(jobs: list) -> list:
        raise KeyboardInterrupt

    caller = threading.Thread(target=queued)
    caller.start()
    until(lambda: bool(link.turns._queue))  # the caller's job is queued behind the holder
    link.turns._serve = interrupted
    with pytest.raises(KeyboardInterrupt):
        link.turns.release()
    caller.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], EngineError), outcome
    assert outcome[0].fault == Fault.FAILED and "did not run" in str(outcome[0])
