"""Every error code of the contract that arises without an accelerator (SPEC sections 1, 4, 5).

Validation errors run against a linked pair shared by the module (one per transport) and
check that the failed call changed nothing: the destination (and source) bytes are the
same afterwards.  Link, lifecycle, pool, deadline and peer-death cases use processes of
their own.
"""
from __future__ import annotations

import socket
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import (DECODER_ID, PROMPT_ID, SYNC_KV_TIMEOUT_MS, TRANSPORTS, Desc, Pair, Peer,
                     PeerError, Ref, base_config, blocks_key, cache_key, expect_blocks,
                     expect_exc, expect_llm, free_port, id_key)

pytestmark = pytest.mark.timeout(60)

BLOCKS = Desc(8, (8, 8, 32), "fp16")  # 4 layers of K,V; 8 blocks of 512 bytes
ROWS = Desc(8, (4, 32, 32), "fp16")   # 4 rows of 2 KiB


@pytest.fixture
def caches(pair: Pair) -> Dict[str, Any]:
    """Filled caches on both sides, and their bytes for :func:`_assert_unchanged`.

    prompt: "src" blocks cache (BlocksCacheKey(PROMPT_ID, 0)), "rows" cache with
    CacheKey(PROMPT_ID, 500 + i).  decoder: "dst" blocks cache (BlocksCacheKey(DECODER_ID, 0)),
    "drows" cache with CacheKey(DECODER_ID, 600 + i).
    """
    p, d = pair.prompt, pair.decoder
    made: Dict[str, Any] = {
        "src": p.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID)),
        "rows": p.alloc("rows", ROWS, keys=[cache_key(PROMPT_ID, 500 + i) for i in range(4)]),
        "dst": d.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID)),
        "drows": d.alloc("drows", ROWS, keys=[cache_key(DECODER_ID, 600 + i) for i in range(4)]),
    }
    made["pair"] = pair
    made["unchanged"] = {
        ("prompt", "src"): p.fill("src", BLOCKS, 1),
        ("prompt", "rows"): p.fill("rows", ROWS, 2),
        ("decoder", "dst"): d.fill("dst", BLOCKS, 3),
        ("decoder", "drows"): d.fill("drows", ROWS, 4),
    }
    return made


def _assert_unchanged(caches: Dict[str, Any]) -> None:
    """Failed calls changed nothing: every cache still holds its bytes."""
    pair = caches["pair"]
    for (side, name), before in caches["unchanged"].items():
        peer = pair.prompt if side == "prompt" else pair.decoder
        np.testing.assert_array_equal(peer.read(name), before,
                                      err_msg=f"{side} {name} changed by a failed call")


# ------------------------------------------------------------------ links, keys


def test_not_yet_link(caches: Dict[str, Any]) -> None:
    """A key naming a cluster with no link: LLM_NOT_YET_LINK, for pulls and pushes."""
    p, d = caches["pair"].peers()
    with expect_llm(S.LLM_NOT_YET_LINK):
        d.cm("pull_blocks", blocks_key(99), Ref("dst"), [0], [1])
    with expect_llm(S.LLM_NOT_YET_LINK):
        d.cm("pull_cache", cache_key(99, 500), Ref("drows"), 0)
    with expect_llm(S.LLM_NOT_YET_LINK):
        d.cm("pull_cache", id_key(99, caches["rows"]["cache_id"], 0), Ref("drows"), 0)
    with expect_llm(S.LLM_NOT_YET_LINK):
        p.cm("push_blocks", blocks_key(98), Ref("src"), [0], [1])
    with expect_llm(S.LLM_NOT_YET_LINK):
        p.cm("push_cache", id_key(98, caches["drows"]["cache_id"], 0), Ref("rows"), 0)
    _assert_unchanged(caches)


