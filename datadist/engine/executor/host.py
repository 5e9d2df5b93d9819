"""The host executor: the C copy loop for host memory (:mod:`datadist.engine.native`) and
the CUDA driver for a plan with a CUDA side (:func:`datadist.engine.cuda.copy_plan`), except
device-to-device plans of many runs, which run as batched gather/scatter kernels
(:func:`.tensor.torch_copy_plan`).

Why the split, measured on an H100 (``python -m datadist.bench --device cuda``, one run, the
threshold below set to 8, 64 and off): the driver path issues one ``cuMemcpyAsync`` per run,
about 3.7 us each, so ``scatter-32k`` (2048 runs of 32 KiB) moved 5.4 GB/s locally and 6.2 GB/s
over shm, and 159 / 178 GB/s as kernels; a local ``kv-7b`` round (one plan of many runs per
tensor) 34 -> 398 GB/s.  But the layer calls of ``kv-7b`` over shm (8 requests at once, 16
runs per tensor pair) fell from 15.2 to 7.2 GB/s as kernels at a threshold of 8 (each call's
index upload and device synchronization wait for the other requests' kernels), and stayed at
14.7 GB/s at 64: plans of fewer runs keep the driver call, which has no kernel to wait for.
"""
from __future__ import annotations

from .. import cuda, native
from ..layout import Plan
from .tensor import torch_copy_plan

__all__ = ["host_copy_plan", "BATCHED_RUNS"]

#: Device-to-device plans with at least this many runs per tensor pair run as kernels.
BATCHED_RUNS = 64


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
