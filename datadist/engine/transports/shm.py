"""Same-host links: one-sided copies straight into or out of the peer's memory.

Pool caches live in the peer's memfd arenas, which this process mapped at link time, so a
transfer is a local memcpy of the rebased plan.  Device caches of a CUDA peer are reached
the same way through CUDA IPC: the peer's device pool is opened at link time, other
device allocations (registered tensors) when a lookup first names them, and the rebased
plan runs as device copies.  Caches over user host memory that the peer registered are
reached by cross-memory attach (``process_vm_writev/readv``).  The peer's threads take no
part in any of these.  When none works for a cache (cross-memory attach not permitted, no
CUDA here, IPC refused), the link's socket transport moves it instead.  Raw peer addresses
(``ANY_CACHE``) are copied here only when they lie in a mapped pool; otherwise they go
over the socket, where the peer checks them against its caches: cross-memory attach
could write anywhere in the peer.

With ``transfer_checksum`` (``summed``) every copy is checked against the owner's reading
of the same runs (:func:`.checked.one_sided`): a host copy sums the bytes as it copies them
(:func:`.native.copy_plan_stream`); a device copy and a cross-memory copy are summed by
their local half afterwards (for a pull, the destination as the copy left it).
"""
from __future__ import annotations

import errno
import functools
import logging
from typing import Callable, Iterable, NoReturn, Optional

from ..errors import Fault, fail
from .. import cuda, executor, native
from ..checksum import StreamSum
from ..layout import Plan, sliced
from ..memory import PeerArena
from .base import Channel, ANY_CACHE, RemoteCache, Step, Transport
from .checked import one_sided, sum_half, sum_request
from .local import host_side

__all__ = ["ShmTransport"]

log = logging.getLogger("datadist")

#: Bytes of one slice of a checked copy: large enough for the copy's threads and
#: streaming stores (plans of 8 MiB and more), small enough that the owner sums one slice
#: while the next is copied (2 MiB slices, copied without either, ran slower; measured
#: with ``python -m datadist.bench --workload inorder-256k --transport shm --checksum``).
SLICE = 16 << 20