def test_unknown_remote_key(caches: Dict[str, Any]) -> None:
    """Unknown blocks key, cache id or request id on the peer: LLM_KV_CACHE_NOT_EXIST."""
    p, d = caches["pair"].peers()
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm("pull_blocks", blocks_key(PROMPT_ID, 77), Ref("dst"), [0], [1])
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm("pull_blocks", id_key(PROMPT_ID, 987654), Ref("dst"), [0], [1])
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm("pull_cache", cache_key(PROMPT_ID, 555), Ref("drows"), 0)
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm("pull_cache", id_key(PROMPT_ID, 987654, 0), Ref("drows"), 0)
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        p.cm("push_blocks", blocks_key(DECODER_ID, 77), Ref("src"), [0], [1])
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        p.cm("push_cache", id_key(DECODER_ID, 987654, 0), Ref("rows"), 0)
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        p.cm("push_cache", cache_key(DECODER_ID, 555), Ref("rows"), 0)
    _assert_unchanged(caches)


def test_remote_row_out_of_range(caches: Dict[str, Any]) -> None:
    """A CacheKeyByIdAndIndex row past the remote batch: LLM_KV_CACHE_NOT_EXIST."""
    p, d = caches["pair"].peers()
    rows = ROWS.shape[0]
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm("pull_cache", id_key(PROMPT_ID, caches["rows"]["cache_id"], rows), Ref("drows"), 0)
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm("pull_blocks", id_key(PROMPT_ID, caches["rows"]["cache_id"], rows + 5),
             Ref("dst"), (), [0, 1, 2, 3])
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        p.cm("push_cache", id_key(DECODER_ID, caches["drows"]["cache_id"], rows), Ref("rows"), 0)
    _assert_unchanged(caches)


def test_unknown_local_cache(caches: Dict[str, Any]) -> None:
    """A deallocated local cache: LLM_KV_CACHE_NOT_EXIST; deallocating again is a no-op."""
    p, d = caches["pair"].peers()
    d.cm("deallocate_blocks_cache", Ref("dst"))
    d.cm("deallocate_blocks_cache", Ref("dst"))
    p.cm("deallocate_cache", Ref("rows"))
    del caches["unchanged"][("decoder", "dst")], caches["unchanged"][("prompt", "rows")]
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), [0], [1])
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        p.cm("push_cache", id_key(DECODER_ID, caches["drows"]["cache_id"], 0), Ref("rows"), 0)
    # The keys of a freed cache are gone on its owner as well.
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm("pull_cache", cache_key(PROMPT_ID, 501), Ref("drows"), 0)
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        p.cm("push_blocks", blocks_key(DECODER_ID), Ref("src"), [0], [1])
    _assert_unchanged(caches)


def test_cache_key_is_consumed_by_pull_cache(caches: Dict[str, Any]) -> None:
    """pull_cache through a CacheKey releases the key: the second pull is NOT_EXIST."""
    p, d = caches["pair"].peers()
    src = caches["unchanged"][("prompt", "rows")]
    dst0 = caches["unchanged"][("decoder", "drows")]
    d.cm("pull_cache", cache_key(PROMPT_ID, 502), Ref("drows"), 1)
    after_first = dst0.copy()
    rb = ROWS.row_bytes
    after_first[:, rb:2 * rb] = src[:, 2 * rb:3 * rb]
    np.testing.assert_array_equal(d.read("drows"), after_first)
    caches["unchanged"][("decoder", "drows")] = after_first
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm("pull_cache", cache_key(PROMPT_ID, 502), Ref("drows"), 3)
    # The other keys of the cache are still there; remove_cache_key drops one (twice: no-op).
    p.cm("remove_cache_key", cache_key(PROMPT_ID, 503))
    p.cm("remove_cache_key", cache_key(PROMPT_ID, 503))
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm("pull_cache", cache_key(PROMPT_ID, 503), Ref("drows"), 3)
    _assert_unchanged(caches)


# ------------------------------------------------------------------ parameters


