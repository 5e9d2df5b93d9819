"""The host executor: the C copy loop for host memory (:mod:`datadist.engine.native`) and
the CUDA driver for a plan with a CUDA side (:func:`datadist.engine.cuda.copy_plan`)."""
from __future__ import annotations

from .. import cuda, native
from ..layout import Plan

__all__ = ["host_copy_plan"]


def host_copy_plan(plan: Plan) -> int:
    """Run ``plan`` (no NPU side) with the C loop or the CUDA driver; returns the bytes copied."""
    return native.copy_plan(plan) if plan.on_host else cuda.copy_plan(plan)
