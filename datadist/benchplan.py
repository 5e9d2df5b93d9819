"""The ``plan`` workload of ``python -m datadist.bench``: validation and planning of one
large ``push_blocks`` call in one process (no data moves), and the same call shape
repeated, finding the plan it made before."""
from __future__ import annotations

import json
import time
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["plan_rows", "print_plan_rows", "PLAN_BLOCKS", "PLAN_TENSORS"]

#: 4096 blocks over 64 tensors (32 layers of K, V).
PLAN_BLOCKS, PLAN_TENSORS = 4096, 64

Row = Dict[str, Any]


def plan_rows(rounds: int = 200) -> List[Row]:
    """Time ``push_blocks``-style validation and planning (no data moves): 4096 blocks over
    64 tensors with a layer range covering every layer, in-order and scattered lists; and
    the same call shape repeated (``cached``): what a plain call then spends to find the
    plan it made before (both block lists as keys, one lookup in its handle's memory)."""
    from ._handles import PLAN_BLOCKS_PER_HANDLE, PLANS_PER_HANDLE, TransferHandle
    from ._planning import Side, blocks_plan
    from .engine.memo import Weighed

    base = np.arange(PLAN_TENSORS, dtype=np.uint64) * np.uint64(1 << 30) + np.uint64(1 << 40)
    src = Side(base, PLAN_TENSORS, PLAN_BLOCKS * 4096, PLAN_BLOCKS)
    dst = Side(base + np.uint64(1 << 36), PLAN_TENSORS, PLAN_BLOCKS * 4096, PLAN_BLOCKS)
    layers = range(0, PLAN_TENSORS // 2)
    rows = []
    for name, dst_blocks in (("in order", list(range(PLAN_BLOCKS))),
                             ("scattered", np.random.default_rng(7).permutation(PLAN_BLOCKS).tolist())):
        src_blocks = list(range(PLAN_BLOCKS))
        plan = blocks_plan(src, dst, src_blocks, dst_blocks, 2, layers, layers)
        memo: Weighed[object, object] = Weighed(PLANS_PER_HANDLE, PLAN_BLOCKS_PER_HANDLE)
        memo.put(TransferHandle._key(src_blocks, dst_blocks), plan, 2 * PLAN_BLOCKS)
        # the lists as a later call gives them: equal, but other list objects
        again_src, again_dst = list(src_blocks), list(dst_blocks)
        steps: List[Tuple[bool, Callable[[], object]]] = [
            (False, partial(blocks_plan, src, dst, src_blocks, dst_blocks, 2, layers, layers)),
            (True, lambda: memo.get(TransferHandle._key(again_src, again_dst)))]
        for cached, step in steps:
            times = []
            for _ in range(rounds + 1):
                t = time.perf_counter()
                got = step()
                times.append(time.perf_counter() - t)
            if got is None:
                raise RuntimeError("a repeated call shape did not find its plan")
            us = sorted(t * 1e6 for t in times[1:])
            rows.append({"workload": "plan", "transport": name + (", cached" if cached else ""),
                         "system": "datadist-plan", "runs": plan.nruns, "cached": cached,
                         "p50_us": us[len(us) // 2], "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))],
                         "blocks": PLAN_BLOCKS, "tensors": PLAN_TENSORS, "scatter": name == "scattered"})
    return rows


def print_plan_rows(as_json: bool, rounds: Optional[int]) -> None:
    for row in plan_rows(rounds or 200):
        print(json.dumps(row) if as_json else
              f"{'plan':14s} {row['transport']:28s} {row['p50_us']:9.1f} {row['p99_us']:9.1f}"
              f"   ({row['runs']} runs)", flush=True)