BAD_RANGES: List[Tuple[str, Dict[str, Any]]] = [
    ("past_end", {"src_layer_range": range(0, 5), "dst_layer_range": range(0, 5)}),
    ("stop_past_end", {"src_layer_range": range(3, 5), "dst_layer_range": range(0, 2)}),
    ("step_2", {"src_layer_range": range(0, 4, 2), "dst_layer_range": range(0, 4, 2)}),
    ("empty", {"src_layer_range": range(2, 2), "dst_layer_range": range(2, 2)}),
    ("negative", {"src_layer_range": range(-1, 1), "dst_layer_range": range(0, 2)}),
    ("unequal", {"src_layer_range": range(0, 2), "dst_layer_range": range(0, 3)}),
    ("n4_past_end", {"src_layer_range": range(0, 3), "dst_layer_range": range(0, 3),
                     "tensor_num_per_layer": 4}),
    ("n1_past_end", {"src_layer_range": range(7, 9), "dst_layer_range": range(0, 2),
                     "tensor_num_per_layer": 1}),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in BAD_RANGES], ids=[c[0] for c in BAD_RANGES])
def test_bad_layer_ranges(caches: Dict[str, Any], kwargs: Dict[str, Any]) -> None:
    """Layer ranges outside [0, num_tensors // N), with step != 1, empty or of unequal
    length: LLM_PARAM_INVALID from pull_blocks, pull_cache, push_blocks and push_cache."""
    p, d = caches["pair"].peers()
    with expect_llm(S.LLM_PARAM_INVALID):
        d.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), [0, 1], [2, 3], **kwargs)
    with expect_llm(S.LLM_PARAM_INVALID):
        d.cm("pull_cache", id_key(PROMPT_ID, caches["rows"]["cache_id"], 0), Ref("drows"), 0,
             **kwargs)
    with expect_llm(S.LLM_PARAM_INVALID):
        p.cm("push_blocks", blocks_key(DECODER_ID), Ref("src"), [0, 1], [2, 3], **kwargs)
    with expect_llm(S.LLM_PARAM_INVALID):
        p.cm("push_cache", id_key(DECODER_ID, caches["drows"]["cache_id"], 0), Ref("rows"), 0,
             **kwargs)
    _assert_unchanged(caches)


def test_push_needs_the_same_range_on_both_sides(caches: Dict[str, Any]) -> None:
    """push_* with different (equally long) src and dst ranges: LLM_PARAM_INVALID."""
    p, _ = caches["pair"].peers()
    with expect_llm(S.LLM_PARAM_INVALID):
        p.cm("push_blocks", blocks_key(DECODER_ID), Ref("src"), [0], [1],
             src_layer_range=range(0, 2), dst_layer_range=range(1, 3))
    with expect_llm(S.LLM_PARAM_INVALID):
        p.cm("push_cache", id_key(DECODER_ID, caches["drows"]["cache_id"], 0), Ref("rows"), 0,
             range(0, 1), range(3, 4))
    _assert_unchanged(caches)


BAD_BLOCKS = [
    ("src_past_end", [0, 8], [0, 1]),
    ("dst_past_end", [0, 1], [1, 8]),
    ("far_past_end", [1000], [0]),
    ("unequal_lengths", [0, 1, 2], [0, 1]),
    ("dst_missing", [0], []),
]


@pytest.mark.parametrize("src_blocks,dst_blocks", [c[1:] for c in BAD_BLOCKS],
                         ids=[c[0] for c in BAD_BLOCKS])
def test_bad_block_lists(caches: Dict[str, Any], src_blocks: List[int],
                         dst_blocks: List[int]) -> None:
    """Block ids >= num_blocks or lists of unequal length: LLM_PARAM_INVALID."""
    p, d = caches["pair"].peers()
    with expect_llm(S.LLM_PARAM_INVALID):
        d.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), src_blocks, dst_blocks)
    with expect_llm(S.LLM_PARAM_INVALID):
        p.cm("push_blocks", blocks_key(DECODER_ID), Ref("src"), src_blocks, dst_blocks)
    _assert_unchanged(caches)


