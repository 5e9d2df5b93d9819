"""The torch executor moves exactly the bytes the host executor moves, on random plans:
factored plans of several tensors, single runs, coalesced runs of unequal length, odd
offsets, and copies inside one buffer."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from datadist.engine import executor as executors
from datadist.engine.layout import Plan, plan_units

U64 = np.uint64


@st.composite
def plans(draw):
    ntensors = draw(st.integers(1, 4))
    unit = draw(st.sampled_from([1, 2, 3, 8, 64, 512]))
    nblocks = draw(st.integers(1, 24))
    count = draw(st.integers(1, nblocks))
    src_blocks = draw(st.lists(st.integers(0, nblocks - 1), min_size=count, max_size=count))
    dst_blocks = draw(st.permutations(range(nblocks)))[:count]  # destinations never overlap
    shift = draw(st.integers(0, 7))  # runs that do not start on a row boundary
    return ntensors, unit, nblocks, src_blocks, list(dst_blocks), shift


def _run(name: str, plan: Plan) -> int:
    executors.set_executor(name)
    try:
        return executors.copy_plan(plan)
    finally:
        executors.set_executor("host")


@settings(max_examples=80, deadline=None)
@given(plans(), st.booleans())
def test_torch_executor_matches_host(case, same_buffer: bool) -> None:
    ntensors, unit, nblocks, src_blocks, dst_blocks, shift = case
    rng = np.random.default_rng(len(src_blocks) * 31 + unit)
    size = nblocks * unit + shift
    src = rng.integers(0, 256, (ntensors, size), dtype=np.uint8)
    dst0 = src.copy() if same_buffer else rng.integers(0, 256, (ntensors, size), dtype=np.uint8)
    out = {}
    for name in ("host", "torch"):
        dst = dst0.copy()
        origin = dst if same_buffer else src.copy()
        sb = np.array([origin[t].ctypes.data for t in range(ntensors)], U64)
        db = np.array([dst[t].ctypes.data for t in range(ntensors)], U64)
        so = np.array(src_blocks, U64) * U64(unit) + U64(shift)
        do = np.array(dst_blocks, U64) * U64(unit) + U64(shift)
        if same_buffer:  # a copy inside one cache: sources are read before they are overwritten
            keep = ~np.isin(np.array(src_blocks), np.array(dst_blocks))
            so, do = so[keep], do[keep]
            if so.shape[0] == 0:
                return
        plan = plan_units(sb, so, db, do, unit)
        moved = _run(name, plan)
        assert moved == plan.nbytes
        out[name] = dst.copy()
    np.testing.assert_array_equal(out["host"], out["torch"])
    if not same_buffer:  # and both did what the plan says
        expected = dst0.copy()
        for sblk, dblk in zip(src_blocks, dst_blocks):
            s0, d0 = sblk * unit + shift, dblk * unit + shift
            expected[:, d0:d0 + unit] = src[:, s0:s0 + unit]
        np.testing.assert_array_equal(out["torch"], expected)


def test_empty_plan_and_bad_name() -> None:
    empty = np.zeros(0, U64)
    assert _run("torch", Plan(empty, empty, empty, empty, empty)) == 0
    with pytest.raises(ValueError, match="executor"):
        executors.set_executor("gpu")
