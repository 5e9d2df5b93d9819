"""Copies inside this process: between two local caches (copy/swap), to a peer's memory
that this process has mapped (the shared-memory path reuses it), and through staging
buffers for executors that only reach one kind of memory.

Plans run on the process's executor (:mod:`datadist.engine.executor`): by default the C
copy loop for host-only plans and the CUDA driver for a plan with a CUDA side; with
``DATADIST_EXECUTOR=torch``, batched torch ops.
Sockets and cross-memory attach reach host memory only, so a transfer whose local side is
device memory is *staged*: gathered into one contiguous host buffer before it is sent, or
received there and scattered afterwards (:func:`host_side`).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import numpy as np

from .. import cuda, executor, npu
from ..layout import Plan

if TYPE_CHECKING:
    import torch

__all__ = ["LocalTransport", "host_side", "staging_buffer", "staging_plan"]


class LocalTransport:
    """Executes a plan whose both sides are addressable here."""

    name = "local"

    @staticmethod
    def copy(plan: Plan, timeout_ms: int = 0) -> int:
        """Copy the plan with the process's executor (:mod:`datadist.engine.executor`);
        returns the bytes moved (``TimeoutError`` past ``timeout_ms``, if > 0)."""
        return executor.copy_plan(plan, timeout_ms)


def staging_buffer(nbytes: int, device: str = "cpu") -> tuple[torch.Tensor, int]:
    """A contiguous buffer of ``nbytes`` on ``device`` and its address: a torch tensor,
    page-locked when it is host memory in a CUDA process (host <-> device copies then run
    at DMA speed; torch caches such blocks, so repeated transfers do not pin again)."""
    import torch

    pinned = device == "cpu" and cuda.active() is not None and torch.cuda.is_available()
    buf = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device, pin_memory=pinned)
    if device.startswith("npu"):
        npu.track(buf)  # the torch executor reaches NPU memory through known tensors only
    return buf, buf.data_ptr()


def staging_plan(half_bases: np.ndarray, half_offs: np.ndarray, lens: np.ndarray, staging: int, *, gather: bool,
                 half_dev: str = "cpu", staging_dev: str = "cpu") -> Plan:
    """The plan between one side of a transfer (``half_*`` on ``half_dev``) and a
    contiguous staging buffer at ``staging``: runs in transfer order, packed back to back
    (the order a socket or a collective moves them in).  ``gather``: half -> staging."""
    packed_bases, packed_offs = _packed(half_bases, lens, staging)
    if gather:
        return Plan(half_bases, packed_bases, half_offs, packed_offs, lens, half_dev, staging_dev)
    return Plan(packed_bases, half_bases, packed_offs, half_offs, lens, staging_dev, half_dev)


def _packed(half_bases: np.ndarray, lens: np.ndarray, staging: int) -> tuple[np.ndarray, np.ndarray]:
    per_t = int(lens.sum())
    bases = np.uint64(staging) + np.arange(half_bases.shape[0], dtype=np.uint64) * np.uint64(per_t)
    offs = np.zeros(lens.shape[0], dtype=np.uint64)
    if lens.shape[0] > 1:
        np.cumsum(lens[:-1], out=offs[1:])
    return bases, offs


@contextlib.contextmanager
def host_side(plan: Plan, local_is_src: bool) -> Iterator[Plan]:
    """The plan with its local side in host memory, for executors that reach only host
    memory (sockets, cross-memory attach).  A host-side plan is yielded unchanged.  A
    device-side source is gathered into a host staging buffer first; a device-side
    destination is received into one and scattered when the block ends without error."""
    dev = plan.src_dev if local_is_src else plan.dst_dev
    if dev == "cpu":
        yield plan
        return
    buf, addr = staging_buffer(plan.nbytes)
    if local_is_src:
        gather = staging_plan(plan.src_bases, plan.src_offs, plan.lens, addr, gather=True, half_dev=dev)
        LocalTransport.copy(gather)
        yield Plan(gather.dst_bases, plan.dst_bases, gather.dst_offs, plan.dst_offs, plan.lens, "cpu", plan.dst_dev)
    else:
        scatter = staging_plan(plan.dst_bases, plan.dst_offs, plan.lens, addr, gather=False, half_dev=dev)
        yield Plan(plan.src_bases, scatter.src_bases, plan.src_offs, scatter.src_offs, plan.lens, plan.src_dev, "cpu")
        LocalTransport.copy(scatter)
    del buf  # the staging memory lives until here