def test_negative_and_non_int_block_ids(caches: Dict[str, Any]) -> None:
    """A negative block id is out of domain (ValueError/PARAM_INVALID); a str is a TypeError."""
    p, d = caches["pair"].peers()
    with expect_exc("ValueError", "LLMException", codes=[S.LLM_PARAM_INVALID]):
        d.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), [-1], [0])
    with expect_exc("ValueError", "LLMException", codes=[S.LLM_PARAM_INVALID]):
        p.cm("push_blocks", blocks_key(DECODER_ID), Ref("src"), [0], [-2])
    with expect_exc("TypeError"):
        d.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), ["0"], [1])
    _assert_unchanged(caches)


BAD_N = [
    ("zero", 0, ("LLMException",)),
    ("negative", -2, ("ValueError",)),
    ("float", 2.0, ("TypeError",)),
    ("str", "2", ("TypeError",)),
    ("not_dividing", 3, ("LLMException",)),
    ("above_num_tensors", 16, ("LLMException",)),
]


@pytest.mark.parametrize("n,exc_types", [c[1:] for c in BAD_N], ids=[c[0] for c in BAD_N])
def test_bad_tensor_num_per_layer(caches: Dict[str, Any], n: Any, exc_types: Tuple[str]
                                  ) -> None:
    """tensor_num_per_layer with ranges: 0 or not dividing num_tensors -> LLMException
    (PARAM_INVALID), negative -> ValueError, float or str -> TypeError."""
    p, d = caches["pair"].peers()
    codes = [S.LLM_PARAM_INVALID]
    with expect_exc(*exc_types, codes=codes):
        d.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), [0], [1],
             src_layer_range=range(0, 1), dst_layer_range=range(1, 2), tensor_num_per_layer=n)
    with expect_exc(*exc_types, codes=codes):
        p.cm("push_blocks", blocks_key(DECODER_ID), Ref("src"), [0], [1],
             src_layer_range=range(0, 1), dst_layer_range=range(0, 1), tensor_num_per_layer=n)
    with expect_exc(*exc_types, codes=codes):
        d.cm("pull_cache", id_key(PROMPT_ID, caches["rows"]["cache_id"], 0), Ref("drows"), 0,
             src_layer_range=range(0, 1), dst_layer_range=range(0, 1), tensor_num_per_layer=n)
    _assert_unchanged(caches)


def test_row_arguments(caches: Dict[str, Any]) -> None:
    """Destination row out of range, size beyond a row, push_cache with size != -1, and
    blocks into a contiguous cache: LLM_PARAM_INVALID."""
    p, d = caches["pair"].peers()
    rows_id = caches["rows"]["cache_id"]
    with expect_llm(S.LLM_PARAM_INVALID):
        d.cm("pull_cache", id_key(PROMPT_ID, rows_id, 0), Ref("drows"), ROWS.shape[0])
    with expect_llm(S.LLM_PARAM_INVALID):
        d.cm("pull_cache", id_key(PROMPT_ID, rows_id, 0), Ref("drows"), 0, ROWS.row_bytes + 2)
    with expect_llm(S.LLM_PARAM_INVALID):
        p.cm("push_cache", id_key(DECODER_ID, caches["drows"]["cache_id"], 0), Ref("rows"), 0,
             size=ROWS.row_bytes // 2)
    with expect_llm(S.LLM_PARAM_INVALID):
        p.cm("push_cache", id_key(DECODER_ID, caches["drows"]["cache_id"], 0), Ref("rows"),
             ROWS.shape[0])
    with expect_llm(S.LLM_PARAM_INVALID):
        d.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("drows"), [0, 1], [0, 1])
    _assert_unchanged(caches)


