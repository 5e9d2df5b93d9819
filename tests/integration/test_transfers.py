"""Transfers between two engine processes, checked byte for byte (SPEC sections 4, 5 and 6).

A prompt engine (server) and a decoder engine (client, linked to it) run for the whole
module, once per transport.  Each test allocates or registers its caches, fills them with
seeded random bytes, transfers, reads the destination back and compares it with what a
plain numpy model of the contract says it must hold: targeted blocks/rows carry the source
bytes, everything else keeps its previous bytes.  Caches are freed after every test.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import (DECODER_ID, PROMPT_ID, TRANSPORTS, Desc, Pair, Peer, Ref, blocks_key,
                     cache_key, expect_blocks, expect_row_to_blocks, expect_rows, id_key)

pytestmark = pytest.mark.timeout(60)

#: 8 tensors (4 layers of K,V) of 8 blocks x 16 tokens x 64 elements.
BLOCKS = Desc(8, (8, 16, 64), "fp16")
#: 8 tensors of 4 rows x 64 tokens x 64 elements: one row is 4 blocks of BLOCKS.
ROWS = Desc(8, (4, 64, 64), "fp16")


def _setup(peer: Peer, name: str, desc: Desc, kind: str, seed: int, **kwargs: Any
           ) -> Tuple[Dict[str, Any], np.ndarray]:
    """Allocate (kind "alloc") or register (kind "reg") a cache and fill it."""
    made = (peer.alloc if kind == "alloc" else peer.register)(name, desc, **kwargs)
    return made, peer.fill(name, desc, seed)


# ------------------------------------------------------------------------- blocks


LAYER_CASES = [
    # (tensor_num_per_layer, src layers, dst layers) over 8 tensors
    (1, range(2, 6), range(4, 8)),
    (2, range(0, 2), range(2, 4)),
    (4, range(1, 2), range(0, 1)),
]


@pytest.mark.parametrize("n,src_layers,dst_layers", LAYER_CASES)
def test_pull_blocks_layer_ranges(pair: Pair, n: int, src_layers: range, dst_layers: range
                                  ) -> None:
    """Source and destination layer ranges may differ for a pull; other layers stay."""
    _setup(pair.prompt, "src", BLOCKS, "alloc", 1, blocks=True, bkey=blocks_key(PROMPT_ID, 7))
    _, dst0 = _setup(pair.decoder, "dst", BLOCKS, "alloc", 2, blocks=True)
    src = pair.prompt.read("src")
    src_blocks, dst_blocks = [1, 2, 3, 6], [0, 5, 6, 7]
    pair.decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 7), Ref("dst"), src_blocks,
                    dst_blocks, src_layer_range=src_layers, dst_layer_range=dst_layers,
                    tensor_num_per_layer=n)
    want = expect_blocks(dst0, src, src_blocks, dst_blocks, BLOCKS.row_bytes,
                         src_layers=src_layers, dst_layers=dst_layers, n=n)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)
    np.testing.assert_array_equal(pair.prompt.read("src"), src)


@pytest.mark.parametrize("n,src_layers", [case[:2] for case in LAYER_CASES])
@pytest.mark.parametrize("by_id", [False, True], ids=["blocks_key", "id_key"])
def test_push_blocks_layer_ranges(pair: Pair, n: int, src_layers: range, by_id: bool) -> None:
    """A push uses the same layer range on both sides, into the decoder's blocks cache."""
    _setup(pair.prompt, "src", BLOCKS, "alloc", 3, blocks=True)
    made, dst0 = _setup(pair.decoder, "dst", BLOCKS, "alloc", 4, blocks=True,
                        bkey=blocks_key(DECODER_ID, 2))
    src = pair.prompt.read("src")
    key = id_key(DECODER_ID, made["cache_id"]) if by_id else blocks_key(DECODER_ID, 2)
    src_blocks, dst_blocks = [0, 1, 2, 3], [4, 5, 6, 7]
    pair.prompt.cm("push_blocks", key, Ref("src"), src_blocks, dst_blocks,
                   src_layer_range=src_layers, dst_layer_range=src_layers,
                   tensor_num_per_layer=n)
    want = expect_blocks(dst0, src, src_blocks, dst_blocks, BLOCKS.row_bytes,
                         src_layers=src_layers, dst_layers=src_layers, n=n)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