def _device_name() -> str:
    """This process's CUDA device: a peer region is mapped here only through it
    (:meth:`cuda.PeerDeviceRegion.open` needs it, and it stays set once set)."""
    gpu = cuda.active()
    assert gpu is not None, "a peer device region is mapped, but no CUDA device is active"
    return gpu.name


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, pid: int, arenas: list[PeerArena], cma_ok: bool, fallback: Transport,
                 device_pool: Iterable[cuda.IpcRegion] = (), cuda_here: bool = False, summed: bool = False) -> None:
        self.pid = pid
        #: Whether copies are checked against the owner's checksum (``transfer_checksum``).
        self.summed = summed
        self.arenas = arenas
        self.cma_ok = cma_ok
        self.fallback = fallback
        self._told_fallback = False
        self._cuda_here = cuda_here
        #: Peer device allocations opened here, by (peer base, IPC handle); None: refused.
        self._device: dict[tuple[int, bytes], Optional[cuda.PeerDeviceRegion]] = {}
        for region in device_pool:
            self._open(region)

    def _open(self, region: cuda.IpcRegion) -> Optional[cuda.PeerDeviceRegion]:
        key = (region.base, region.handle)
        if key not in self._device:
            opened = None
            if self._cuda_here:
                try:
                    opened = cuda.PeerDeviceRegion.open(region)
                except cuda.CudaError as exc:
                    log.info("CUDA IPC open of a peer allocation (pid %d) failed: %s; it goes over the socket",
                             self.pid, exc)
            self._device[key] = opened
        return self._device[key]

    def _delta(self, remote: RemoteCache) -> tuple[Optional[int], bool]:
        """Offset from the peer's address of ``remote`` to where it is mapped here, and
        whether that mapping is device memory; (None, False) if it is not mapped."""
        lo, span = remote.span
        for arena in self.arenas:
            local = arena.translate(lo, span)
            if local is not None:
                return local - lo, False
        # The regions the lookup names first: memory freed and allocated again at the same
        # address comes with a new handle, and an older mapping of it must not match.
        named = [self._open(region) for region in remote.ipc]
        for region in named + list(self._device.values()):
            local = region.translate(lo, span) if region is not None else None
            if local is not None:
                return local - lo, True
        return None, False

    def prepare(self, link: Channel, plan: Plan, remote: RemoteCache, push: bool) -> Step:
        """The copy of ``plan`` as a :data:`Step`: into or out of a mapped peer region it
        is the rebased plan bound to the executor, run again without looking at the
        mappings (they live as long as the link, and the link's lock keeps a step from
        running once it closes); otherwise cross-memory attach or the socket, decided
        per run.  A copy still running at the deadline stops (between chunks of at most
        64 MiB) with ``TIMEOUT``; the destination's bytes are then undefined."""
        delta, on_device = self._delta(remote)
        if delta is None:
            return functools.partial(self._unmapped, link, plan, remote, push)
        peer_dev = _device_name() if on_device else "cpu"
        moved = (plan.rebase(dst_delta=delta).on(plan.src_dev, peer_dev) if push
                 else plan.rebase(src_delta=delta).on(peer_dev, plan.dst_dev))
        copy = executor.bind(moved)
        if self.summed:
            return self._checked(link, plan, moved, copy, remote, push)

        def step(deadline: float) -> bool:
            try:
                copy(native.ms_until(deadline))
            except TimeoutError:
                _copy_timed_out(link, plan, push)
            link.check_peer()
            return not push

        return step

    def _checked(self, link: Channel, plan: Plan, moved: Plan, copy: Callable[[int], int], remote: RemoteCache,
                 push: bool) -> Step:
        """The step of a mapped copy checked against the owner's checksums: a host copy in
        slices of ``SLICE`` bytes, each summed as it is copied (the owner sums one while
        the next is copied, :func:`one_sided`); a device copy whole, summed after it."""
        if not moved.on_host:
            def device_copy(deadline: float) -> int:
                try:
                    copy(native.ms_until(deadline))
                except TimeoutError:
                    _copy_timed_out(link, plan, push)
                return _local_sum(plan, push)

            copies: list[Callable[[float], int]] = [device_copy]
            frames, sizes = [sum_request(plan, remote, push)], [plan.nbytes]
        else:
            halves = sliced(plan, SLICE)
            copies = [functools.partial(_copy_summed, part) for part in sliced(moved, SLICE)]
            frames, sizes = [sum_request(half, remote, push) for half in halves], [half.nbytes for half in halves]

        def step(deadline: float) -> bool:
            one_sided(link, frames, sizes, push, copies, deadline)
            link.check_peer()
            return not push

        return step

    def _unmapped(self, link: Channel, plan: Plan, remote: RemoteCache, write: bool, deadline: float) -> bool:
        """Move a plan whose peer side is not mapped here; True if it went through the
        peer's agent (socket fallback)."""
        if self.cma_ok and remote.cache_id != ANY_CACHE and remote.device == "cpu":
            if self.summed:
                one_sided(link, [sum_request(plan, remote, write)], [plan.nbytes], write,
                          [functools.partial(self._cma_summed, link, plan, write)], deadline)
            else:
                self._cma(link, plan, write, deadline)
            link.check_peer()
            return not write
        if not self._told_fallback:
            self._told_fallback = True
            log.info("link to cluster %d: memory outside the peer's mapped pools (%s) goes over the socket",
                     link.remote_cluster_id,
                     "device memory that CUDA IPC could not open" if remote.device != "cpu" else
                     "registered caches" + ("" if self.cma_ok else "; cross-memory attach is not permitted"))
        if write:
            return self.fallback.push(link, plan, remote, deadline)
        self.fallback.pull(link, plan, remote, deadline)
        return True

    def _cma(self, link: Channel, plan: Plan, write: bool, deadline: float) -> None:
        """Move ``plan`` by cross-memory attach (``write``: a push)."""
        try:
            with host_side(plan, local_is_src=write) as host_plan:
                native.cma_plan(self.pid, host_plan, write=write, timeout_ms=native.ms_until(deadline))
        except TimeoutError:
            _copy_timed_out(link, plan, write)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                link.mark_broken(f"peer process {self.pid} is gone")
                fail(Fault.LINK_FAILED,
                     f"link to cluster {link.remote_cluster_id} is broken: peer process {self.pid} exited")
            fail(Fault.FAILED, f"cross-memory copy with cluster {link.remote_cluster_id} (pid {self.pid}) failed: {exc}")

    def _cma_summed(self, link: Channel, plan: Plan, write: bool, deadline: float) -> int:
        self._cma(link, plan, write, deadline)
        return _local_sum(plan, write)

    def push(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> bool:
        return self.prepare(link, plan, remote, True)(deadline)

    def pull(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> None:
        self.prepare(link, plan, remote, False)(deadline)

    def close(self) -> None:
        for arena in self.arenas:
            arena.close()
        self.arenas = []
        for region in self._device.values():
            if region is not None:
                region.close()
        self._device = {}


def _copy_timed_out(link: Channel, plan: Plan, write: bool) -> NoReturn:
    fail(Fault.TIMEOUT, f"{'push to' if write else 'pull from'} cluster {link.remote_cluster_id} "
                        f"({plan.nbytes} bytes) did not finish within sync_kv_timeout ({link.timeout_ms} ms); "
                        "the destination's bytes are undefined")


def _copy_summed(plan: Plan, deadline: float) -> int:
    """Copy a host plan, summing it as it is copied (the bytes are in registers anyway)."""
    summed = StreamSum(plan.nbytes)
    native.copy_plan_stream(plan, summed)
    return summed.checksum()


def _local_sum(plan: Plan, push: bool) -> int:
    """The checksum of this process's half of ``plan`` (a push's source, a pull's
    destination): the bytes a copy that could not sum them moved."""
    if push:
        return sum_half(plan.src_bases, plan.src_offs, plan.lens, plan.src_dev)
    return sum_half(plan.dst_bases, plan.dst_offs, plan.lens, plan.dst_dev)