# ------------------------------------------------------------------ link results


def test_link_unreachable(pair: Pair) -> None:
    """Nobody listens at the address: LLM_LINK_FAILED in the per-cluster list, in time."""
    dead_port = free_port()
    ret, rets, elapsed = pair.decoder.call("timed_link", [(50, "127.0.0.1", dead_port)], 1000)
    assert rets == [S.LLM_LINK_FAILED], (ret, rets)
    assert ret != S.LLM_SUCCESS
    assert elapsed < 1.0 + 2.0, f"link_clusters took {elapsed:.2f} s with timeout=1000 ms"
    pair.decoder.alloc("dst", BLOCKS, blocks=True)
    with expect_llm(S.LLM_NOT_YET_LINK):
        pair.decoder.cm("pull_blocks", blocks_key(50), Ref("dst"), [0], [0])


def test_a_list_links_its_clusters_at_once(peer_factory: Any) -> None:
    """link_clusters links the clusters of a list at once, each within the whole timeout,
    as CANN does: one that never answers does not spend the next one's time.  The statuses
    follow the list; a cluster named twice links once (its second entry LLM_ALREADY_LINK),
    and unlink_clusters treats a list the same way."""
    port = free_port()
    prompt = peer_factory("peer", "p", "PROMPT", PROMPT_ID, base_config("tcp", listen_port=port))
    decoder = peer_factory("peer", "d", "DECODER", DECODER_ID, base_config("tcp"))
    prompt.wait_ready()
    live = (PROMPT_ID, "127.0.0.1", port)
    with socket.socket() as silent:  # takes connections into its backlog and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        ret, rets, elapsed = decoder.call("timed_link", [(50, "127.0.0.1", silent.getsockname()[1]), live, live], 1500)
    assert rets == [S.LLM_LINK_FAILED, S.LLM_SUCCESS, S.LLM_ALREADY_LINK], (ret, rets)
    assert 1.3 < elapsed < 1.5 + 2.0, f"link_clusters took {elapsed:.2f} s with timeout=1500 ms"
    prompt.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID))
    data = prompt.fill("src", BLOCKS, 5)
    decoder.alloc("dst", BLOCKS, blocks=True)
    dst0 = decoder.read("dst")
    decoder.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), [1, 2], [1, 2])
    np.testing.assert_array_equal(decoder.read("dst"), expect_blocks(dst0, data, [1, 2], [1, 2], BLOCKS.row_bytes))
    ret, rets = decoder.call("unlink", [live, live], 3000)
    assert rets == [S.LLM_SUCCESS, S.LLM_NOT_YET_LINK], (ret, rets)


def test_double_link(pair: Pair) -> None:
    """Linking an already linked cluster: LLM_ALREADY_LINK; the first link keeps working."""
    ret, rets = pair.decoder.link(pair.prompt, expect_ok=False)
    assert rets == [S.LLM_ALREADY_LINK], (ret, rets)
    src = pair.prompt.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID))
    assert src["addrs"]
    data = pair.prompt.fill("src", BLOCKS, 9)
    pair.decoder.alloc("dst", BLOCKS, blocks=True)
    dst0 = pair.decoder.fill("dst", BLOCKS, 10)
    pair.decoder.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), [3], [4])
    np.testing.assert_array_equal(pair.decoder.read("dst"),
                                  expect_blocks(dst0, data, [3], [4], BLOCKS.row_bytes))


