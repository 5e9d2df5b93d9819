"""The copy executors: what runs a :class:`~datadist.engine.layout.Plan` whose both sides
are addressable in this process (local copies, copies into a peer's mapped memory, and the
gathers and scatters of staging buffers).

Two executors run the same plans, byte for byte:

- ``host`` (the default): the C copy loop for host memory (:mod:`datadist.engine.native`),
  the CUDA driver for a plan with a CUDA side (:func:`datadist.engine.cuda.copy_plan`);
- ``torch``: batched torch ops on the device's current stream, for any memory torch can
  view (:mod:`.tensor`); plans with an NPU side always run on it.

An executor is a :data:`CopyExecutor`: a function that runs a plan and returns the bytes it
copied; :data:`EXECUTORS` names them.

``DATADIST_EXECUTOR=torch`` selects the torch executor for every local copy of the
process (tests run the transfer suites under it on CPU, so its code path is exercised on
every commit); the leg between processes (mapped memory, cross-memory attach, sockets,
collectives) is not an executor's business and stays as it is.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable

from .. import native
from ..layout import Plan
from .host import host_copy_plan
from .tensor import torch_copy_plan

__all__ = ["CopyExecutor", "EXECUTORS", "executor", "set_executor", "copy_plan", "bind", "torch_copy_plan"]

#: What every executor is: run a plan whose both sides this process can address within a
#: timeout (ms, 0: none), return the bytes copied; raises on a failed copy
#: (``TimeoutError`` past the timeout) and leaves the destination undefined.
CopyExecutor = Callable[[Plan, int], int]

log = logging.getLogger("datadist")

_BY_NAME: dict[str, CopyExecutor] = {"host": host_copy_plan, "torch": torch_copy_plan}
EXECUTORS = tuple(_BY_NAME)
_ENV = "DATADIST_EXECUTOR"


def _from_env() -> str:
    name = os.environ.get(_ENV, "host").strip().lower() or "host"
    if name not in EXECUTORS:
        log.warning("%s=%r is not one of %s; using host", _ENV, name, ", ".join(EXECUTORS))
        return "host"
    return name


_current = _from_env()


def executor() -> str:
    """The executor local copies use in this process."""
    return _current


def set_executor(name: str) -> None:
    """Use executor ``name`` (one of :data:`EXECUTORS`) for this process's local copies."""
    global _current
    if name not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {name!r}")
    _current = name


def copy_plan(plan: Plan, timeout_ms: int = 0) -> int:
    """Run ``plan`` with the current executor; returns the bytes copied.  ``timeout_ms``
    (> 0): ``TimeoutError`` if the copy is not done by then."""
    if plan.src_dev.startswith("npu") or plan.dst_dev.startswith("npu"):
        return torch_copy_plan(plan, timeout_ms)
    return _BY_NAME[_current](plan, timeout_ms)


def bind(plan: Plan) -> Callable[[int], int]:
    """:func:`copy_plan` of ``plan`` as a call of the timeout alone, with the executor
    chosen now (a prepared transfer keeps the executor it was prepared with): a host plan
    on the host executor becomes one C call with its arrays bound."""
    if _current == "host" and plan.on_host:
        return native.bind_copy(plan)
    return functools.partial(copy_plan, plan)
