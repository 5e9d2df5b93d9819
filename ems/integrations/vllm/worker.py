"""The worker half of ``EmsConnector``: vLLM's KV cache registered with the ems pool.

Each block region of vLLM's cache (see :mod:`datadist.integrations.paged`) is registered
as a ``[num_blocks, 1, 1, block_bytes]`` tensor, so one pool key holds one block of every
layer and a block id is a slot: the hash form's ``slot_mapping`` is the block list,
``offsets`` all 1.  Loads and saves are ``async_load``/``async_save``; their futures are
polled once a step, never waited on.
"""
from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from datadist.integrations.paged import PagedLayout, block_views, paged_layout
from datadist.integrations.vllm.stats import ConnectorStats

from ... import CcConfig_v1, CcKvOption, Ems, EmsConfig, EmsException
from ...future import CcFuture

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["Settings", "BlockJob", "PoolIdentity", "EmsWorker", "init_pool"]

log = logging.getLogger("ems.vllm")

#: How much longer than a save's own deadline a preemption waits for it (the deadline is
#: checked between the steps of a save, so it may overrun by one of them).
_SAVE_GRACE_S = 5.0


@dataclass(frozen=True)
class Settings:
    """The connector's configuration (``kv_connector_extra_config``)."""

    server: Optional[str]
    timeout_ms: int
    lookup_timeout_ms: int
    model_id: Optional[str]


@dataclass
class BlockJob:
    """Blocks of one request to load or save, with their keys (chained prefix hashes)."""

    block_ids: list[int]
    hashes: list[int]


@dataclass(frozen=True)
class PoolIdentity:
    """What makes a pool key mean the same bytes in every process: the model and the
    cache layout (in ``model_id``), the parallel rank and the device."""

    model_id: str
    kvcache_type: str
    device_id: int
    tp_world_size: int
    rank_in_tp_group: int

    def cc_config(self) -> CcConfig_v1:
        return CcConfig_v1(rank_id=self.rank_in_tp_group, device_id=self.device_id, model_id=self.model_id,
                           tp_world_size=self.tp_world_size, rank_in_tp_group=self.rank_in_tp_group,
                           llm_engine="vllm", kvcache_type=self.kvcache_type)


def init_pool(identity: PoolIdentity, settings: Settings) -> Any:
    """``Ems.init`` for ``identity`` (a no-op when this process did it already) and the
    ContextCaching object."""
    Ems.init(EmsConfig(cc_config=identity.cc_config(), server=settings.server))
    return Ems.get_cc()


def pool_model_id(model: str, layout: PagedLayout, block_size: int) -> str:
    """The model's name with a digest of the cache layout: two instances share keys only
    when a block means the same bytes in both."""
    shape = f"{layout.describe()}|bs{block_size}"
    name = re.sub(r"[^0-9A-Za-z._-]+", "_", model).strip("_")[-80:] or "model"
    return f"{name}-{hashlib.blake2b(shape.encode(), digest_size=6).hexdigest()}"


@dataclass
class _Saving:
    futures: list[CcFuture] = field(default_factory=list)