def test_cluster_num_exceed_limit(pair: Pair) -> None:
    """17 clusters in one link_clusters call: LLM_CLUSTER_NUM_EXCEED_LIMIT, nothing linked."""
    clusters = [(1000 + i, "127.0.0.1", pair.prompt.listen_port) for i in range(17)]
    ret, rets = pair.decoder.call("link", clusters, 3000)
    assert S.LLM_CLUSTER_NUM_EXCEED_LIMIT in [ret] + rets, (ret, rets)
    assert S.LLM_SUCCESS not in rets, (ret, rets)
    pair.decoder.alloc("dst", BLOCKS, blocks=True)
    with expect_llm(S.LLM_NOT_YET_LINK):
        pair.decoder.cm("pull_blocks", blocks_key(1000), Ref("dst"), [0], [0])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unlink_removes_both_ends(peer_factory: Any, transport: str) -> None:
    """Unlink by the client: transfers from either end are LLM_NOT_YET_LINK; relinking works."""
    pair_ = peer_factory("pair", transport)
    p, d = pair_.peers()
    p.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID))
    d.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID))
    data = p.fill("src", BLOCKS, 11)
    dst0 = d.fill("dst", BLOCKS, 12)
    ret, rets = d.call("unlink", [(PROMPT_ID, "127.0.0.1", p.listen_port)], 3000)
    assert (ret, rets) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    with expect_llm(S.LLM_NOT_YET_LINK):
        d.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), [0], [0])
    with expect_llm(S.LLM_NOT_YET_LINK):
        p.cm("push_blocks", blocks_key(DECODER_ID), Ref("src"), [0], [0])
    np.testing.assert_array_equal(d.read("dst"), dst0)
    d.link(p)
    p.cm("push_blocks", blocks_key(DECODER_ID), Ref("src"), [5], [6])
    np.testing.assert_array_equal(d.read("dst"), expect_blocks(dst0, data, [5], [6],
                                                               BLOCKS.row_bytes))


# ------------------------------------------------------------------ lifecycle, pools


def test_allocation_without_pool(peer_factory: Any) -> None:
    """Allocation without the matching pool option: LLM_PARAM_INVALID (as CANN) naming it;
    registration still works without pools."""
    peer = peer_factory("peer", "solo", "PROMPT", PROMPT_ID,
                        base_config("shm", mem_pool_cfg=None, host_mem_pool_cfg=None))
    with expect_llm(S.LLM_PARAM_INVALID) as caught:
        peer.alloc("a", Desc(2, (4, 16), "fp16", "DEVICE"))
    assert "mem_pool_cfg" in caught[0].message or "llm.MemPoolConfig" in caught[0].message
    with expect_llm(S.LLM_PARAM_INVALID) as caught:
        peer.alloc("b", Desc(2, (4, 16), "fp16", "HOST"), blocks=True)
    assert ("host_mem_pool_cfg" in caught[0].message
            or "llm.HostMemPoolConfig" in caught[0].message), caught[0].message
    made = peer.register("c", Desc(2, (4, 16), "int8", "HOST"), blocks=True)
    assert len(made["addrs"]) == 2


def test_pool_exhausted(peer_factory: Any) -> None:
    """A request beyond the free pool: LLM_OUT_OF_MEMORY; it takes nothing, and freeing
    makes room again."""
    small = '{"memory_size": 1048576, "page_shift": 16}'
    peer = peer_factory("peer", "solo", "PROMPT", PROMPT_ID,
                        base_config("shm", mem_pool_cfg=small, host_mem_pool_cfg=small))
    quarter = Desc(2, (4, 64, 512), "int8")  # 2 tensors of 128 KiB: a quarter of the pool
    assert quarter.tensor_bytes * quarter.num_tensors == 256 * 1024
    with expect_llm(S.LLM_OUT_OF_MEMORY, S.LLM_DEVICE_OUT_OF_MEMORY):
        peer.alloc("huge", Desc(2, (2, 1024, 1024), "int8"))
    with expect_llm(S.LLM_OUT_OF_MEMORY):
        peer.alloc("huge_host", Desc(2, (2, 1024, 1024), "int8", "HOST"))
    # At least three quarters fit (the failed requests took nothing); a fifth cannot.
    allocated = 0
    with expect_llm(S.LLM_OUT_OF_MEMORY, S.LLM_DEVICE_OUT_OF_MEMORY):
        while allocated < 5:
            peer.alloc(f"q{allocated}", quarter, blocks=True)
            allocated += 1
    assert allocated >= 3, f"only {allocated} quarter-pool caches fit in an empty pool"
    peer.call("free", "q1")
    peer.alloc("again", quarter, blocks=True)


