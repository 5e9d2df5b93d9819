"""The C copy executors against numpy: bytes moved, and the block sums of copy_plan_sum.

Sizes cover the single-threaded path, the chunked multi-threaded path (>= 8 MiB) and the
streaming-store path of copy_plan_sum (>= 4 MiB, used only where the destination is
16-byte aligned), with runs that start and end inside words and 4 KiB blocks.
"""
from __future__ import annotations

import errno

import numpy as np
import pytest

from datadist.engine.layout import Plan, plan_units
from datadist.engine.native import copy_plan, copy_plan_sum
from ems.pool.checksum import BLOCK, checksum, from_block_sums

pytestmark = pytest.mark.timeout(120)

U64 = np.uint64


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


def _plan(src: np.ndarray, dst: np.ndarray, soffs, doffs, lens) -> Plan:
    return Plan(np.array([_addr(src)], U64), np.array([_addr(dst)], U64),
                np.array(soffs, U64), np.array(doffs, U64), np.array(lens, U64))


def _block_sums(value: np.ndarray) -> np.ndarray:
    """Reference: per 4 KiB block, the sum of the value's little-endian 64-bit words and the
    sum of word i times i + 1 (mod 2**64), interleaved."""
    n = value.shape[0]
    padded = np.zeros(-(-n // BLOCK) * BLOCK, np.uint8)
    padded[:n] = value
    words = padded.view("<u8").reshape(-1, BLOCK // 8)
    weighted = words * np.arange(1, BLOCK // 8 + 1, dtype=U64)
    return np.stack([words.sum(axis=1, dtype=U64), weighted.sum(axis=1, dtype=U64)], axis=1).reshape(-1)


@pytest.mark.parametrize("total", [100_000, 9 << 20, (33 << 20) + 12345])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copy_plan_moves_every_run(total, threads):
    rng = np.random.default_rng(total + threads)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total + 64, np.uint8)
    cuts = np.sort(rng.choice(np.arange(1, total), 40, replace=False))
    starts = np.concatenate([[0], cuts])
    lens = np.diff(np.concatenate([starts, [total]]))
    order = rng.permutation(len(starts))  # scattered destinations
    doffs = np.cumsum(np.concatenate([[0], lens[order][:-1]]))
    dst_of = np.empty_like(doffs)
    dst_of[order] = doffs
    plan = _plan(src, dst, starts, dst_of + 7, lens)  # odd destination alignment
    assert copy_plan(plan, threads=threads) == total
    for s, d, n in zip(starts, dst_of + 7, lens):
        assert np.array_equal(dst[d:d + n], src[s:s + n])


@pytest.mark.parametrize("size", [5000, 1 << 20, (6 << 20) + 13, (17 << 20) + 4100])
@pytest.mark.parametrize("dst_shift", [0, 8, 3])  # 16-aligned (streaming), 8-aligned, odd
@pytest.mark.parametrize("value_is_src", [False, True])
def test_copy_plan_sum_matches_the_checksum(size, dst_shift, value_is_src):
    """Gather into a value (save) or scatter out of one (load), in uneven runs."""
    rng = np.random.default_rng(size + dst_shift)
    value_buf = np.zeros(size + 64, np.uint8)
    cache = rng.integers(0, 256, size + 64, dtype=np.uint8)
    value = value_buf[16:16 + size]  # 16-byte aligned
    cuts = np.sort(rng.choice(np.arange(1, size), 25, replace=False))
    if dst_shift == 0:  # runs of whole cache lines: the streaming path takes most bytes
        cuts = np.unique(cuts // 64 * 64)
        cuts = cuts[cuts > 0]
    voffs = np.concatenate([[0], cuts])
    lens = np.diff(np.concatenate([voffs, [size]]))
    # the cache side holds the runs in reverse order, shifted off alignment by dst_shift
    coffs = np.cumsum(np.concatenate([[0], lens[::-1][:-1]]))[::-1] + dst_shift
    sums = np.zeros(2 * -(-size // BLOCK), U64)
    if value_is_src:
        value[:] = rng.integers(0, 256, size, dtype=np.uint8)
        out = np.zeros_like(cache)
        plan = _plan(value, out, voffs, coffs, lens)
        assert copy_plan_sum(plan, sums, _addr(value), value_is_src=True, threads=2) == size
        for v, c, n in zip(voffs, coffs, lens):
            assert np.array_equal(out[c:c + n], value[v:v + n])
    else:
        plan = _plan(cache, value, coffs, voffs, lens)
        assert copy_plan_sum(plan, sums, _addr(value), value_is_src=False, threads=2) == size
        for v, c, n in zip(voffs, coffs, lens):
            assert np.array_equal(value[v:v + n], cache[c:c + n])
    whole = size // BLOCK
    assert np.array_equal(sums[:2 * whole], _block_sums(value)[:2 * whole])
    assert from_block_sums(sums, value[whole * BLOCK:], size) == checksum(value)


def test_copy_plan_sum_refuses_runs_outside_the_value():
    value = np.zeros(8192, np.uint8)
    cache = np.ones(16384, np.uint8)
    sums = np.zeros(4, U64)
    plan = _plan(cache, value, [0], [4096], [8192])  # ends 4 KiB past the value
    with pytest.raises(OSError) as ei:
        copy_plan_sum(plan, sums, _addr(value), value_is_src=False)
    assert ei.value.errno == errno.ERANGE
    assert not value.any() and not sums.any()  # nothing copied


# ------------------------------------------------------------ block lists into arrays

from hypothesis import given, strategies as st  # noqa: E402

from datadist.engine.native import index_array  # noqa: E402

_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(st.lists(_INT64, max_size=300), st.booleans())
def test_index_array_matches_numpy(values: list, as_tuple: bool) -> None:
    arr, lo, hi = index_array(tuple(values) if as_tuple else values)
    np.testing.assert_array_equal(arr, np.array(values, dtype=np.int64))
    assert arr.dtype == np.int64
    if values:
        assert (lo, hi) == (min(values), max(values))


@pytest.mark.parametrize("bad, exc", [([1, True], TypeError), ([1, 2.0], TypeError), ([1, "2"], TypeError),
                                      ([2**63], OverflowError), ([-(2**63) - 1], OverflowError)])
def test_index_array_refuses_what_is_not_an_int64(bad: list, exc: type) -> None:
    with pytest.raises(exc):
        index_array(bad)


@pytest.mark.parametrize("other", [range(4), np.arange(4), iter([1, 2])])
def test_index_array_leaves_other_types_to_numpy(other) -> None:
    assert index_array(other) is None


def test_a_copy_with_a_timeout_stops_between_chunks() -> None:
    n = 512 << 20  # cannot be copied in 1 ms; chunks are at most 64 MiB
    src = np.ones(n, np.uint8)
    dst = np.zeros(n, np.uint8)
    plan = plan_units([src.ctypes.data], [0], [dst.ctypes.data], [0], n)
    with pytest.raises(TimeoutError):
        copy_plan(plan, timeout_ms=1)
    assert not dst[-(64 << 20):].any()  # the last chunk never started
    assert copy_plan(plan, timeout_ms=60_000) == n and dst.all()