class EmsWorker:
    def __init__(self, vllm_config: "VllmConfig", settings: Settings,
                 kv_cache_config: Optional["KVCacheConfig"]) -> None:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)

        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.identity: Optional[PoolIdentity] = None
        self._cc: Any = None
        self.stats = ConnectorStats()
        self._block_bytes = 0  # one block of every layer
        self._loads: dict[str, tuple[Any, list[int], float]] = {}
        self._saves: dict[str, _Saving] = {}
        self._finished: set[str] = set()
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self._errors: set[int] = set()

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        cfg = self.kv_cache_config
        if cfg is None or len(cfg.kv_cache_groups) != 1:
            raise NotImplementedError("EmsConnector moves one KV cache group (hybrid models are not supported yet)")
        layout = paged_layout(kv_caches, cfg.num_blocks)
        self._block_bytes = len(layout.addrs) * layout.block_bytes
        block_size = self.vllm_config.cache_config.block_size
        model_id = self.settings.model_id or pool_model_id(self.vllm_config.model_config.model, layout, block_size)
        device_type, _, index = layout.device.partition(":")
        self.identity = PoolIdentity(model_id=model_id, kvcache_type="MHA" if layout.tensors_per_layer == 2 else "MLA",
                                     device_id=int(index or 0), tp_world_size=self.tp_size,
                                     rank_in_tp_group=self.tp_rank)
        self._cc = init_pool(self.identity, self.settings)
        views = block_views(kv_caches, layout)
        self._cc.register_kvcache([[v.view(layout.num_blocks, 1, 1, layout.block_bytes) for v in layer]
                                   for layer in views])
        log.info("ems connector: %d layers x %d tensors of %d blocks x %d bytes registered as %s",
                 layout.num_layers, layout.tensors_per_layer, layout.num_blocks, layout.block_bytes, model_id)

    def _option(self) -> CcKvOption:
        return CcKvOption(timeout=self.settings.timeout_ms)

    def load(self, jobs: Mapping[str, BlockJob]) -> None:
        for req_id, job in jobs.items():
            try:
                future = self._cc.async_load(slot_mapping=job.block_ids, hashes=job.hashes,
                                             offsets=[1] * len(job.block_ids), option=self._option())
            except EmsException as exc:
                log.warning("request %s: load of %d blocks refused: %s", req_id, len(job.block_ids), exc)
                self._fail(req_id, job.block_ids)
                continue
            self._loads[req_id] = (future, job.block_ids, time.perf_counter())

    def save(self, jobs: Mapping[str, list[BlockJob]]) -> None:
        for req_id, batch in jobs.items():
            saving = self._saves.setdefault(req_id, _Saving())
            for job in batch:
                try:
                    saving.futures.append(self._cc.async_save(slot_mapping=job.block_ids, hashes=job.hashes,
                                                              offsets=[1] * len(job.block_ids),
                                                              option=self._option()))
                    self.stats.record("bytes_saved", len(job.block_ids) * self._block_bytes)
                except EmsException as exc:  # a save that fails is a later miss, nothing worse
                    log.warning("request %s: save of %d blocks refused: %s", req_id, len(job.block_ids), exc)

    def wait_saves(self, req_ids: Iterable[str]) -> None:
        """Wait until the saves of ``req_ids`` have stopped reading their blocks (vLLM
        preempted them and freed the blocks, which the next forward may overwrite).  A
        save copies in the pool client's threads and then commits, with no way to stop it
        in between, so it is waited for: each ends by its own deadline (``timeout_ms``
        after it was sent), so this waits at most that long, and a save that fails is a
        later miss."""
        limit = time.monotonic() + self.settings.timeout_ms / 1000.0 + _SAVE_GRACE_S
        for req_id in req_ids:
            saving = self._saves.get(req_id)
            for future in saving.futures if saving is not None else ():
                try:
                    future.result(max(0.0, limit - time.monotonic()))
                except EmsException as exc:
                    if future.done():
                        log.info("request %s: save failed (%s); a later miss", req_id, exc)
                    else:
                        log.error("request %s: preempted while a save of its blocks runs past its deadline; the "
                                  "pool may hold other bytes under its keys", req_id)

    def _fail(self, req_id: str, blocks: list[int]) -> None:
        self.stats.record("num_failed_loads")
        self._received.add(req_id)
        self._failed.add(req_id)
        self._errors.update(blocks)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(requests whose saves are all done, loads done, loads failed) since the last call."""
        for req_id, (future, blocks, started) in list(self._loads.items()):
            if not self._cc.is_ready(future):
                continue
            del self._loads[req_id]
            try:
                result = self._cc.get_result(future)
                loaded = result.success
            except EmsException as exc:
                log.warning("request %s: load failed: %s", req_id, exc)
                loaded = 0
            # Polled once a step: the duration is up to one step long.
            self.stats.record("load_duration", time.perf_counter() - started)
            self.stats.record("bytes_loaded", loaded * self._block_bytes)
            if loaded < len(blocks):  # blocks the pool no longer had, or that failed their checksum
                self._fail(req_id, blocks[loaded:])
            else:
                self._received.add(req_id)
        self._finished |= finished_req_ids
        sent = set()
        for req_id, saving in list(self._saves.items()):
            saving.futures = [f for f in saving.futures if not self._cc.is_ready(f)]
            if not saving.futures and req_id in self._finished:
                sent.add(req_id)
                del self._saves[req_id]
        self._finished &= set(self._saves)
        received, failed = self._received, self._failed
        self._received, self._failed = set(), set()
        return sent, received, failed

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        """Saves still running finish in the pool client's threads; nothing to release here
        (the process's ``Ems`` client outlives the connector)."""
