"""torch.distributed links: point-to-point send/recv on a two-member process group made
for the link alone (``gloo`` on CPU; ``nccl``/``hccl`` with the same code).

No global ``init_process_group`` is touched: the server of the link hosts a ``TCPStore``
on its listen address (port announced in ``HELLO_ACK``), and both ends construct the
backend's ``ProcessGroup`` class directly, the server as rank 0.

A transfer is negotiated on the link's request connection, then the bytes go through the
process group:

* push: ``PUSH`` (via=collective) -> the server validates and answers ``REPLY`` (ready),
  then receives into a staging buffer and scatters it into the cache -> the initiator,
  having sent its gathered staging buffer, reads the final ``REPLY``;
* pull: ``PULL`` (via=collective) -> the server validates, answers ready, gathers and
  sends; the initiator receives and scatters.

Waiting for "ready" first means a rejected request never leaves a send without a matching
receive.  Gathering into one staging tensor per transfer keeps it to one collective
operation whatever the block list.  The staging tensor lives where the backend sends
from: host memory for ``gloo`` (device caches are gathered into it with device copies),
the engine's GPU for ``nccl`` (host or device caches gathered straight into it), host
memory moved to the NPU for ``hccl``.
"""
from __future__ import annotations

import datetime
import logging
import time
from typing import TYPE_CHECKING, Optional, Protocol, cast

import numpy as np

from ..errors import Fault, fail
from .. import cuda, wire
from ..layout import Plan
from .base import Channel, RemoteCache, Transport, check_reply
from .local import LocalTransport, staging_buffer, staging_plan

if TYPE_CHECKING:
    import torch
    from torch._C._distributed_c10d import Store, Work

__all__ = ["CollectiveTransport", "COLLECTIVE_BACKENDS", "VIA_COLLECTIVE", "make_group"]

log = logging.getLogger("datadist")

COLLECTIVE_BACKENDS = ("gloo", "nccl", "hccl")
#: ``Push.via`` / ``Pull.via`` value of a transfer whose bytes go through the process group.
VIA_COLLECTIVE = 1
_TAG = 7


class ProcessGroup(Protocol):
    """The two-member process group as the transport uses it: a torch ``Backend``
    (``ProcessGroupGloo``/``NCCL``/``HCCL``, which torch's stubs declare without the
    ``send``/``recv`` they have at run time)."""

    def send(self, tensors: list[torch.Tensor], rank: int, tag: int, /) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], rank: int, tag: int, /) -> Work: ...