BLOCK_ORDERS = {
    "reversed": ([0, 1, 2, 3], [3, 2, 1, 0]),
    "scattered": ([5, 0, 7, 2, 3], [1, 6, 3, 4, 0]),
    "ascending": ([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]),
    "one": ([7], [0]),
    "partly_coalescing": ([2, 3, 4, 0, 1], [5, 6, 7, 1, 2]),
    # one block into every destination: as many bytes as the source cache holds, all of one run
    "one_into_all": ([3] * 8, [0, 1, 2, 3, 4, 5, 6, 7]),
}


@pytest.mark.parametrize("order", sorted(BLOCK_ORDERS))
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_block_orders(pair: Pair, order: str, direction: str) -> None:
    """Every ``src_blocks[i] -> dst_blocks[i]`` pairing is honoured, coalescible or not."""
    src_blocks, dst_blocks = BLOCK_ORDERS[order]
    _setup(pair.prompt, "src", BLOCKS, "alloc", 5, blocks=True, bkey=blocks_key(PROMPT_ID))
    _, dst0 = _setup(pair.decoder, "dst", BLOCKS, "alloc", 6, blocks=True,
                     bkey=blocks_key(DECODER_ID))
    src = pair.prompt.read("src")
    if direction == "pull":
        pair.decoder.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), src_blocks, dst_blocks)
    else:
        pair.prompt.cm("push_blocks", blocks_key(DECODER_ID), Ref("src"), src_blocks, dst_blocks)
    want = expect_blocks(dst0, src, src_blocks, dst_blocks, BLOCKS.row_bytes)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


MEMORY_CASES = [
    # (dtype, source kind, destination kind, destination placement)
    ("fp16", "alloc", "alloc", "DEVICE"),
    ("bf16", "reg", "alloc", "HOST"),
    ("int8", "alloc", "reg", "DEVICE"),
    ("bf16", "reg", "reg", "HOST"),
    ("int8", "reg", "alloc", "DEVICE"),
    ("fp16", "alloc", "reg", "HOST"),
]


@pytest.mark.parametrize("dtype,src_kind,dst_kind,placement", MEMORY_CASES)
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_blocks_memory_kinds(pair: Pair, dtype: str, src_kind: str, dst_kind: str,
                             placement: str, direction: str) -> None:
    """Allocated and registered (user tensor) caches on either side, in several dtypes."""
    src_desc = Desc(6, (8, 8, 32), dtype, "HOST" if placement == "DEVICE" else "DEVICE")
    dst_desc = Desc(6, (8, 8, 32), dtype, placement)
    src_peer, dst_peer = pair.prompt, pair.decoder
    owner = PROMPT_ID if direction == "pull" else DECODER_ID
    src_made, _ = _setup(src_peer, "src", src_desc, src_kind, 11, blocks=True,
                         bkey=blocks_key(PROMPT_ID, 5) if direction == "pull" else None)
    dst_made, dst0 = _setup(dst_peer, "dst", dst_desc, dst_kind, 12, blocks=True,
                            bkey=blocks_key(DECODER_ID, 5) if direction == "push" else None)
    src = src_peer.read("src")
    src_blocks, dst_blocks = [6, 1, 2, 3], [0, 4, 5, 6]
    if direction == "pull":
        key = id_key(owner, src_made["cache_id"]) if src_kind == "reg" else blocks_key(owner, 5)
        pair.decoder.cm("pull_blocks", key, Ref("dst"), src_blocks, dst_blocks,
                        src_layer_range=range(1, 3), dst_layer_range=range(0, 2))
        want = expect_blocks(dst0, src, src_blocks, dst_blocks, dst_desc.row_bytes,
                             src_layers=range(1, 3), dst_layers=range(0, 2))
    else:
        key = id_key(owner, dst_made["cache_id"]) if dst_kind == "reg" else blocks_key(owner, 5)
        pair.prompt.cm("push_blocks", key, Ref("src"), src_blocks, dst_blocks)
        want = expect_blocks(dst0, src, src_blocks, dst_blocks, dst_desc.row_bytes)
    got = dst_peer.read("dst")
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, dst0), "nothing arrived"


