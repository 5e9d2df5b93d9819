"""Copies inside one engine process: copy_cache, copy_blocks, swap_blocks (SPEC section 5).

One engine process serves the whole module; each test allocates its caches, fills them with
seeded random bytes, runs the operation and compares every byte of the destination with a
numpy model: targeted rows/blocks carry the source bytes, the rest is untouched.
"""
from __future__ import annotations

from typing import Dict, Iterator, List

import numpy as np
import pytest

from harness import PROMPT_ID, Desc, Peer, Ref, base_config, expect_blocks, expect_rows

pytestmark = pytest.mark.timeout(60)

ROWS = Desc(4, (4, 32, 64), "fp16")
BLOCKS_DEV = Desc(4, (8, 16, 32), "bf16", "DEVICE")
BLOCKS_HOST = Desc(4, (6, 16, 32), "bf16", "HOST")


@pytest.fixture(scope="module")
def _engine() -> Iterator[Peer]:
    peer = Peer("mix", "MIX", PROMPT_ID, base_config("shm"))
    try:
        peer.wait_ready()
        yield peer
    finally:
        peer.close()


@pytest.fixture
def engine(_engine: Peer) -> Iterator[Peer]:
    """The module's engine; caches are freed after each test."""
    yield _engine
    if _engine.alive:
        _engine.call("free_all")


# ------------------------------------------------------------------- copy_cache


@pytest.mark.parametrize("dst_placement", ["DEVICE", "HOST"])
@pytest.mark.parametrize("kind", ["alloc", "reg"])
def test_copy_cache_row(engine: Peer, dst_placement: str, kind: str) -> None:
    """copy_cache copies src row src_batch_index to dst row dst_batch_index, every tensor."""
    engine.alloc("src", ROWS)
    src = engine.fill("src", ROWS, 1)
    dst_desc = Desc(ROWS.num_tensors, ROWS.shape, ROWS.dtype, dst_placement)
    (engine.alloc if kind == "alloc" else engine.register)("dst", dst_desc)
    dst0 = engine.fill("dst", dst_desc, 2)
    engine.cm("copy_cache", Ref("dst"), Ref("src"), 3, 1)
    want = expect_rows(dst0, src, 1, 3, ROWS.row_bytes)
    np.testing.assert_array_equal(engine.read("dst"), want)
    np.testing.assert_array_equal(engine.read("src"), src)


def test_copy_cache_offset_and_size(engine: Peer) -> None:
    """offset/size (bytes per tensor) select a span inside the rows on both sides."""
    engine.alloc("src", ROWS)
    src = engine.fill("src", ROWS, 3)
    engine.alloc("dst", ROWS)
    dst0 = engine.fill("dst", ROWS, 4)
    offset, size = 256, 1024
    engine.cm("copy_cache", Ref("dst"), Ref("src"), dst_batch_index=0, src_batch_index=2,
              offset=offset, size=size)
    want = dst0.copy()
    rb = ROWS.row_bytes
    want[:, offset:offset + size] = src[:, 2 * rb + offset:2 * rb + offset + size]
    np.testing.assert_array_equal(engine.read("dst"), want)


def test_copy_cache_whole(engine: Peer) -> None:
    """Default arguments copy row 0 in full."""
    engine.alloc("src", ROWS)
    src = engine.fill("src", ROWS, 5)
    engine.register("dst", ROWS)
    dst0 = engine.fill("dst", ROWS, 6)
    engine.cm("copy_cache", Ref("dst"), Ref("src"))
    np.testing.assert_array_equal(engine.read("dst"), expect_rows(dst0, src, 0, 0, ROWS.row_bytes))


# ------------------------------------------------------------------ copy_blocks


@pytest.mark.parametrize("kind", ["alloc", "reg"])
def test_copy_blocks_fan_out(engine: Peer, kind: str) -> None:
    """copy_blocks: {src: [dst, ...]} inside one blocks cache, every tensor."""
    (engine.alloc if kind == "alloc" else engine.register)("blk", BLOCKS_DEV, blocks=True)
    before = engine.fill("blk", BLOCKS_DEV, 7)
    info: Dict[int, List[int]] = {0: [5, 6], 3: [7], 1: [2]}
    engine.cm("copy_blocks", Ref("blk"), info)
    want = before.copy()
    bb = BLOCKS_DEV.row_bytes
    for s, dsts in info.items():
        for d in dsts:
            want[:, d * bb:(d + 1) * bb] = before[:, s * bb:(s + 1) * bb]
    np.testing.assert_array_equal(engine.read("blk"), want)


# ------------------------------------------------------------------ swap_blocks


@pytest.mark.parametrize("direction", ["host_to_device", "device_to_host"])
def test_swap_blocks_with_cpu_cache(engine: Peer, direction: str) -> None:
    """swap_blocks between a DEVICE blocks cache and a Cache.create_cpu_cache host cache."""
    engine.alloc("dev", BLOCKS_DEV, blocks=True)
    engine.call("cpu_cache", "host", BLOCKS_HOST)
    dev = engine.fill("dev", BLOCKS_DEV, 8)
    host = engine.fill("host", BLOCKS_HOST, 9)
    if direction == "host_to_device":
        mapping = {0: 7, 5: 0, 2: 3}
        engine.cm("swap_blocks", Ref("host"), Ref("dev"), mapping)
        want = expect_blocks(dev, host, list(mapping), list(mapping.values()), BLOCKS_DEV.row_bytes)
        np.testing.assert_array_equal(engine.read("dev"), want)
        np.testing.assert_array_equal(engine.read("host"), host)
    else:
        mapping = {7: 0, 0: 5, 3: 2, 4: 4}
        engine.cm("swap_blocks", Ref("dev"), Ref("host"), mapping)
        want = expect_blocks(host, dev, list(mapping), list(mapping.values()), BLOCKS_DEV.row_bytes)
        np.testing.assert_array_equal(engine.read("host"), want)
        np.testing.assert_array_equal(engine.read("dev"), dev)


def test_swap_blocks_between_pool_caches(engine: Peer) -> None:
    """swap_blocks also moves blocks between a HOST-pool and a DEVICE-pool blocks cache."""
    engine.alloc("dev", BLOCKS_DEV, blocks=True)
    engine.alloc("host", BLOCKS_HOST, blocks=True)
    dev = engine.fill("dev", BLOCKS_DEV, 10)
    host = engine.fill("host", BLOCKS_HOST, 11)
    engine.cm("swap_blocks", Ref("dev"), Ref("host"), {1: 5, 2: 0})
    want = expect_blocks(host, dev, [1, 2], [5, 0], BLOCKS_DEV.row_bytes)
    np.testing.assert_array_equal(engine.read("host"), want)
    engine.cm("swap_blocks", Ref("host"), Ref("dev"), {5: 7})
    np.testing.assert_array_equal(engine.read("dev"),
                                  expect_blocks(dev, want, [5], [7], BLOCKS_DEV.row_bytes))


def test_cache_tensors_view_the_memory(engine: Peer) -> None:
    """get_cache_tensors returns per-tensor views at tensor_addrs with the desc's shape/dtype."""
    made = engine.alloc("blk", BLOCKS_DEV, blocks=True)
    info = engine.call("tensor_info", "blk")
    assert [t["ptr"] for t in info] == made["addrs"]
    assert all(t["shape"] == list(BLOCKS_DEV.shape) for t in info)
    assert all(t["dtype"] == "torch.bfloat16" for t in info)
    # Writes through the views are what a second read through fresh views returns.
    data = engine.fill("blk", BLOCKS_DEV, 12)
    np.testing.assert_array_equal(engine.read("blk"), data)