def test_calls_after_finalize(peer_factory: Any) -> None:
    """After finalize (idempotent): LLM_ENGINE_FINALIZED for cache manager and link calls."""
    peer = peer_factory("peer", "solo", "DECODER", DECODER_ID, base_config("shm"))
    peer.alloc("a", BLOCKS, blocks=True)
    peer.call("finalize")
    peer.call("finalize")
    with expect_llm(S.LLM_ENGINE_FINALIZED):
        peer.alloc("b", BLOCKS, blocks=True)
    with expect_llm(S.LLM_ENGINE_FINALIZED):
        peer.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("a"), [0], [0])
    with expect_llm(S.LLM_ENGINE_FINALIZED):
        peer.cm("get_cache_tensors", Ref("a"))
    with expect_llm(S.LLM_ENGINE_FINALIZED):
        peer.call("link", [(PROMPT_ID, "127.0.0.1", free_port())], 1000)


def test_call_before_init(peer_factory: Any) -> None:
    """A call before init raises LLMException."""
    peer = peer_factory("peer", "solo", "DECODER", DECODER_ID, base_config("shm"), init=False)
    peer.call("construct")
    with expect_exc("LLMException"):
        peer.alloc("a", BLOCKS, blocks=True)


def test_second_engine_in_one_process(peer_factory: Any) -> None:
    """A second engine's init in a process with an initialized engine: LLM_FAILED; the
    first engine keeps working."""
    peer = peer_factory("peer", "solo", "PROMPT", PROMPT_ID, base_config("shm"))
    with expect_llm(S.LLM_FAILED):
        peer.call("second_engine", "DECODER", DECODER_ID, base_config("shm"))
    peer.alloc("a", BLOCKS, blocks=True)
    data = peer.fill("a", BLOCKS, 13)
    np.testing.assert_array_equal(peer.read("a"), data)


# ------------------------------------------------------------------ deadlines, peer death


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stalled_peer_times_out(peer_factory: Any, transport: str) -> None:
    """A frozen prompt (SIGSTOP): the decoder's pull of a key it has not used raises
    LLM_TIMEOUT within sync_kv_timeout + 1 s, and the link is then marked broken."""
    pair_ = peer_factory("pair", transport)
    p, d = pair_.peers()
    p.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 4))
    d.alloc("dst", BLOCKS, blocks=True)
    dst0 = d.fill("dst", BLOCKS, 14)
    p.stop()
    out = d.call("timed_cm", "pull_blocks", (blocks_key(PROMPT_ID, 4), Ref("dst"), [0], [1]), {},
                 timeout=SYNC_KV_TIMEOUT_MS / 1000 + 10)
    limit = SYNC_KV_TIMEOUT_MS / 1000
    assert out["error"] is not None, "pull from a frozen peer succeeded"
    assert out["status_code"] == S.LLM_TIMEOUT, out
    assert limit * 0.5 <= out["elapsed"] <= limit + 1.0, out
    p.cont()
    np.testing.assert_array_equal(d.read("dst"), dst0)
    with expect_exc("LLMException"):
        d.cm("pull_blocks", blocks_key(PROMPT_ID, 4), Ref("dst"), [0], [1])