def test_large_scattered_blocks(pair: Pair) -> None:
    """4 MiB caches, a shuffled block mapping both ways: socket streams span many runs."""
    desc = Desc(4, (64, 64, 128), "bf16")  # 16 KiB blocks, 1 MiB tensors
    _setup(pair.prompt, "src", desc, "alloc", 21, blocks=True, bkey=blocks_key(PROMPT_ID, 9))
    _, dst0 = _setup(pair.decoder, "dst", desc, "alloc", 22, blocks=True,
                     bkey=blocks_key(DECODER_ID, 9))
    src = pair.prompt.read("src")
    perm = np.random.default_rng(23).permutation(64).tolist()
    src_blocks, dst_blocks = list(range(0, 64, 2)) + list(range(1, 64, 2)), perm
    pair.decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 9), Ref("dst"), src_blocks, dst_blocks)
    pulled = expect_blocks(dst0, src, src_blocks, dst_blocks, desc.row_bytes)
    np.testing.assert_array_equal(pair.decoder.read("dst"), pulled)

    fresh = pair.prompt.fill("src", desc, 24)
    pair.prompt.cm("push_blocks", blocks_key(DECODER_ID, 9), Ref("src"), perm[:40],
                   list(range(40)))
    pushed = expect_blocks(pulled, fresh, perm[:40], list(range(40)), desc.row_bytes)
    np.testing.assert_array_equal(pair.decoder.read("dst"), pushed)


@pytest.mark.parametrize("kind", ["alloc", "reg"])
def test_more_runs_than_one_system_call(pair: Pair, kind: str) -> None:
    """3000 uncoalescible runs (above IOV_MAX, 1024): every executor splits the plan into
    several system calls (writev/readv, process_vm_writev/readv) and loses no run."""
    desc = Desc(2, (1500, 16, 16), "int8")  # 256-byte blocks
    made = _setup(pair.prompt, "src", desc, kind, 31, blocks=True, bkey=blocks_key(PROMPT_ID, 11))[0]
    dst_made, dst0 = _setup(pair.decoder, "dst", desc, kind, 32, blocks=True, bkey=blocks_key(DECODER_ID, 11))
    src = pair.prompt.read("src")
    perm = np.random.default_rng(33).permutation(1500).tolist()
    key = id_key(PROMPT_ID, made["cache_id"]) if kind == "reg" else blocks_key(PROMPT_ID, 11)
    pair.decoder.cm("pull_blocks", key, Ref("dst"), list(range(1500)), perm)
    pulled = expect_blocks(dst0, src, list(range(1500)), perm, desc.row_bytes)
    np.testing.assert_array_equal(pair.decoder.read("dst"), pulled)
    fresh = pair.prompt.fill("src", desc, 34)
    dst_key = id_key(DECODER_ID, dst_made["cache_id"]) if kind == "reg" else blocks_key(DECODER_ID, 11)
    pair.prompt.cm("push_blocks", dst_key, Ref("src"), perm, list(range(1500)))
    np.testing.assert_array_equal(pair.decoder.read("dst"),
                                  expect_blocks(pulled, fresh, perm, list(range(1500)), desc.row_bytes))


# ------------------------------------------------------------------ rows -> blocks


