"""``layout.sliced``: the slices of a plan (a checked shm copy's pieces) move exactly the
plan's bytes, each once, in slices of about the size asked for."""
from __future__ import annotations

import numpy as np
import pytest

from datadist.engine.layout import Plan, sliced


def _pairs(plan: Plan) -> set[tuple[int, int]]:
    """Every (source, destination) byte address pair the plan moves."""
    out: set[tuple[int, int]] = set()
    for sb, db in zip(plan.src_bases.tolist(), plan.dst_bases.tolist()):
        for so, do, n in zip(plan.src_offs.tolist(), plan.dst_offs.tolist(), plan.lens.tolist()):
            out.update((sb + so + k, db + do + k) for k in range(n))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_slices_move_the_plans_bytes_once(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nt, nu = int(rng.integers(1, 4)), int(rng.integers(1, 6))
    lens = rng.integers(0, 5000, nu).astype(np.uint64)
    offs = np.concatenate([[0], np.cumsum(lens[:-1])]).astype(np.uint64)
    bases = np.arange(nt, dtype=np.uint64) * np.uint64(1 << 20)
    plan = Plan(bases, bases + np.uint64(1 << 30), offs, offs + np.uint64(7), lens)
    size = int(rng.integers(1, 8000))
    parts = sliced(plan, size)
    seen: set[tuple[int, int]] = set()
    for part in parts:
        got = _pairs(part)
        assert not got & seen
        seen |= got
        assert len(parts) == 1 or part.nbytes <= 2 * size
    assert seen == _pairs(plan) and sum(p.nbytes for p in parts) == plan.nbytes
    assert [p.lens.tolist() for p in sliced(plan, size)] == [p.lens.tolist() for p in parts]


def test_a_small_plan_is_one_slice_and_a_long_run_is_split() -> None:
    one = np.array([0], dtype=np.uint64)
    plan = Plan(one, one, one, one, np.array([10 << 20], dtype=np.uint64))
    assert sliced(plan, 16 << 20) == [plan]
    parts = sliced(plan, 4 << 20)
    assert [int(p.lens.sum()) for p in parts] == [4 << 20, 4 << 20, 2 << 20]
    assert [int(p.src_offs[0]) for p in parts] == [0, 4 << 20, 8 << 20]
