"""``CacheManager``: the public cache calls.  Each call validates at the edge (the
contract's exceptions, nothing changed on failure), builds one coalesced plan with
:mod:`datadist.engine.layout`, and hands it to the link's transport or the local copier.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Hashable, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np

from ._arrivals import Arrival, arrival_of
from ._handles import TransferHandle, call_ident, prepared_transfer
from ._objects import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, MemInfo,
                       as_tensor_addrs)
from ._status import LLMStatusCode, api_class, raise_error
from ._tensors import tensor_at
from ._types import Memtype, Placement
from .engine import cuda, npu
from .engine.arrivals import ArrivalBoard, Notice
from .engine.core import Engine
from .engine.layout import Plan, plan_units
from .engine.memo import remember
from .engine.link import Link
from .engine.memory import PoolExhausted
from .engine.prepared import PreparedTransfer
from .engine.registry import Registry
from ._planning import cache_ref, local_side, peer_cluster
from .engine.planning import (Side, blocks_plan, int_arg, layer_range_arg, row_plan, row_size_arg,
                              tensors_per_layer)
from ._transfer_async import CacheTask, LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig, start_task
from .engine.transports.base import RemoteCache
from .engine.transports.local import LocalTransport

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CacheManager"]

#: Call shapes of push_blocks / pull_blocks whose prepared transfers a cache manager keeps.
_SHAPES = 128

#: Registered memory: its int addresses, the tensors among ``addrs``, its device, its IPC regions.
_Memory = Tuple[List[int], Tuple["torch.Tensor", ...], str, Tuple[cuda.IpcRegion, ...]]


class _Owner(Protocol):
    """What the cache manager needs of its ``LLMDataDist``."""

    def _engine_or_raise(self) -> Engine: ...


def _cuda_or_host(ints: List[int], engine_device: str) -> str:
    """Where bare addresses on a CUDA engine are: all device memory or all host memory."""
    on_gpu = [cuda.is_device_memory(a) for a in ints]
    if any(on_gpu) and not all(on_gpu):
        raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                    f"addrs mixes CUDA device memory (addrs[{on_gpu.index(True)}]) and host memory "
                    f"(addrs[{on_gpu.index(False)}])")
    return engine_device if all(on_gpu) else "cpu"


def _memory_device(ints: List[int], tensors: Tuple["torch.Tensor", ...], desc: CacheDesc,
                   engine_device: str) -> str:
    """The device registered memory is on: the tensors' one device, else what the engine
    says of bare addresses (see :func:`_registered_memory`)."""
    kinds = sorted({str(t.device) for t in tensors})
    if len(kinds) > 1:
        raise_error(LLMStatusCode.LLM_PARAM_INVALID, f"addrs holds tensors on several devices: {kinds}")
    if kinds:
        return kinds[0]
    if engine_device.startswith("npu") and desc.placement == Placement.DEVICE:
        return engine_device  # resolved to their allocations by _registered_memory
    if engine_device.startswith("cuda"):
        return _cuda_or_host(ints, engine_device)
    return "cpu"


def _registered_memory(addrs: Sequence[Any], desc: CacheDesc, engine_device: str) -> _Memory:
    """``as_tensor_addrs`` plus where the memory is: ``(ints, tensors, device, ipc)``.

    Tensors say where they live.  Int addresses are asked of the CUDA driver on a CUDA
    engine (so host memory registered with the default ``Placement.DEVICE``, as code
    written for CPU machines does, still works); on an NPU engine with ``Placement.DEVICE``
    they are NPU memory, each resolved to the torch_npu allocation it lies in
    (:func:`~datadist.engine.npu.adopt`; one outside every allocation of the engine's
    device is ``LLM_PARAM_INVALID``); elsewhere they are host memory.  Device memory of
    another kind than the engine's is refused rather than misread as host memory."""
    ints, tensors = as_tensor_addrs(addrs, desc)
    device = _memory_device(ints, tensors, desc, engine_device)
    if device == "cpu":
        return ints, tensors, device, ()
    kind = device.partition(":")[0]
    if kind not in ("cuda", "npu") or kind != engine_device.partition(":")[0]:
        raise_error(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                    f"addrs are memory of {device}; this engine moves host memory"
                    + (f" and {engine_device} memory" if engine_device != "cpu" else
                       " only: init it with the device_type of that memory (or 'auto' where torch sees it)"))
    if kind == "npu":
        for t in tensors:
            npu.track(t)
        if not tensors:  # bare addresses: the allocations they lie in, kept while registered
            tensors = tuple(npu.adopt(ints, desc.size, device))
        return ints, tensors, device, ()
    return ints, tensors, device, cuda.export_regions(ints, desc.size)