@pytest.mark.parametrize("by_id", [False, True], ids=["cache_key", "id_key"])
@pytest.mark.parametrize("src_kind", ["alloc", "reg"])
def test_row_to_blocks(pair: Pair, by_id: bool, src_kind: str) -> None:
    """pull_blocks from a contiguous row with src_blocks=(): chunk i -> dst_blocks[i]."""
    keys = [cache_key(PROMPT_ID, 100 + i) for i in range(ROWS.shape[0])]
    made, _ = _setup(pair.prompt, "rows", ROWS, src_kind, 31, keys=keys)
    _, dst0 = _setup(pair.decoder, "dst", BLOCKS, "alloc", 32, blocks=True)
    src = pair.prompt.read("rows")
    dst_blocks = [6, 1, 3, 0]
    assert ROWS.row_bytes == len(dst_blocks) * BLOCKS.row_bytes
    if by_id:
        key, row = id_key(PROMPT_ID, made["cache_id"], 3), 3
        layers: Dict[str, Any] = {"src_layer_range": range(2, 4), "dst_layer_range": range(0, 2)}
    else:
        key, row = cache_key(PROMPT_ID, 102), 2
        layers = {}
    pair.decoder.cm("pull_blocks", key, Ref("dst"), (), dst_blocks, **layers)
    want = expect_row_to_blocks(dst0, src, row, ROWS.row_bytes, dst_blocks, BLOCKS.row_bytes,
                                src_layers=layers.get("src_layer_range"),
                                dst_layers=layers.get("dst_layer_range"))
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


# ------------------------------------------------------------------- pull_cache


@pytest.mark.parametrize("size_part", [1, 2], ids=["full_row", "half_row"])
@pytest.mark.parametrize("dst_kind", ["alloc", "reg"])
def test_pull_cache_by_cache_key(pair: Pair, size_part: int, dst_kind: str) -> None:
    """Source row = the key's position in cache_keys, destination row = batch_index."""
    keys = [cache_key(PROMPT_ID, 200 + i) for i in range(ROWS.shape[0])]
    _setup(pair.prompt, "rows", ROWS, "alloc", 41, keys=keys)
    dst_desc = Desc(8, (3, 64, 64), "fp16", "HOST")
    _, dst0 = _setup(pair.decoder, "dst", dst_desc, dst_kind, 42)
    src = pair.prompt.read("rows")
    size = -1 if size_part == 1 else ROWS.row_bytes // 2
    pair.decoder.cm("pull_cache", cache_key(PROMPT_ID, 201), Ref("dst"), 2, size)
    want = expect_rows(dst0, src, 1, 2, ROWS.row_bytes, size=size)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


@pytest.mark.parametrize("n,src_layers,dst_layers", LAYER_CASES)
def test_pull_cache_by_id_and_layers(pair: Pair, n: int, src_layers: range, dst_layers: range
                                     ) -> None:
    """CacheKeyByIdAndIndex picks the source row; layer ranges may differ in a pull."""
    made, _ = _setup(pair.prompt, "rows", ROWS, "reg", 43)
    _, dst0 = _setup(pair.decoder, "dst", ROWS, "alloc", 44)
    src = pair.prompt.read("rows")
    pair.decoder.cm("pull_cache", id_key(PROMPT_ID, made["cache_id"], 3), Ref("dst"), 0,
                    src_layer_range=src_layers, dst_layer_range=dst_layers,
                    tensor_num_per_layer=n)
    want = expect_rows(dst0, src, 3, 0, ROWS.row_bytes, src_layers=src_layers,
                       dst_layers=dst_layers, n=n)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)
    # An id key is not consumed: the same row can be pulled again, into another row.
    pair.decoder.cm("pull_cache", id_key(PROMPT_ID, made["cache_id"], 3), Ref("dst"), 1)
    want = expect_rows(want, src, 3, 1, ROWS.row_bytes)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


# ------------------------------------------------------------------- push_cache


@pytest.mark.parametrize("dst_kind", ["alloc", "reg"])
@pytest.mark.parametrize("layers", [None, range(1, 3)], ids=["all_layers", "layers_1_3"])
def test_push_cache_by_id(pair: Pair, dst_kind: str, layers: Optional[range]) -> None:
    """push_cache of source row src_batch_index into the key's row of the decoder."""
    _setup(pair.prompt, "rows", ROWS, "alloc", 51)
    made, dst0 = _setup(pair.decoder, "dst", ROWS, dst_kind, 52)
    src = pair.prompt.read("rows")
    pair.prompt.cm("push_cache", id_key(DECODER_ID, made["cache_id"], 1), Ref("rows"), 3,
                   layers, layers)
    want = expect_rows(dst0, src, 3, 1, ROWS.row_bytes, src_layers=layers, dst_layers=layers)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


