"""Prepared transfers (``prepare_push_blocks`` / ``prepare_pull_blocks``) and the handles
the plain ``push_blocks`` / ``pull_blocks`` calls keep per call shape, between two engine
processes on every transport, checked byte for byte.

What a kept plan must never do: write into a cache the peer has since replaced, read a
local cache that was freed, or outlive the link it was made on.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import DECODER_ID, PROMPT_ID, Desc, Pair, Ref, blocks_key, expect_blocks, expect_exc, expect_llm, id_key

pytestmark = pytest.mark.timeout(90)

#: 8 tensors (4 layers of K,V) of 8 blocks of 2 KiB.
BLOCKS = Desc(8, (8, 16, 64), "fp16")


def _caches(pair: Pair, src_seed: int, dst_seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    pair.prompt.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 3))
    src = pair.prompt.fill("src", BLOCKS, src_seed)
    made = pair.decoder.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 3))
    dst = pair.decoder.fill("dst", BLOCKS, dst_seed)
    return src, dst, made


def test_a_push_handle_moves_each_block_list_it_is_given(pair: Pair) -> None:
    src, dst, _ = _caches(pair, 1, 2)
    layers = range(1, 3)
    pair.prompt.call("prepare", "h", "prepare_push_blocks", [blocks_key(DECODER_ID, 3), Ref("src")],
                     {"src_layer_range": layers, "dst_layer_range": layers})
    for src_blocks, dst_blocks in (([0, 1], [5, 6]), ([7], [0]), ([0, 1], [5, 6]), ([2, 3, 4], [1, 3, 2])):
        pair.prompt.call("run", "h", src_blocks, dst_blocks)
        dst = expect_blocks(dst, src, src_blocks, dst_blocks, BLOCKS.row_bytes, src_layers=layers,
                            dst_layers=layers)
        np.testing.assert_array_equal(pair.decoder.read("dst"), dst)


def test_a_pull_handle_prepared_with_blocks_runs_them_again(pair: Pair) -> None:
    src, dst, _ = _caches(pair, 3, 4)
    pair.decoder.call("prepare", "h", "prepare_pull_blocks", [blocks_key(PROMPT_ID, 3), Ref("dst"), [6, 2], [0, 7]],
                      {})
    np.testing.assert_array_equal(pair.decoder.read("dst"), dst)  # preparing moves nothing
    pair.decoder.call("run", "h")
    np.testing.assert_array_equal(pair.decoder.read("dst"), expect_blocks(dst, src, [6, 2], [0, 7], BLOCKS.row_bytes))
    src = pair.prompt.fill("src", BLOCKS, 5)  # new source bytes, same plan
    pair.decoder.call("run", "h")
    np.testing.assert_array_equal(pair.decoder.read("dst"), expect_blocks(dst, src, [6, 2], [0, 7], BLOCKS.row_bytes))


@pytest.mark.parametrize("by_id", [False, True], ids=["blocks_key", "id_key"])
def test_a_repeated_push_never_writes_into_a_replaced_cache(pair: Pair, by_id: bool) -> None:
    """The same push_blocks call shape, again after the peer freed its cache and
    allocated another under the same key: the bytes land in the new cache."""
    src, dst, made = _caches(pair, 6, 7)
    key = id_key(DECODER_ID, made["cache_id"]) if by_id else blocks_key(DECODER_ID, 3)
    for _ in range(3):
        pair.prompt.cm("push_blocks", key, Ref("src"), [1, 2], [3, 4])
    np.testing.assert_array_equal(pair.decoder.read("dst"), expect_blocks(dst, src, [1, 2], [3, 4], BLOCKS.row_bytes))
    pair.decoder.call("free", "dst")
    made = pair.decoder.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 3))
    dst = pair.decoder.fill("dst", BLOCKS, 8)
    if by_id:  # the old id names nothing now
        with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
            pair.prompt.cm("push_blocks", key, Ref("src"), [1, 2], [3, 4])
        key = id_key(DECODER_ID, made["cache_id"])
    pair.prompt.cm("push_blocks", key, Ref("src"), [1, 2], [3, 4])
    np.testing.assert_array_equal(pair.decoder.read("dst"), expect_blocks(dst, src, [1, 2], [3, 4], BLOCKS.row_bytes))


def test_a_freed_local_cache_is_not_read_again(pair: Pair) -> None:
    _caches(pair, 9, 10)
    pair.prompt.call("prepare", "h", "prepare_push_blocks", [blocks_key(DECODER_ID, 3), Ref("src"), [0], [0]], {})
    pair.prompt.cm("push_blocks", blocks_key(DECODER_ID, 3), Ref("src"), [0], [1])
    before = pair.decoder.read("dst")
    pair.prompt.call("free", "src")
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        pair.prompt.call("run", "h")
    np.testing.assert_array_equal(pair.decoder.read("dst"), before)


def test_a_released_handle_moves_nothing_more(pair: Pair) -> None:
    src, dst, _ = _caches(pair, 13, 14)
    pair.prompt.call("prepare", "h", "prepare_push_blocks", [blocks_key(DECODER_ID, 3), Ref("src"), [4], [2]], {})
    pair.prompt.call("run", "h")
    dst = expect_blocks(dst, src, [4], [2], BLOCKS.row_bytes)
    pair.prompt.call("release", "h")
    pair.prompt.call("release", "h")  # idempotent
    pair.prompt.fill("src", BLOCKS, 15)
    for args in ((), ([4], [2]), ([5], [3])):
        with expect_llm(S.LLM_PARAM_INVALID):
            pair.prompt.call("run", "h", *args)
    with expect_llm(S.LLM_PARAM_INVALID):
        pair.prompt.call("run_batch", "h", [([4], [2])])
    np.testing.assert_array_equal(pair.decoder.read("dst"), dst)


def test_a_kept_call_shape_still_checks_its_arguments(pair: Pair) -> None:
    """After ``[1]`` ran, ``[1.0]`` and ``[True]`` are still refused, and an index out of
    range still is too."""
    _caches(pair, 11, 12)
    key = blocks_key(DECODER_ID, 3)
    pair.prompt.cm("push_blocks", key, Ref("src"), [1], [1])
    before = pair.decoder.read("dst")
    with expect_exc("TypeError"):
        pair.prompt.cm("push_blocks", key, Ref("src"), [1.0], [1])
    with expect_exc("TypeError"):
        pair.prompt.cm("push_blocks", key, Ref("src"), [True], [1])
    with expect_llm(S.LLM_PARAM_INVALID):
        pair.prompt.cm("push_blocks", key, Ref("src"), [1], [8])
    with expect_llm(S.LLM_PARAM_INVALID):
        pair.prompt.cm("push_blocks", key, Ref("src"), [1], [])
    np.testing.assert_array_equal(pair.decoder.read("dst"), before)


def test_handle_arguments_are_checked_when_prepared(pair: Pair) -> None:
    _caches(pair, 13, 14)
    key = blocks_key(DECODER_ID, 3)
    with expect_exc("TypeError"):
        pair.prompt.call("prepare", "h", "prepare_push_blocks", [blocks_key(DECODER_ID, 3).args, Ref("src")], {})
    with expect_llm(S.LLM_PARAM_INVALID):  # a push needs the same layer range on both sides
        pair.prompt.call("prepare", "h", "prepare_push_blocks", [key, Ref("src"), [0], [0]],
                         {"src_layer_range": range(0, 1), "dst_layer_range": range(1, 2)})
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):  # the peer is asked when block lists are given
        pair.prompt.call("prepare", "h", "prepare_push_blocks", [blocks_key(DECODER_ID, 99), Ref("src"), [0], [0]],
                         {})
    with expect_exc("TypeError"):
        pair.prompt.call("prepare", "h", "prepare_push_blocks", [key, Ref("src"), [0]], {})
    pair.prompt.call("prepare", "h", "prepare_push_blocks", [key, Ref("src")], {})
    with expect_llm(S.LLM_PARAM_INVALID):  # nothing to run without block lists
        pair.prompt.call("run", "h")
    with expect_exc("TypeError"):
        pair.prompt.call("run", "h", [0])


def test_a_handle_follows_the_link_down_and_up_again(pair: Pair) -> None:
    src, dst, _ = _caches(pair, 15, 16)
    pair.prompt.call("prepare", "h", "prepare_push_blocks", [blocks_key(DECODER_ID, 3), Ref("src")], {})
    pair.prompt.call("run", "h", [3], [4])
    ret, _ = pair.decoder.call("unlink", [(PROMPT_ID, "127.0.0.1", pair.prompt.listen_port)], 3000)
    assert ret == 0
    try:
        with expect_llm(S.LLM_NOT_YET_LINK):
            pair.prompt.call("run", "h", [5], [6])
        with expect_llm(S.LLM_NOT_YET_LINK):
            pair.prompt.cm("push_blocks", blocks_key(DECODER_ID, 3), Ref("src"), [3], [4])
    finally:
        pair.decoder.link(pair.prompt)
    pair.prompt.call("run", "h", [5], [6])
    pair.prompt.cm("push_blocks", blocks_key(DECODER_ID, 3), Ref("src"), [3], [4])
    want = expect_blocks(dst, src, [3, 5], [4, 6], BLOCKS.row_bytes)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


def test_the_same_call_right_after_relinking_moves_over_the_new_link(pair: Pair) -> None:
    """The decoder unlinks and links again at once (what it does after its link broke),
    then repeats the very calls it made before: the plans kept for them belong to the old
    link and must not run (they once wrote to its closed socket, or copied through its
    unmapped arena)."""
    src, dst, _ = _caches(pair, 17, 18)
    key = blocks_key(PROMPT_ID, 3)
    pair.decoder.call("prepare", "h", "prepare_pull_blocks", [key, Ref("dst")], {})
    pair.decoder.cm("pull_blocks", key, Ref("dst"), [1, 2], [3, 4])
    pair.decoder.call("run", "h", [5], [6])
    for _ in range(2):
        ret, _ = pair.decoder.call("unlink", [(PROMPT_ID, "127.0.0.1", pair.prompt.listen_port)], 3000)
        assert ret == 0
        pair.decoder.link(pair.prompt)
        pair.decoder.cm("pull_blocks", key, Ref("dst"), [1, 2], [3, 4])
        pair.decoder.call("run", "h", [5], [6])
        pair.decoder.call("run_batch", "h", [([7], [0])])
    want = expect_blocks(dst, src, [1, 2, 5, 7], [3, 4, 6, 0], BLOCKS.row_bytes)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_batch_moves_every_pair(pair: Pair, direction: str) -> None:
    src, dst, _ = _caches(pair, 17, 18)
    pairs = [([0], [7]), ([1, 2], [5, 6]), ([3], [0]), ([0], [7])]
    if direction == "push":
        pair.prompt.call("prepare", "h", "prepare_push_blocks", [blocks_key(DECODER_ID, 3), Ref("src")], {})
        for _ in range(2):  # the second time from the plans kept
            pair.prompt.call("run_batch", "h", pairs)
    else:
        pair.decoder.call("prepare", "h", "prepare_pull_blocks", [blocks_key(PROMPT_ID, 3), Ref("dst")], {})
        pair.decoder.call("run_batch", "h", pairs)
    want = expect_blocks(dst, src, [0, 1, 2, 3], [7, 5, 6, 0], BLOCKS.row_bytes)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


def test_a_batch_checks_every_pair_before_moving_any(pair: Pair) -> None:
    _caches(pair, 19, 20)
    before = pair.decoder.read("dst")
    pair.prompt.call("prepare", "h", "prepare_push_blocks", [blocks_key(DECODER_ID, 3), Ref("src")], {})
    with expect_llm(S.LLM_PARAM_INVALID):
        pair.prompt.call("run_batch", "h", [([0], [1]), ([1], [8])])  # block 8 is outside the 8 blocks
    with expect_llm(S.LLM_PARAM_INVALID):
        pair.prompt.call("run_batch", "h", [])
    with expect_exc("TypeError"):
        pair.prompt.call("run_batch", "h", [([0], [1], [2])])
    np.testing.assert_array_equal(pair.decoder.read("dst"), before)


def test_a_batch_after_the_peer_replaced_its_cache_writes_the_new_one(pair: Pair) -> None:
    src, _, _ = _caches(pair, 21, 22)
    pair.prompt.call("prepare", "h", "prepare_push_blocks", [blocks_key(DECODER_ID, 3), Ref("src")], {})
    pairs = [([4], [1]), ([5], [2])]
    pair.prompt.call("run_batch", "h", pairs)
    pair.decoder.call("free", "dst")
    pair.decoder.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 3))
    dst = pair.decoder.fill("dst", BLOCKS, 23)
    pair.prompt.call("run_batch", "h", pairs)
    np.testing.assert_array_equal(pair.decoder.read("dst"), expect_blocks(dst, src, [4, 5], [1, 2], BLOCKS.row_bytes))
