"""The host executor: the C copy loop for host memory (:mod:`datadist.engine.native`) and
the CUDA driver for a plan with a CUDA side (:func:`datadist.engine.cuda.copy_plan`), except
device-to-device plans of many runs, which run as batched gather/scatter kernels
(:func:`.tensor.torch_copy_plan`).

Why the split: the driver path issues one ``cuMemcpyAsync`` per run, about 3.7 us each on an
H100 (``python -m datadist.bench --device cuda --workload scatter-32k``: 2048 runs of 32 KiB
in 7.6 ms, 8.8 GB/s, against 264 GB/s for a torch copy of the same bytes); two kernels per
tensor pair do not grow with the number of runs.  A plan of few runs (a single 4 KiB block,
a whole cache in order) keeps the driver call, which has no kernel launch to pay.
"""
from __future__ import annotations

from .. import cuda, native
from ..layout import Plan
from .tensor import torch_copy_plan

__all__ = ["host_copy_plan", "BATCHED_RUNS"]

#: Device-to-device plans with at least this many runs per tensor pair run as kernels.
BATCHED_RUNS = 8


def host_copy_plan(plan: Plan, timeout_ms: int = 0) -> int:
    """Run ``plan`` (no NPU side) with the C loop, the CUDA driver or, for a device-to-device
    plan of :data:`BATCHED_RUNS` runs or more per tensor pair, batched kernels; returns the
    bytes copied.  ``timeout_ms`` (> 0) bounds the C loop and the kernels between tensor
    pairs (``TimeoutError``); a driver copy is one call per run and is not cut short."""
    if plan.on_host:
        return native.copy_plan(plan, timeout_ms=timeout_ms)
    if plan.src_dev.startswith("cuda") and plan.dst_dev.startswith("cuda") and plan.lens.shape[0] >= BATCHED_RUNS:
        return torch_copy_plan(plan, timeout_ms)
    return cuda.copy_plan(plan)