def test_push_cache_by_cache_key(pair: Pair) -> None:
    """push_cache into an allocated decoder cache addressed by one of its CacheKeys."""
    keys = [cache_key(DECODER_ID, 300 + i) for i in range(ROWS.shape[0])]
    _setup(pair.prompt, "rows", ROWS, "reg", 53)
    _, dst0 = _setup(pair.decoder, "dst", ROWS, "alloc", 54, keys=keys)
    src = pair.prompt.read("rows")
    pair.prompt.cm("push_cache", cache_key(DECODER_ID, 302), Ref("rows"), src_batch_index=0,
                   tensor_num_per_layer=1, src_layer_range=range(5, 8),
                   dst_layer_range=range(5, 8))
    want = expect_rows(dst0, src, 0, 2, ROWS.row_bytes, src_layers=range(5, 8),
                       dst_layers=range(5, 8), n=1)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


def test_both_directions_share_one_link(pair: Pair) -> None:
    """After the decoder linked, the prompt pushes and the decoder pulls, interleaved."""
    _setup(pair.prompt, "src", BLOCKS, "alloc", 61, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    _, dst0 = _setup(pair.decoder, "dst", BLOCKS, "alloc", 62, blocks=True,
                     bkey=blocks_key(DECODER_ID, 1))
    src = pair.prompt.read("src")
    want = dst0
    for i in range(4):
        if i % 2:
            pair.prompt.cm("push_blocks", blocks_key(DECODER_ID, 1), Ref("src"), [i], [7 - i])
        else:
            pair.decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [i], [7 - i])
        want = expect_blocks(want, src, [i], [7 - i], BLOCKS.row_bytes)
    np.testing.assert_array_equal(pair.decoder.read("dst"), want)


def test_tensor_num_per_layer_without_ranges(pair: Pair) -> None:
    """Without layer ranges N need not divide num_tensors: every tensor moves."""
    _setup(pair.prompt, "src", BLOCKS, "alloc", 71, blocks=True, bkey=blocks_key(PROMPT_ID, 8))
    _, dst0 = _setup(pair.decoder, "dst", BLOCKS, "alloc", 72, blocks=True)
    src = pair.prompt.read("src")
    pair.decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 8), Ref("dst"), [2, 3], [0, 1],
                    tensor_num_per_layer=3)
    np.testing.assert_array_equal(pair.decoder.read("dst"),
                                  expect_blocks(dst0, src, [2, 3], [0, 1], BLOCKS.row_bytes))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_same_host_path_is_one_sided(peer_factory: Any, transport: str) -> None:
    """SPEC section 6: on one host, shm copies out of the peer's memory with no peer thread
    involved (pool memory and registered memory alike), so a pull from a frozen prompt of a
    key already used succeeds; over tcp the prompt's agent serves the bytes, so the same
    pull runs into sync_kv_timeout."""
    pair_ = peer_factory("pair", transport)
    p, d = pair_.peers()
    p.alloc("pool", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 6))
    made = p.register("user", BLOCKS, blocks=True)
    pool, user = p.fill("pool", BLOCKS, 81), p.fill("user", BLOCKS, 82)
    d.alloc("dst", BLOCKS, blocks=True)
    dst = d.fill("dst", BLOCKS, 83)
    keys = [blocks_key(PROMPT_ID, 6), id_key(PROMPT_ID, made["cache_id"])]
    for key, src, block in zip(keys, (pool, user), (0, 1)):
        d.cm("pull_blocks", key, Ref("dst"), [block], [block])
        dst = expect_blocks(dst, src, [block], [block], BLOCKS.row_bytes)
    p.stop()
    try:
        for key, src, block in zip(keys, (pool, user), (2, 3)):
            out = d.call("timed_cm", "pull_blocks", (key, Ref("dst"), [block], [block + 4]), {})
            if transport == "shm":
                assert out["error"] is None, out
                dst = expect_blocks(dst, src, [block], [block + 4], BLOCKS.row_bytes)
            else:
                assert out["status_code"] == S.LLM_TIMEOUT, out
                break
    finally:
        p.cont()
    np.testing.assert_array_equal(d.read("dst"), dst)
