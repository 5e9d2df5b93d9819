"""The ``plan`` workload of ``python -m datadist.bench``: validation and planning of one
large ``push_blocks`` call in one process (no data moves), and the same call shape
repeated, finding the plan it made before."""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

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
    from ..engine.prepared import PlanMemory
    from ..engine.planning import Side, blocks_plan
    from ..engine.transports.base import Prepared, RemoteCache

    base = np.arange(PLAN_TENSORS, dtype=np.uint64) * np.uint64(1 << 30) + np.uint64(1 << 40)
    src = Side(base, PLAN_TENSORS, PLAN_BLOCKS * 4096, PLAN_BLOCKS)
    dst = Side(base + np.uint64(1 << 36), PLAN_TENSORS, PLAN_BLOCKS * 4096, PLAN_BLOCKS)
    layers = range(0, PLAN_TENSORS // 2)
    rows = []
    for name, make_dst in (("in order", lambda: list(range(PLAN_BLOCKS))),
                           ("scattered", lambda: np.random.default_rng(7).permutation(PLAN_BLOCKS).tolist())):
        src_blocks, dst_blocks = list(range(PLAN_BLOCKS)), make_dst()
        plan = blocks_plan(src, dst, src_blocks, dst_blocks, 2, layers, layers)
        memory = PlanMemory()
        ready = Prepared(cast(RemoteCache, None), plan, lambda deadline: True)
        memory.keep(memory.find(src_blocks, dst_blocks)[1], ready, src_blocks, dst_blocks)
        # the lists as a later call gives them: the same int objects in other lists, and
        # equal values in new int objects (fresh ones for every round)
        same = (list(src_blocks), list(dst_blocks))
        fresh = [(list(range(PLAN_BLOCKS)), make_dst()) for _ in range(min(rounds, 50) + 1)]
        steps: List[Tuple[str, int, Callable[[int], object]]] = [
            ("", rounds, lambda i: blocks_plan(src, dst, src_blocks, dst_blocks, 2, layers, layers)),
            (", cached", rounds, lambda i: memory.find(*same)[0]),
            (", cached, new ints", len(fresh) - 1, lambda i: memory.find(*fresh[i])[0])]
        for label, n, step in steps:
            times = []
            for i in range(n + 1):
                t = time.perf_counter()
                got = step(i)
                times.append(time.perf_counter() - t)
            if got is None:
                raise RuntimeError("a repeated call shape did not find its plan")
            us = sorted(t * 1e6 for t in times[1:])
            rows.append({"workload": "plan", "transport": name + label, "system": "datadist-plan",
                         "runs": plan.nruns, "cached": bool(label), "p50_us": us[len(us) // 2],
                         "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))], "blocks": PLAN_BLOCKS,
                         "tensors": PLAN_TENSORS, "scatter": name == "scattered"})
    return rows


def print_plan_rows(as_json: bool, rounds: Optional[int]) -> None:
    for row in plan_rows(rounds or 200):
        print(json.dumps(row) if as_json else
              f"{'plan':14s} {row['transport']:28s} {row['p50_us']:9.1f} {row['p99_us']:9.1f}"
              f"   ({row['runs']} runs)", flush=True)