def _check_kind(cache: Cache, blocks: bool) -> None:
    """The deallocate call matches the kind of ``cache`` (CANN's check and words)."""
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a Cache, got {type(cache).__name__}")
    if cache.is_blocks_cache != blocks:
        raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                    "param check failed, cache should be blocks cache: use deallocate_cache for it" if blocks else
                    "param check failed, cache can not be blocks cache: use deallocate_blocks_cache for it")


def _forget_addrs(cache: Cache) -> None:
    """A freed manager cache reports no tensor addresses, as in CANN (a cache of
    ``Cache.create_cpu_cache``, which no manager frees, keeps them)."""
    if cache.cache_id >= 0:
        cache._tensor_addrs = ()


@api_class
class CacheManager:
    """Allocates, registers and moves caches for one engine (``LLMDataDist.cache_manager``)."""

    def __init__(self, owner: _Owner) -> None:
        self._owner = owner  # the LLMDataDist, for its engine and role
        # What the engine's boards call for each user callback (to remove it again).
        self._callbacks: Dict[tuple[int, Callable[[Arrival], None]], Callable[[Notice], None]] = {}
        #: Prepared transfers of recent push_blocks / pull_blocks call shapes (:func:`call_ident`).
        self._shapes: Dict[Tuple[Hashable, ...], PreparedTransfer] = {}

    @property
    def _engine(self) -> Engine:
        return self._owner._engine_or_raise()

    @property
    def _registry(self) -> Registry:
        return self._engine.live_registry()

    # -- allocation ----------------------------------------------------------------------
    def _new_cache(self, desc: CacheDesc, addrs: List[int], *, blocks: bool, release: Optional[Callable[[], None]],
                   keys: Sequence[CacheKey] = (), blocks_key: Optional[BlocksCacheKey] = None, registered: bool,
                   handle: Any = None, device: str = "cpu", ipc: Tuple[cuda.IpcRegion, ...] = ()) -> Cache:
        rec = self._registry.add(dict(num_tensors=desc.num_tensors, tensor_size=desc.size, batch_size=desc.batch_size,
                                      is_blocks=blocks, dtype=desc.data_type.name,
                                      addrs=np.asarray(addrs, dtype=np.uint64), release=release, device=device,
                                      ipc=ipc),
                                 keys=keys, blocks_key=blocks_key)
        return Cache(cache_id=rec.cache_id, cache_desc=desc, tensor_addrs=addrs, is_blocks_cache=blocks,
                     is_registered=registered, handle=handle)

    def _allocate(self, desc: CacheDesc, *, blocks: bool, keys: Sequence[CacheKey] = (),
                  blocks_key: Optional[BlocksCacheKey] = None) -> Cache:
        if not isinstance(desc, CacheDesc):
            raise TypeError(f"cache_desc must be a CacheDesc, got {type(desc).__name__}")
        eng = self._engine
        host = desc.placement == Placement.HOST
        pool = eng.pools.get("host" if host else "device")
        if pool is None:  # LLM_PARAM_INVALID with CANN's words, as CANN reports it
            opt = "host_mem_pool_cfg" if host else "mem_pool_cfg"
            raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                        "you should config memory pool firstly and then set placement that matches it: "
                        f"allocating a {desc.placement.name} cache needs a pool, set LLMConfig.{opt}")
        try:
            base = pool.alloc(desc.size * desc.num_tensors)
        except PoolExhausted as exc:
            code = LLMStatusCode.LLM_OUT_OF_MEMORY if host else LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
            raise_error(code, f"cannot allocate {desc.num_tensors} x {desc.size} bytes: {exc}")
        addrs = [base + i * desc.size for i in range(desc.num_tensors)]
        try:
            return self._new_cache(desc, addrs, blocks=blocks, release=lambda: pool.free(base), keys=keys,
                                   blocks_key=blocks_key, registered=False, device=pool.arena.device,
                                   ipc=pool.arena.regions)
        except BaseException:
            pool.free(base)
            raise

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        """Allocate pool memory for a cache; row i is named by ``cache_keys[i]``."""
        keys = self._check_keys(cache_keys, cache_desc)
        return self._allocate(cache_desc, blocks=False, keys=keys)

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: Optional[BlocksCacheKey] = None) -> Cache:
        """Allocate a blocks (paged) cache; ``batch_size`` counts blocks."""
        self._check_blocks_key(blocks_cache_key)
        return self._allocate(cache_desc, blocks=True, blocks_key=blocks_cache_key)

    def register_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any], cache_keys: Sequence[CacheKey] = (),
                       remote_accessible: Optional[bool] = None) -> Cache:
        """Register caller-owned memory (int addresses or tensors) as a cache."""
        keys = self._check_keys(cache_keys, cache_desc)
        ints, tensors, device, ipc = _registered_memory(addrs, cache_desc, self._engine.device)
        return self._new_cache(cache_desc, ints, blocks=False, release=None, keys=keys, registered=True,
                               handle=tensors or None, device=device, ipc=ipc)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any],
                              blocks_cache_key: Optional[BlocksCacheKey] = None,
                              remote_accessible: Optional[bool] = None) -> Cache:
        """Register caller-owned memory as a blocks cache."""
        self._check_blocks_key(blocks_cache_key)
        ints, tensors, device, ipc = _registered_memory(addrs, cache_desc, self._engine.device)
        return self._new_cache(cache_desc, ints, blocks=True, release=None, blocks_key=blocks_cache_key,
                               registered=True, handle=tensors or None, device=device, ipc=ipc)

    @staticmethod
    def _check_keys(keys: Sequence[CacheKey], desc: CacheDesc) -> List[CacheKey]:
        if not isinstance(desc, CacheDesc):
            raise TypeError(f"cache_desc must be a CacheDesc, got {type(desc).__name__}")
        if not isinstance(keys, (list, tuple)):
            raise TypeError(f"cache_keys must be a list of CacheKey, got {type(keys).__name__}")
        for i, k in enumerate(keys):
            if not isinstance(k, CacheKey):
                raise TypeError(f"cache_keys[{i}] must be a CacheKey, got {type(k).__name__}")
        if len(keys) > desc.batch_size:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                        f"{len(keys)} cache_keys for a cache of batch size {desc.batch_size}")
        return list(keys)

    @staticmethod
    def _check_blocks_key(key: Optional[BlocksCacheKey]) -> None:
        if key is not None and not isinstance(key, BlocksCacheKey):
            raise TypeError(f"blocks_cache_key must be a BlocksCacheKey, got {type(key).__name__}")

    def _free(self, cache: Cache) -> None:
        if not isinstance(cache, Cache):
            raise TypeError(f"cache must be a Cache, got {type(cache).__name__}")
        rec = self._registry.remove(cache.cache_id)
        if rec is not None:
            self._engine.give_back(rec.addrs.shape[0] * rec.tensor_size, rec.release)
        for key in [k for k in self._callbacks if k[0] == cache.cache_id]:
            del self._callbacks[key]
        self._forget_shapes(cache.cache_id)

    def _forget_shapes(self, cache_id: int) -> None:
        """Release the prepared transfers of a cache that is gone (they would only fail
        now), with their plans."""
        for ident in [i for i in self._shapes if i[2] == cache_id]:
            prepared = self._shapes.pop(ident, None)
            if prepared is not None:
                prepared.release()

    def deallocate_cache(self, cache: Cache) -> None:
        """Free a cache from ``allocate_cache``; no-op if already freed.  As in CANN, a
        blocks cache is ``LLM_PARAM_INVALID`` (``deallocate_blocks_cache`` frees it) and
        the freed cache's ``tensor_addrs`` is empty afterwards."""
        _check_kind(cache, blocks=False)
        self._free(cache)
        _forget_addrs(cache)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Free a cache from ``allocate_blocks_cache``; no-op if already freed.  As in
        CANN, a cache that is not a blocks cache is ``LLM_PARAM_INVALID`` and the freed
        cache's ``tensor_addrs`` is empty afterwards."""
        _check_kind(cache, blocks=True)
        self._free(cache)
        _forget_addrs(cache)

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a registered cache (the memory stays the caller's); returns once no peer
        copies into or out of it any more."""
        rec = self._registry.remove(int_arg("cache_id", cache_id))
        if rec is not None:
            self._engine.give_back(rec.addrs.shape[0] * rec.tensor_size, rec.release)
        self._forget_shapes(cache_id)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Drop a key (no-op if absent)."""
        if not isinstance(cache_key, CacheKey):
            raise TypeError(f"cache_key must be a CacheKey, got {type(cache_key).__name__}")
        self._registry.remove_key(cache_key)

    def remap_registered_memory(self, mem_infos: Union[MemInfo, List[MemInfo]]) -> None:
        """Tell the engine that registered device memory was remapped after a memory fault
        (CANN: after an HBM error the driver backs the same virtual range with new pages).

        ``mem_infos``: a :class:`MemInfo` or a list of them, each ``MEM_TYPE_DEVICE``, with a
        non-zero ``addr`` and ``size > 0``, lying inside memory registered with this engine.
        Caches keep their virtual addresses, and host and CUDA mappings follow the backing
        pages, so once checked nothing needs re-registering: peers keep reading and writing
        the same ranges.  Raises ``LLM_PARAM_INVALID`` naming the entry otherwise.
        """
        infos = [mem_infos] if isinstance(mem_infos, MemInfo) else mem_infos
        if not isinstance(infos, list):
            raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                        f"mem_infos must be a MemInfo or a list of MemInfo, got {type(mem_infos).__name__}")
        spans = [(int(a), int(a) + rec.tensor_size) for rec in self._registry.all() if rec.release is None
                 for a in rec.addrs]
        for i, info in enumerate(infos):
            if not isinstance(info, MemInfo):
                raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                            f"mem_infos[{i}] must be a MemInfo, got {type(info).__name__}")
            if info.mem_type != Memtype.MEM_TYPE_DEVICE:
                raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                            f"mem_infos[{i}].mem_type = {info.mem_type!r}: only Memtype.MEM_TYPE_DEVICE is remapped")
            if info.addr == 0 or info.size <= 0:
                raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                            f"mem_infos[{i}] = {info!r}: addr must be non-zero and size > 0")
            end = info.addr + info.size
            if not any(lo <= info.addr and end <= hi for lo, hi in spans):
                raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                            f"mem_infos[{i}] = {info!r} does not lie inside memory registered with this engine")

    def get_cache_tensors(self, cache: Cache) -> List["torch.Tensor"]:
        """Torch tensors viewing the cache memory, one per tensor, on the device the
        memory is on (``cuda:N`` for device caches of a CUDA engine, else CPU)."""
        side = self._local(cache)
        d = cache.cache_desc
        return [tensor_at(a, d.shape, d.data_type, side.device) for a in cache.tensor_addrs]

    # -- local side of transfers --------------------------------------------------------
    def _local(self, cache: Cache) -> Side:
        return local_side(self._registry, cache)

    # -- pulls ---------------------------------------------------------------------------
    def pull_cache(self, cache_key: Union[CacheKey, CacheKeyByIdAndIndex], cache: Cache, batch_index: int = 0,
                   size: int = -1, *, src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
                   tensor_num_per_layer: int = 2) -> None:
        """Pull one remote row (by ``CacheKey`` or ``CacheKeyByIdAndIndex``) into row
        ``batch_index`` of ``cache``; ``size`` bytes per tensor (-1: the whole row)."""
        cluster = peer_cluster(cache_key, "cache_key", (CacheKey, CacheKeyByIdAndIndex))
        dst = self._local(cache)
        row = int_arg("batch_index", batch_index)
        if not 0 <= row < dst.batch_size:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID, f"batch_index = {row} outside [0, {dst.batch_size})")
        int_arg("size", size)
        link = self._engine.get_link(cluster)

        def planner(remote: RemoteCache) -> Plan:
            src = Side.of_remote(remote)
            n = row_size_arg(size, src, dst)
            return row_plan(src, remote.row, dst, row, n, 0, tensor_num_per_layer, src_layer_range, dst_layer_range)

        ref = cache_ref(cache_key)
        link.transfer(ref, planner, push=False, op="pull_cache")
        if isinstance(cache_key, CacheKey):
            link.release_key(ref)

    def pull_blocks(self, src_cache_key: Union[BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex], dst_cache: Cache,
                    src_blocks: Sequence[int] = (), dst_blocks: Sequence[int] = (), *,
                    src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
                    tensor_num_per_layer: int = 2) -> None:
        """Pull remote blocks ``src_blocks[i] -> dst_blocks[i]``; with a row key and
        ``src_blocks=()`` chunk i of the remote row goes to ``dst_blocks[i]``."""
        self._shaped(False, src_cache_key, dst_cache, src_layer_range, dst_layer_range,
                     tensor_num_per_layer).run(src_blocks, dst_blocks)

    def prepare_pull_blocks(self, src_cache_key: Union[BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex],
                            dst_cache: Cache, src_blocks: Optional[Sequence[int]] = None,
                            dst_blocks: Optional[Sequence[int]] = None, *, src_layer_range: Optional[range] = None,
                            dst_layer_range: Optional[range] = None, tensor_num_per_layer: int = 2) -> TransferHandle:
        """A :class:`~datadist.TransferHandle` for ``pull_blocks`` calls with these keys,
        cache and layer ranges: checked now (and, with block lists, looked up and planned
        now); ``handle.run(src_blocks, dst_blocks)`` then moves blocks.  Not in CANN's API."""
        return self._prepared(False, src_cache_key, dst_cache, src_blocks, dst_blocks, src_layer_range,
                              dst_layer_range, tensor_num_per_layer)

    # -- pushes --------------------------------------------------------------------------
    def push_cache(self, dst_cache_key: Union[CacheKeyByIdAndIndex, CacheKey], src_cache: Cache,
                   src_batch_index: int = 0, src_layer_range: Optional[range] = None,
                   dst_layer_range: Optional[range] = None, size: int = -1, tensor_num_per_layer: int = 2) -> None:
        """Push row ``src_batch_index`` of ``src_cache`` into the remote row the key names."""
        cluster = peer_cluster(dst_cache_key, "dst_cache_key", (CacheKeyByIdAndIndex, CacheKey))
        src = self._local(src_cache)
        row = int_arg("src_batch_index", src_batch_index)
        if not 0 <= row < src.batch_size:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID, f"src_batch_index = {row} outside [0, {src.batch_size})")
        if int_arg("size", size) != -1:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID, f"push_cache supports only size=-1, got {size}")
        link = self._engine.get_link(cluster)

        def planner(remote: RemoteCache) -> Plan:
            dst = Side.of_remote(remote)
            n = row_size_arg(-1, src, dst)
            return row_plan(src, row, dst, remote.row, n, 0, tensor_num_per_layer, src_layer_range, dst_layer_range,
                             same_range=True)

        link.transfer(cache_ref(dst_cache_key), planner, push=True, op="push_cache")

    def push_blocks(self, dst_cache_key: Union[BlocksCacheKey, CacheKeyByIdAndIndex], src_cache: Cache,
                    src_blocks: Sequence[int] = (), dst_blocks: Sequence[int] = (),
                    src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
                    tensor_num_per_layer: int = 2) -> None:
        """Push local blocks ``src_blocks[i]`` into remote blocks ``dst_blocks[i]``."""
        self._shaped(True, dst_cache_key, src_cache, src_layer_range, dst_layer_range,
                     tensor_num_per_layer).run(src_blocks, dst_blocks)

    def prepare_push_blocks(self, dst_cache_key: Union[BlocksCacheKey, CacheKeyByIdAndIndex], src_cache: Cache,
                            src_blocks: Optional[Sequence[int]] = None, dst_blocks: Optional[Sequence[int]] = None,
                            src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
                            tensor_num_per_layer: int = 2) -> TransferHandle:
        """A :class:`~datadist.TransferHandle` for ``push_blocks`` calls with these keys,
        cache and layer ranges: checked now (and, with block lists, looked up and planned
        now); ``handle.run(src_blocks, dst_blocks)`` then moves blocks.  Not in CANN's API."""
        return self._prepared(True, dst_cache_key, src_cache, src_blocks, dst_blocks, src_layer_range,
                              dst_layer_range, tensor_num_per_layer)

    def _prepared(self, push: bool, peer_key: Any, cache: Cache, src_blocks: Optional[Sequence[int]],
                  dst_blocks: Optional[Sequence[int]], src_layer_range: Optional[range],
                  dst_layer_range: Optional[range], tensor_num_per_layer: int) -> TransferHandle:
        handle = self._new_handle(push, peer_key, cache, src_layer_range, dst_layer_range, tensor_num_per_layer)
        if (src_blocks is None) != (dst_blocks is None):
            raise TypeError("give both src_blocks and dst_blocks, or neither")
        if src_blocks is not None and dst_blocks is not None:
            handle.prepare(src_blocks, dst_blocks)
        return handle

    def _shaped(self, push: bool, peer_key: Any, cache: Cache, src_layer_range: Optional[range],
                dst_layer_range: Optional[range], tensor_num_per_layer: int) -> PreparedTransfer:
        """The prepared transfer a ``push_blocks`` / ``pull_blocks`` call runs through: the
        one kept for its shape, else a new one (kept if the shape can be; at most
        :data:`_SHAPES` of them, the oldest dropped first: a thread still running one
        finishes with it)."""
        ident = call_ident(push, peer_key, cache, src_layer_range, dst_layer_range, tensor_num_per_layer)
        shapes = self._shapes
        if ident is not None:
            known = shapes.get(ident)
            if known is not None:
                return known
        prepared = prepared_transfer(self._link_of, self._live_registry, push, peer_key, cache, src_layer_range,
                                     dst_layer_range, tensor_num_per_layer)
        if ident is not None:
            remember(shapes, ident, prepared, _SHAPES)
        return prepared

    def _new_handle(self, push: bool, peer_key: Any, cache: Cache, src_layer_range: Optional[range],
                    dst_layer_range: Optional[range], tensor_num_per_layer: int) -> TransferHandle:
        return TransferHandle(self._link_of, self._live_registry, push, peer_key, cache, src_layer_range,
                              dst_layer_range, tensor_num_per_layer)

    def _link_of(self, cluster: int) -> Link:
        """The link to ``cluster`` of the engine running when asked (a finalized one's
        errors are the contract's)."""
        return self._engine.get_link(cluster)

    def _live_registry(self) -> Registry:
        return self._registry

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[Union[TransferConfig, TransferWithCacheKeyConfig]],
                             src_block_indices: Optional[Sequence[int]] = None,
                             dst_block_indices: Optional[Sequence[int]] = None,
                             dst_block_memory_size: Optional[int] = None) -> CacheTask:
        """Push ``src_cache`` layer by layer, each layer once ``layer_synchronizer`` reports
        it computed, to every destination of ``transfer_configs`` (``TransferConfig`` or
        ``TransferWithCacheKeyConfig``); blocks ``src_block_indices[j] ->
        dst_block_indices[j]``, ``dst_block_memory_size`` bytes each (0 or None: the source's).

        Returns at once with a :class:`CacheTask`; see :mod:`datadist._transfer_async`.
        Every argument is checked first and nothing starts if one is wrong: ``TypeError``,
        ``LLM_PARAM_INVALID``, ``LLM_KV_CACHE_NOT_EXIST`` (unknown
        source cache), ``LLM_NOT_YET_LINK`` (a destination cluster not linked)."""

        src = self._local(src_cache)
        eng = self._engine
        return start_task(eng.get_link, src, src_cache.is_blocks_cache, lambda: self._local(src_cache),
                          layer_synchronizer, transfer_configs, src_block_indices, dst_block_indices,
                          dst_block_memory_size)

    # -- arrivals (receiver side) ------------------------------------------------------
    def watch_arrivals(self, cache: Cache) -> None:
        """Keep arrival notices for ``cache`` from now on: every later push into it (any
        transport, any peer) is recorded for ``wait_arrival`` and the callbacks.  Call it
        before the peer pushes (e.g. right after allocating the blocks for a request);
        pushes into caches nobody watches cost no notice at all.  Idempotent."""
        self._board(cache)

    def _board(self, cache: Cache) -> ArrivalBoard:
        self._local(cache)
        board = self._registry.watch(cache.cache_id)
        if board is None:
            raise_error(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {cache.cache_id} is not known to this engine")
        return board

    def wait_arrival(self, cache: Cache, layer_range: Optional[range] = None, timeout_in_millis: Optional[int] = None,
                     *, tensor_num_per_layer: int = 2, src_cluster_id: Optional[int] = None) -> List[Arrival]:
        """Wait until pushes into ``cache`` (from ``src_cluster_id``, if given) have covered
        every layer of ``layer_range`` (None: all layers); returns their notices.

        Each notice is consumed by the wait that returns it, so a receiver that waits per
        layer sees each push once.  Raises ``LLM_TIMEOUT`` after ``timeout_in_millis``
        (None: no deadline), the push's own status if a covering push failed, and
        ``LLM_LINK_FAILED`` when the link to ``src_cluster_id`` breaks meanwhile.  Notices
        are kept from ``watch_arrivals`` on (this call watches too), so waiting after the
        push is fine once the cache is watched."""
        board = self._board(cache)
        n = tensors_per_layer(tensor_num_per_layer, board.num_tensors, layer_range is not None)
        layers = layer_range_arg("layer_range", layer_range, board.num_tensors // n)
        if timeout_in_millis is not None:
            timeout_in_millis = int_arg("timeout_in_millis", timeout_in_millis)
            if timeout_in_millis < 0:
                raise_error(LLMStatusCode.LLM_PARAM_INVALID, f"timeout_in_millis = {timeout_in_millis} must be >= 0")
        if src_cluster_id is not None:
            src_cluster_id = int_arg("src_cluster_id", src_cluster_id)
        deadline = None if timeout_in_millis is None else time.monotonic() + timeout_in_millis / 1000.0
        notices = board.wait(range(layers.start * n, layers.stop * n), deadline, src_cluster_id)
        return [arrival_of(notice) for notice in notices]

    def add_arrival_callback(self, cache: Cache, callback: Callable[[Arrival], None]) -> None:
        """Call ``callback(arrival)`` for every push notice into ``cache`` (on the engine's
        agent thread: keep it short, do not block in it).  Notices still go to waits."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        board = self._board(cache)
        key = (cache.cache_id, callback)
        if key not in self._callbacks:
            self._callbacks[key] = lambda notice: callback(arrival_of(notice))
        board.add_callback(self._callbacks[key])

    def remove_arrival_callback(self, cache: Cache, callback: Callable[[Arrival], None]) -> None:
        """Stop calling ``callback`` for ``cache`` (no-op if it was not registered)."""
        board = self._board(cache)
        wrapper = self._callbacks.pop((cache.cache_id, callback), None)
        if wrapper is not None:
            board.remove_callback(wrapper)

    # -- local copies --------------------------------------------------------------------
    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: Optional[int] = None) -> None:
        """Copy ``size`` bytes per tensor from ``offset`` of row ``src_batch_index`` of
        ``src`` to the same place of row ``dst_batch_index`` of ``dst`` (same process)."""
        d, s = self._local(dst), self._local(src)
        di, si = int_arg("dst_batch_index", dst_batch_index), int_arg("src_batch_index", src_batch_index)
        off = int_arg("offset", offset)
        if not 0 <= di < d.batch_size or not 0 <= si < s.batch_size:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                        f"dst_batch_index = {di} / src_batch_index = {si} outside [0, {d.batch_size}) / [0, {s.batch_size})")
        if not 0 <= off < min(d.stride, s.stride):
            raise_error(LLMStatusCode.LLM_PARAM_INVALID, f"offset = {off} outside [0, {min(d.stride, s.stride)})")
        if s.num_tensors != d.num_tensors:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                        f"source has {s.num_tensors} tensors, destination {d.num_tensors}")
        n = row_size_arg(size, s, d, off)
        LocalTransport.copy(plan_units(s.addrs, [si * s.stride + off], d.addrs, [di * d.stride + off],
                                       n).on(s.device, d.device))

    def copy_blocks(self, cache: Cache, copy_block_info: Dict[int, List[int]]) -> None:
        """Copy block ``src`` to every block in ``copy_block_info[src]``, in every tensor."""
        side = self._local(cache)
        if not isinstance(copy_block_info, dict):
            raise TypeError(f"copy_block_info must be a dict, got {type(copy_block_info).__name__}")
        srcs, dsts = [], []
        for s, targets in copy_block_info.items():
            if not isinstance(targets, (list, tuple)):
                raise TypeError(f"copy_block_info[{s}] must be a list of block indices")
            srcs.extend([s] * len(targets))
            dsts.extend(targets)
        plan = blocks_plan(side, side, srcs, dsts, 1, None, None)
        LocalTransport.copy(plan)

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: Dict[int, int]) -> None:
        """Copy blocks between two local blocks caches (e.g. HOST <-> DEVICE)."""
        s, d = self._local(src_cache), self._local(dst_cache)
        if not isinstance(src_to_dst, dict):
            raise TypeError(f"src_to_dst must be a dict, got {type(src_to_dst).__name__}")
        if s.num_tensors != d.num_tensors:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                        f"source has {s.num_tensors} tensors, destination {d.num_tensors}")
        LocalTransport.copy(blocks_plan(s, d, list(src_to_dst.keys()), list(src_to_dst.values()), 1, None, None))

