"""The torch executor: a plan's runs as batched torch ops on the device's current stream.

Each tensor pair of a plan is viewed as rows of ``g`` bytes (``g`` the largest size dividing
every run and offset), and the plan's runs become one ``index_select`` of the source rows and
one ``index_copy_`` into the destination rows (a single run: one ``copy_``): no Python loop per
block, and device memory never makes a round trip through host memory.  It reaches any
memory torch can view: host, CUDA, and NPU memory of tensors the engine knows
(:mod:`datadist.engine.npu`).
"""
from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, Optional

import numpy as np
import numpy.typing as npt

from .. import cuda, npu
from ..layout import Plan

__all__ = ["torch_copy_plan"]

log = logging.getLogger("datadist")

_WRAP = 1 << 64


def _view(addr: int, nbytes: int, device: str) -> Any:
    """A uint8 tensor over ``nbytes`` at ``addr`` on ``device`` (no copy)."""
    import torch

    if device == "cpu":
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)
    if device.startswith("npu"):
        return npu.view(addr, nbytes, device)
    return cuda.cuda_tensor(addr, nbytes, device)


def _rows(starts: npt.NDArray[np.int64], counts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Row indices ``starts[i] .. starts[i] + counts[i] - 1`` of every run, in order."""
    total = int(counts.sum())
    first = np.repeat(starts - np.cumsum(counts) + counts, counts)
    return first + np.arange(total, dtype=np.int64)


def torch_copy_plan(plan: Plan, timeout_ms: int = 0) -> int:
    """Run ``plan`` with torch ops (see the module docstring); returns the bytes copied.
    ``timeout_ms`` (> 0): ``TimeoutError`` if it passes between two tensor pairs."""
    lens = plan.lens.astype(np.int64)
    ntensors = int(plan.src_bases.shape[0])
    if ntensors == 0 or lens.shape[0] == 0 or int(lens.sum()) == 0:
        return 0
    so, do = plan.src_offs.astype(np.int64), plan.dst_offs.astype(np.int64)
    if not _spans_viewable(plan, so, do, lens):
        return _copy_runs(plan, so, do, lens)
    _Rows(plan, so, do, lens).copy(time.monotonic() + timeout_ms / 1000.0 if timeout_ms > 0 else None)
    _synchronize(plan)
    return int(lens.sum()) * ntensors


class _Rows:
    """A plan as rows of ``g`` bytes: per tensor pair, the rows to read and to write, as
    index tensors on each side's device (none for a single run: one ``copy_``)."""

    def __init__(self, plan: Plan, so: npt.NDArray[np.int64], do: npt.NDArray[np.int64],
                 lens: npt.NDArray[np.int64]) -> None:
        import torch

        self.plan = plan
        s_lo, d_lo = int(so.min()), int(do.min())
        rs, rd = so - s_lo, do - d_lo
        self.g = g = int(np.gcd.reduce(np.concatenate((lens, rs, rd))))
        self.s_span, self.d_span = int((rs + lens).max()), int((rd + lens).max())
        self.single = lens.shape[0] == 1
        if not self.single:
            counts = lens // g
            self.src_rows = torch.from_numpy(_rows(rs // g, counts)).to(plan.src_dev)
            self.dst_rows = torch.from_numpy(_rows(rd // g, counts)).to(plan.dst_dev)
        # Addresses are modulo 2**64: a rebased plan may carry a wrapped base that its
        # offsets bring back into range.
        self.starts_s = (plan.src_bases.astype(object) + s_lo) % _WRAP
        self.starts_d = (plan.dst_bases.astype(object) + d_lo) % _WRAP
        # Rows of the widest element that divides them: indexing moves elements, not bytes.
        self.width = next(w for w in (8, 4, 2, 1)
                          if g % w == 0 and all(int(a) % w == 0 for a in (*self.starts_s, *self.starts_d)))
        self.kind = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[self.width]

    def copy(self, deadline: Optional[float]) -> None:
        """One batched copy per tensor pair, never one per block; ``TimeoutError`` if
        ``deadline`` passes between two pairs."""
        plan, n = self.plan, len(self.starts_s)
        for t in range(n):
            if deadline is not None and t and time.monotonic() > deadline:
                raise TimeoutError(f"copy of {n} tensors not done by its deadline ({t} done)")
            src = _view(int(self.starts_s[t]), self.s_span, plan.src_dev).view(self.kind)
            dst = _view(int(self.starts_d[t]), self.d_span, plan.dst_dev).view(self.kind)
            if self.single:
                dst.copy_(src)
                continue
            picked = src.view(-1, self.g // self.width).index_select(0, self.src_rows)
            dst.view(-1, self.g // self.width).index_copy_(
                0, self.dst_rows, picked.to(plan.dst_dev) if plan.dst_dev != plan.src_dev else picked)


def _synchronize(plan: Plan) -> None:
    import torch

    for dev in {plan.src_dev, plan.dst_dev} - {"cpu"}:
        if dev.startswith("npu"):
            npu.synchronize(dev)
        else:
            torch.cuda.synchronize(dev)


def _spans_viewable(plan: Plan, so: npt.NDArray[np.int64], do: npt.NDArray[np.int64], lens: npt.NDArray[np.int64]) -> bool:
    """Whether each tensor's span on an NPU side lies in one NPU tensor (it may not where a
    plan's units are the tensors of a cache, whose NPU allocations are apart)."""
    for bases, offs, dev in ((plan.src_bases, so, plan.src_dev), (plan.dst_bases, do, plan.dst_dev)):
        if dev.startswith("npu"):
            lo, span = int(offs.min()), int((offs - offs.min() + lens).max())
            if not all(npu.covers((int(b) + lo) % _WRAP, span) for b in bases):
                return False
    return True


_slow_path_logged = False


def _copy_runs(plan: Plan, so: npt.NDArray[np.int64], do: npt.NDArray[np.int64], lens: npt.NDArray[np.int64]) -> int:
    """The plan one run at a time (each run lies in one tensor): for the rare plans whose
    tensors' spans cross NPU allocations.  Says so once per process: it is a Python loop
    per run, far slower than the batched path."""
    global _slow_path_logged
    if not _slow_path_logged:
        _slow_path_logged = True
        log.warning("torch executor: a plan of %d runs over %d tensors spans several NPU allocations per tensor; "
                    "copying it run by run (a Python loop, slow); keep each cache tensor in one allocation",
                    int(lens.shape[0]), int(plan.src_bases.shape[0]))
    total = 0
    for sb, db in zip(plan.src_bases.astype(object), plan.dst_bases.astype(object)):
        for s_off, d_off, n in zip(so.tolist(), do.tolist(), lens.tolist()):
            if n:
                _view((db + d_off) % _WRAP, n, plan.dst_dev).copy_(_view((sb + s_off) % _WRAP, n, plan.src_dev))
                total += n
    _synchronize(plan)
    return total