def _push_until_error(p: Peer, d: Peer) -> Dict[str, Any]:
    """Kill the decoder while the prompt pushes in a loop; return the loop's report."""
    loop = p.start_call("loop", "push_blocks",
                        (blocks_key(DECODER_ID, 1), Ref("src"), list(range(16)), list(range(16))),
                        {}, SYNC_KV_TIMEOUT_MS / 1000 + 8)
    assert loop.note() == "running"
    t_kill = d.kill()
    out = loop.result(timeout=SYNC_KV_TIMEOUT_MS / 1000 + 15)
    out["after_kill"] = out["t_error"] - t_kill if out["t_error"] is not None else None
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decoder_killed_during_push_loop(peer_factory: Any, transport: str) -> None:
    """SIGKILL of the decoder while the prompt pushes: the prompt gets an LLMException
    within sync_kv_timeout + 1 s; a restarted decoder links again and receives data."""
    big = Desc(8, (16, 64, 256), "fp16")  # 512 KiB per tensor, 4 MiB per push
    pair_ = peer_factory("pair", transport)
    p, d = pair_.peers()
    p.alloc("src", big, blocks=True)
    data = p.fill("src", big, 15)
    d.alloc("dst", big, blocks=True, bkey=blocks_key(DECODER_ID, 1))
    out = _push_until_error(p, d)
    assert out["error"] is not None, f"no error after the decoder died: {out}"
    assert "LLMException" in out["bases"], out
    assert 0 <= out["after_kill"] <= SYNC_KV_TIMEOUT_MS / 1000 + 1.0, out

    again = peer_factory("peer", "decoder2", "DECODER", DECODER_ID, base_config(transport))
    again.wait_ready()
    again.link(p)
    again.alloc("dst", big, blocks=True, bkey=blocks_key(DECODER_ID, 1))
    dst0 = again.fill("dst", big, 16)
    p.cm("push_blocks", blocks_key(DECODER_ID, 1), Ref("src"), [1, 2], [3, 4])
    np.testing.assert_array_equal(again.read("dst"),
                                  expect_blocks(dst0, data, [1, 2], [3, 4], big.row_bytes))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prompt_killed_during_pull_loop(peer_factory: Any, transport: str) -> None:
    """SIGKILL of the prompt while the decoder pulls: LLMException within sync_kv_timeout
    + 1 s; a prompt restarted elsewhere under the same cluster id can be linked again."""
    big = Desc(8, (16, 64, 256), "fp16")
    pair_ = peer_factory("pair", transport)
    p, d = pair_.peers()
    p.alloc("src", big, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    d.alloc("dst", big, blocks=True)
    loop = d.start_call("loop", "pull_blocks",
                        (blocks_key(PROMPT_ID, 1), Ref("dst"), list(range(16)), list(range(16))),
                        {}, SYNC_KV_TIMEOUT_MS / 1000 + 8)
    assert loop.note() == "running"
    t_kill = p.kill()
    out = loop.result(timeout=SYNC_KV_TIMEOUT_MS / 1000 + 15)
    assert out["error"] is not None, f"no error after the prompt died: {out}"
    assert "LLMException" in out["bases"], out
    assert 0 <= out["t_error"] - t_kill <= SYNC_KV_TIMEOUT_MS / 1000 + 1.0, out

    port = free_port()
    again = peer_factory("peer", "prompt2", "PROMPT", PROMPT_ID,
                         base_config(transport, listen_port=port))
    again.wait_ready()
    d.link(again)
    again.alloc("src", big, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    data = again.fill("src", big, 17)
    dst0 = d.read("dst")
    d.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [7], [0])
    np.testing.assert_array_equal(d.read("dst"),
                                  expect_blocks(dst0, data, [7], [0], big.row_bytes))


def test_peer_error_carries_remote_traceback(pair: Pair) -> None:
    """The harness surfaces a child's traceback (guards the diagnostics of this suite)."""
    with pytest.raises(PeerError) as info:
        pair.decoder.cm("no_such_method")
    assert "AttributeError" in info.value.exc_type
    assert "Traceback" in info.value.remote_traceback
    started = time.monotonic()
    assert pair.decoder.call("ping") == pair.decoder.pid
    assert time.monotonic() - started < 5
