"""The host executor: the C copy loop for host memory (:mod:`datadist.engine.native`) and
the CUDA driver for a plan with a CUDA side (:func:`datadist.engine.cuda.copy_plan`)."""
from __future__ import annotations

from .. import cuda, native
from ..layout import Plan

__all__ = ["host_copy_plan"]


def host_copy_plan(plan: Plan, timeout_ms: int = 0) -> int:
    """Run ``plan`` (no NPU side) with the C loop or the CUDA driver; returns the bytes
    copied.  ``timeout_ms`` (> 0) bounds the C loop (``TimeoutError``); a CUDA copy is one
    driver call per run and is not cut short."""
    return native.copy_plan(plan, timeout_ms=timeout_ms) if plan.on_host else cuda.copy_plan(plan)