def make_group(backend: str, store: Store, rank: int, timeout_s: float) -> ProcessGroup:
    """A two-member process group of ``backend`` over ``store`` (no global state)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return cast(ProcessGroup, dist.ProcessGroupGloo(store, rank, 2, timeout))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return cast(ProcessGroup, dist.ProcessGroupNCCL(store, rank, 2, opts))
    import torch_npu  # noqa: F401  (registers ProcessGroupHCCL)

    return cast(ProcessGroup, torch_npu._C._distributed_c10d.ProcessGroupHCCL(store, rank, 2, timeout))


#: Backends whose ``Work.wait(timeout)`` does not honour the timeout: their work is polled.
POLLED_BACKENDS = ("hccl",)
#: Backends whose communicator forms on the first operation (seconds for HCCL): links warm them.
LAZY_BACKENDS = ("nccl", "hccl")


def abort_group(group: object, reason: str) -> None:
    """End ``group``'s communicator and its stuck operations, through the binding's own
    entry point: ``abort_hccl_comm(reason)`` on torch_npu's ``ProcessGroupHCCL``
    (``abortAndClearHcclComm``), ``abort()`` on torch's ``ProcessGroupNCCL``; gloo has
    none (its operations end at their timeout)."""
    try:
        if hasattr(group, "abort_hccl_comm"):
            group.abort_hccl_comm(reason)
        elif hasattr(group, "abort"):
            group.abort()
    except RuntimeError as exc:
        log.debug("process group abort: %s", exc)


def wait_work(work: Work, deadline: float, group: object, poll: bool) -> None:
    """Wait for a collective ``work`` item until ``deadline`` (monotonic seconds).

    Gloo and NCCL honour ``Work.wait(timeout)`` (gloo even moves the bytes inside ``wait``),
    so their work is waited for with the time left.  HCCL's ``wait`` blocks on whatever the
    timeout, so with ``poll`` this checks ``is_completed`` with a backoff of 20 us to 1 ms
    and, at the deadline, aborts ``group`` (which ends the stuck operation) and raises
    ``TimeoutError``; a completed item's own error is raised by its ``wait``.  No thread of
    ours ever blocks on a peer for good."""
    if not poll:
        work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        return
    pause = 20e-6
    while not work.is_completed():
        if time.monotonic() >= deadline:
            abort_group(group, "deadline passed")
            raise TimeoutError("the collective operation did not complete before the deadline")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    work.wait()


class CollectiveTransport(Transport):
    """Moves plan bytes through ``group`` (see the module docstring)."""

    def __init__(self, backend: str, group: ProcessGroup, peer_rank: int, store: Optional[Store] = None,
                 device: str = "cpu") -> None:
        self.name = backend
        self.group: Optional[ProcessGroup] = group
        self.peer_rank = peer_rank
        gpu = cuda.active()
        #: Where staging tensors live, and where the backend wants them moved to (if anywhere):
        #: an NPU engine's hccl links gather on its NPU, as nccl links do on the GPU.
        if backend == "nccl" and gpu is not None:
            self.staging_dev = gpu.name
        elif backend == "hccl" and device.startswith("npu"):
            self.staging_dev = device
        else:
            self.staging_dev = "cpu"
        self.wire_dev = {"gloo": None, "nccl": "cuda", "hccl": "npu"}[backend] if self.staging_dev == "cpu" else None
        self._store = store  # keeps the rendezvous alive as long as the group
        self._poll = backend in POLLED_BACKENDS

    def warm(self, rank: int, deadline: float) -> None:
        """Form a lazily formed communicator now (one small exchange each way, rank 0
        sending first), before ``deadline``; a no-op for backends formed at construction.
        Raises ``TimeoutError`` or the backend's ``RuntimeError``."""
        if self.name not in LAZY_BACKENDS:
            return
        import torch

        group = self._group()
        probe = torch.zeros(1, dtype=torch.uint8, device=self.staging_dev if self.wire_dev is None else self.wire_dev)
        for sending in ((True, False) if rank == 0 else (False, True)):
            op = group.send if sending else group.recv
            wait_work(op([probe], self.peer_rank, _TAG), deadline, group, self._poll)

    # -- initiator side ---------------------------------------------------------------
    def push(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> bool:
        buf = self._gather(plan.src_bases, plan.src_offs, plan.lens, plan.src_dev, plan.nbytes)
        msg = wire.Push(cache_id=remote.cache_id, epoch=remote.epoch, nbytes=plan.nbytes, via=VIA_COLLECTIVE,
                        arrays=[plan.dst_bases, plan.dst_offs, plan.lens])
        check_reply(link, link.rpc(msg, deadline))
        self._run(link, self._group().send([self._wire_view(buf)], self.peer_rank, _TAG), deadline, "send")
        check_reply(link, link.read_reply(deadline))
        return True

    def pull(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> None:
        buf, addr = staging_buffer(plan.nbytes, self.staging_dev)
        msg = wire.Pull(cache_id=remote.cache_id, epoch=remote.epoch, nbytes=plan.nbytes, via=VIA_COLLECTIVE,
                        arrays=[plan.src_bases, plan.src_offs, plan.lens])
        check_reply(link, link.rpc(msg, deadline))
        dev = self._wire_view(buf)
        self._run(link, self._group().recv([dev], self.peer_rank, _TAG), deadline, "recv")
        self._scatter(buf, dev, addr, plan.dst_bases, plan.dst_offs, plan.lens, plan.dst_dev)

    # -- server side (agent thread) -----------------------------------------------------
    def serve_push(self, bases: np.ndarray, offs: np.ndarray, lens: np.ndarray, nbytes: int, timeout_ms: int,
                   device: str = "cpu") -> None:
        """Receive a validated push into the cache runs ``(bases, offs, lens)`` on ``device``."""
        buf, addr = staging_buffer(nbytes, self.staging_dev)
        dev = self._wire_view(buf)
        group = self._group()
        wait_work(group.recv([dev], self.peer_rank, _TAG), time.monotonic() + timeout_ms / 1000.0, group,
                  self._poll)
        self._scatter(buf, dev, addr, bases, offs, lens, device)

    def serve_pull(self, bases: np.ndarray, offs: np.ndarray, lens: np.ndarray, nbytes: int, timeout_ms: int,
                   device: str = "cpu") -> None:
        """Send the cache runs ``(bases, offs, lens)`` on ``device`` of a validated pull."""
        buf = self._gather(bases, offs, lens, device, nbytes)
        group = self._group()
        wait_work(group.send([self._wire_view(buf)], self.peer_rank, _TAG),
                  time.monotonic() + timeout_ms / 1000.0, group, self._poll)

    # -- helpers ------------------------------------------------------------------------
    def _group(self) -> ProcessGroup:
        """The link's process group; a link closed under a transfer has none left."""
        group = self.group
        if group is None:
            fail(Fault.LINK_FAILED, f"the {self.name} process group of this link is closed")
        return group

    def _gather(self, bases: np.ndarray, offs: np.ndarray, lens: np.ndarray, device: str,
                nbytes: int) -> torch.Tensor:
        buf, addr = staging_buffer(nbytes, self.staging_dev)
        LocalTransport.copy(staging_plan(bases, offs, lens, addr, gather=True, half_dev=device,
                                         staging_dev=self.staging_dev))
        return buf

    def _scatter(self, buf: torch.Tensor, received: torch.Tensor, addr: int, bases: np.ndarray, offs: np.ndarray,
                 lens: np.ndarray, device: str) -> None:
        if received is not buf:
            buf.copy_(received)
        LocalTransport.copy(staging_plan(bases, offs, lens, addr, gather=False, half_dev=device,
                                         staging_dev=self.staging_dev))

    def _wire_view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf if self.wire_dev is None else buf.to(self.wire_dev)

    def _run(self, link: Channel, work: Work, deadline: float, what: str) -> None:
        try:
            wait_work(work, deadline, self.group, self._poll)
        except (RuntimeError, TimeoutError) as exc:  # torch reports collective timeouts and peer loss so
            link.mark_broken(f"{what} failed: {exc}")
            timeout = isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
            fail(Fault.TIMEOUT if timeout else Fault.LINK_FAILED,
                        f"collective {what} with cluster {link.remote_cluster_id} failed: {exc}")

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            abort_group(group, "link closed")
        self._store = None

