"""The checksum of a plan half summed by batched torch reductions
(:func:`datadist.engine.transports.device_sum.device_checksum`, the GPU path) equals the C
loops' sum of the same runs, on host memory here (CUDA in ``tests/integration/test_cuda.py``):
64-bit words that overflow, tails, blocks that straddle tensors, several gather groups."""
from __future__ import annotations

import numpy as np
import pytest

from datadist.engine import native
from datadist.engine.checksum import StreamSum
from datadist.engine.transports.device_sum import device_checksum

pytestmark = pytest.mark.timeout(60)


def _native_sum(bases: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> int:
    summed = StreamSum(int(lens.sum()) * int(bases.shape[0]))
    native.sum_plan(bases, offs, lens, summed)
    return summed.checksum()


def _half(rng: np.random.Generator, ntensors: int, tensor_bytes: int, runs: list[tuple[int, int]]):
    """Random tensors (kept alive by the returned list) and a plan half over them."""
    tensors = [rng.integers(0, 256, tensor_bytes, dtype=np.uint8) for _ in range(ntensors)]
    bases = np.array([t.ctypes.data for t in tensors], dtype=np.uint64)
    offs = np.array([o for o, _ in runs], dtype=np.uint64)
    lens = np.array([n for _, n in runs], dtype=np.uint64)
    return tensors, bases, offs, lens


@pytest.mark.parametrize("runs", [
    [(0, 1 << 16)],                                # one run of whole blocks per tensor
    [(8192, 4096), (0, 4096), (40960, 12288)],     # scattered whole blocks
    [(3, 5000), (9001, 777)],                      # unaligned runs: blocks straddle runs and tensors
    [(0, 4096), (12288, 100)],                     # a tail in the last tensor only
])
@pytest.mark.parametrize("group_bytes", [1, 1 << 14, 1 << 30])
def test_batched_sums_equal_the_c_loops(runs, group_bytes):
    rng = np.random.default_rng(len(runs) * 31 + group_bytes % 97)
    keep, bases, offs, lens = _half(rng, 6, 1 << 16, runs)
    assert device_checksum(bases, offs, lens, "cpu", group_bytes=group_bytes) == _native_sum(bases, offs, lens)
    del keep


def test_a_changed_word_changes_the_batched_sum():
    rng = np.random.default_rng(5)
    keep, bases, offs, lens = _half(rng, 3, 1 << 14, [(0, 8192), (8192, 8192)])
    before = device_checksum(bases, offs, lens, "cpu")
    keep[2][8200] ^= 1
    assert device_checksum(bases, offs, lens, "cpu") != before
    assert device_checksum(bases, offs, lens, "cpu") == _native_sum(bases, offs, lens)


def test_an_empty_half_has_the_empty_checksum():
    none = np.zeros(0, dtype=np.uint64)
    assert device_checksum(np.zeros(2, dtype=np.uint64), none, none, "cpu") == _native_sum(
        np.zeros(2, dtype=np.uint64), none, none)
