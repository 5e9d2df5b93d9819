"""A cache freed while a peer still moves bytes into it: the memory goes back to the pool
only once that transfer has ended, so the next cache placed there is never overwritten;
registered memory is the caller's again only once nothing writes it.

The prompt pushes into the decoder's blocks cache, call after call; the decoder frees the
cache while a push is landing, at once allocates a probe cache of the same size (the pool's
first fit puts it where the freed one was) and fills it, names a new cache with the key, and
once the prompt's next push lands there (its previous one has ended then) reads the probe
back.  Before the fence, a same-host push (a one-sided copy) or a socket push the agent was
still receiving wrote its rest into the probe.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple, TypeVar

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import DECODER_ID, PROMPT_ID, SYNC_KV_TIMEOUT_MS, TRANSPORTS, Desc, Peer, Ref, blocks_key, expect_llm

pytestmark = pytest.mark.timeout(120)

#: 16 MiB: a push takes milliseconds, so a free lands inside one.
BLOCKS = Desc(1, (64, 1 << 18), "uint8")
MARK = 0x11
ROUNDS = 12

_T = TypeVar("_T")


def _under_pushes(peer_factory: Any, transport: str, tmp_path: Any, prepare: Callable[[Peer], None],
                  work: Callable[[Peer], _T]) -> Tuple[_T, Dict[int, int], Peer]:
    """Run ``work`` on the decoder (its cache named ``blocks_key(DECODER_ID)`` made by
    ``prepare``) while the prompt pushes bytes ``MARK`` into that cache, call after call;
    ``work``'s result, the pushes' outcomes by status code, and the decoder."""
    p, d = peer_factory("pair", transport).peers()
    p.alloc("src", BLOCKS, blocks=True)
    p.write("src", [bytes([MARK]) * (64 << 18)])
    prepare(d)
    stop = tmp_path / "stop"
    pushing = p.start_call("keep_calling", "push_blocks", [blocks_key(DECODER_ID), Ref("src")],
                           {"src_blocks": list(range(64)), "dst_blocks": list(range(64))}, str(stop), 100.0)
    try:
        done = work(d)
    finally:
        stop.touch()
    return done, pushing.result(30), d


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_cache_freed_under_a_push_gives_its_memory_back_after_it(peer_factory: Any, transport: str,
                                                                   tmp_path: Any) -> None:
    rounds, outcomes, _ = _under_pushes(
        peer_factory, transport, tmp_path, lambda d: d.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID)),
        lambda d: d.call("free_under_pushes", "dst", blocks_key(DECODER_ID), ROUNDS, MARK, timeout=90))
    assert outcomes.get(0, 0) >= ROUNDS, f"pushes that went through: {outcomes}"
    assert any(rounds["same_address"]), f"the probe never took the freed memory: {rounds}"
    assert rounds["overwritten"] == [0] * ROUNDS, f"bytes of the probe overwritten per round: {rounds}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unregistered_memory_is_written_no_more(peer_factory: Any, transport: str, tmp_path: Any) -> None:
    """``unregister_cache`` returns once no peer's push writes the memory: zeroed right
    after, it stays zero whatever the peer's push under way did."""
    _, outcomes, d = _under_pushes(
        peer_factory, transport, tmp_path, lambda d: d.register("user", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID)),
        lambda d: d.call("unregister_under_pushes", "user", MARK))
    assert outcomes.get(0, 0) >= 1, f"no push went through: {outcomes}"
    written = int(np.count_nonzero(d.read("user-kept")))
    assert written == 0, f"{written} bytes written after unregister_cache returned"


def test_a_frozen_peer_holds_a_free_for_a_bounded_time_and_keeps_the_memory(peer_factory: Any) -> None:
    """A same-host peer that cannot answer the fence (frozen: it might be mid-copy) breaks
    its link after ``2 * sync_kv_timeout``; the free returns then, and the memory stays out
    of the pool rather than be given to a cache the peer may still write into."""
    pair = peer_factory("pair", "shm")
    p, d = pair.peers()
    d.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID))
    before = d.call("engine", "metrics")["pools"]
    p.stop()
    try:
        _, took = d.timed_cm("deallocate_blocks_cache", Ref("dst"), timeout=30)
    finally:
        p.cont()
    after = d.call("engine", "metrics")["pools"]
    assert 1.5 < took < 2 * SYNC_KV_TIMEOUT_MS / 1000 + 3, f"the free took {took:.2f} s"
    assert after == before, f"pools before the free {before}, after {after}"
    d.alloc("again", BLOCKS, blocks=True)
    with expect_llm(S.LLM_LINK_FAILED):  # the link that could not be fenced is broken
        d.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("again"), [0], [0])
