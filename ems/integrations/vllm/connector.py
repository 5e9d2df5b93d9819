"""``EmsConnector``: vLLM's v1 KV connector for a prefix cache on the ems pool.

Every full block of a prompt is saved to the pool under a key derived from the token ids
alone: chained BLAKE2b hashes of the prompt's blocks (``ems.keys.token_chain_hashes``, the
SDK's token form), in a namespace of the model and the cache layout.  vLLM's own block
hashes are seeded per process unless ``PYTHONHASHSEED`` is set, so they cannot be shared
between instances; these can.  A new request asks the pool (``exists``) how many of its
leading blocks beyond vLLM's own prefix-cache hits the pool holds, and loads them before
it is scheduled (``async_load``), so another instance, or this one after its own cache
evicted them, skips their prefill.  Saves run after each step's forward (``async_save``);
a finished request's blocks are freed once its saves are done.  ``take_events`` reports
the blocks saved and those found evicted as vLLM's KV events (see ``events``).

Configuration (``kv_connector_extra_config``): ``server`` (the pool address; default as the
SDK: ``$EMS_SERVER`` or the node's daemon), ``timeout_ms`` (load and save, 5000),
``lookup_timeout_ms`` (the scheduler's ``exists``, 1000: a slow pool reads as a miss; both
1..3600000),
``model_id`` (the key namespace; default the model's name and a digest of the layout).
Use ``kv_role="kv_both"``.  vLLM frees a preempted request's blocks at once: before the
next forward may overwrite them, the worker waits for that request's saves still running
(``handle_preemptions``; at most ``timeout_ms``).  A load that fails is reported through
``get_block_ids_with_load_errors``; ``kv_load_failure_policy="recompute"`` makes vLLM
compute those blocks instead of failing the request.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from datadist.integrations.vllm.base import SplitConnector, extra_int
from datadist.integrations.vllm.stats import EMS_METRICS, ConnectorStats

from ... import CcKvOption
from ...keys import token_chain_hashes
from .events import PoolEvents
from .worker import BlockJob, EmsWorker, PoolIdentity, Settings, init_pool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["EmsConnector", "EmsConnectorMetadata", "EmsHandshake"]

log = logging.getLogger("ems.vllm")


# vLLM is not installed where mypy runs (ignore_missing_imports), so its base classes are Any.
@dataclass
class EmsHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells its scheduler: the pool identity its cache was registered under."""

    identity: PoolIdentity


@dataclass
class EmsConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM's base is Any (above)
    loads: dict[str, BlockJob] = field(default_factory=dict)
    saves: dict[str, list[BlockJob]] = field(default_factory=dict)
    #: requests vLLM preempted since the last step: it freed their blocks, which this
    #: step's forward may write for other requests (``handle_preemptions``)
    preempted: set[str] = field(default_factory=set)


def _settings(vllm_config: "VllmConfig") -> Settings:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    known = {"server", "timeout_ms", "lookup_timeout_ms", "model_id"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"EmsConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
    # From 1 ms to an hour: the pool client reads 0 as no deadline at all (a hung pool would
    # hold the engine loop) and refuses a negative one.
    return Settings(server=extra.get("server"),
                    timeout_ms=extra_int("EmsConnector", extra, "timeout_ms", 5000, 1, 3_600_000, " (milliseconds)"),
                    lookup_timeout_ms=extra_int("EmsConnector", extra, "lookup_timeout_ms", 1000, 1, 3_600_000,
                                                " (milliseconds)"),
                    model_id=extra.get("model_id"))


class EmsConnector(SplitConnector["_Scheduler", EmsWorker]):
    """vLLM KV connector: a prefix cache on the ems pool (see the module docstring)."""

    METRICS = EMS_METRICS

    def _make_scheduler(self, vllm_config: "VllmConfig") -> "_Scheduler":
        return _Scheduler(vllm_config, _settings(vllm_config))

    def _make_worker(self, vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"]) -> EmsWorker:
        return EmsWorker(vllm_config, _settings(vllm_config), kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later miss

    # -- worker side ---------------------------------------------------------------------
    def _meta(self) -> EmsConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, EmsConnectorMetadata)
        return meta

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker_half.load(self._meta().loads)

    def wait_for_save(self) -> None:
        self._worker_half.save(self._meta().saves)  # whole blocks, after the step's forward

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward that may overwrite a preempted request's freed blocks, let
        the saves still copying them finish (a save the pool committed afterwards would
        hold another request's bytes under this prompt's keys)."""
        if isinstance(kv_connector_metadata, EmsConnectorMetadata) and kv_connector_metadata.preempted:
            self._worker_half.wait_saves(kv_connector_metadata.preempted)

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        if self._worker is None or self._worker.identity is None:
            return None
        return EmsHandshake(identity=self._worker.identity)

    # -- scheduler side ------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        first = metadata.get(0)
        if isinstance(first, EmsHandshake):
            self._scheduler_half.connect(first.identity)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler_half.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_half.loading.difference_update(connector_output.finished_recving or ())
        self._scheduler_half.confirm_saves(connector_output.finished_sending or ())

    def take_events(self) -> Iterable[Any]:
        return self._scheduler_half.events.take()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._scheduler_half.finished(request), None


@dataclass
class _Req:
    """A request the scheduler half follows: its prompt's block hashes, its blocks, and
    how many leading blocks are in the pool already (loaded, hit, or saved)."""

    hashes: list[int]
    tokens: np.ndarray
    blocks: list[int] = field(default_factory=list)
    saved: int = 0
    save_ranges: list[tuple[int, int]] = field(default_factory=list)  # blocks [start, end) sent to save
    has_saves: bool = False
    counted: bool = False  # its lookup is in the stats (vLLM may ask again before it schedules it)


class _Scheduler:
    def __init__(self, vllm_config: "VllmConfig", settings: Settings) -> None:
        self.settings = settings
        self.block_size = vllm_config.cache_config.block_size
        self._cc: Any = None
        self.stats = ConnectorStats()  # pool hits and misses of the lookups
        self._reqs: dict[str, _Req] = {}
        self._pending: dict[str, int] = {}      # request id -> first pool block of a planned load
        self._loads: dict[str, BlockJob] = {}
        self.loading: set[str] = set()          # loads the workers have not reported done
        self._saving: dict[str, _Req] = {}      # finished requests whose saves are not confirmed
        self.events = PoolEvents(self.block_size)

    def connect(self, identity: PoolIdentity) -> None:
        try:
            self._cc = init_pool(identity, self.settings)
        except Exception as exc:  # no pool: the connector saves and finds nothing, vLLM serves on
            log.warning("ems pool unavailable (%s); prefix lookups will miss", exc)

    def _req(self, request: "Request") -> _Req:
        req = self._reqs.get(request.request_id)
        if req is None:
            tokens = np.asarray(request.prompt_token_ids or (), dtype=np.int64)
            req = _Req(hashes=token_chain_hashes(tokens, self.block_size), tokens=tokens)
            self._reqs[request.request_id] = req
        return req

    def matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        req = self._req(request)
        start = num_computed_tokens // self.block_size
        req.saved = max(req.saved, start)  # vLLM's own hits: computed before, saved then
        if self._cc is None or start >= len(req.hashes):
            return 0, False
        option = CcKvOption(timeout=self.settings.lookup_timeout_ms)
        hits = self._cc.exists(hashes=req.hashes[start:], option=option).success
        if start + hits < len(req.hashes):
            self.events.missing(req.hashes[start + hits])
        if not req.counted:
            req.counted = True
            self.stats.record("hit_blocks", hits)
            self.stats.record("miss_blocks", len(req.hashes) - start - hits)
        tokens = min((start + hits) * self.block_size, len(req.tokens) - 1)  # vLLM computes >= 1 token
        if tokens <= num_computed_tokens:
            return 0, False
        self._pending[request.request_id] = start
        return tokens - num_computed_tokens, True

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        start = self._pending.pop(request.request_id, None)
        if start is None or num_external_tokens <= 0:
            return
        req = self._req(request)
        count = -(-(start * self.block_size + num_external_tokens) // self.block_size) - start
        block_ids = blocks.get_block_ids()[0]
        self._loads[request.request_id] = BlockJob(list(block_ids[start:start + count]),
                                                   req.hashes[start:start + count])
        self.loading.add(request.request_id)
        req.saved = start + count

    def build_meta(self, out: "SchedulerOutput") -> EmsConnectorMetadata:
        meta = EmsConnectorMetadata(loads=self._loads, preempted=set(getattr(out, "preempted_req_ids", None) or ()))
        self._loads = {}
        for req_id in meta.preempted:
            self._pending.pop(req_id, None)
            req = self._reqs.get(req_id)
            if req is not None:
                req.blocks = []  # freed; it gets blocks anew when it resumes
        for new in out.scheduled_new_reqs:
            req = self._reqs.get(new.req_id)
            if req is not None:
                req.blocks = list(new.block_ids[0])
                self._plan_save(new.req_id, req, new.num_computed_tokens + out.num_scheduled_tokens.get(new.req_id, 0),
                                meta)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._reqs.get(req_id)
            if req is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    req.blocks = list(new_blocks[0])
                else:
                    req.blocks.extend(new_blocks[0])
            self._plan_save(req_id, req, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0), meta)
        return meta

    def _plan_save(self, req_id: str, req: _Req, computed: int, meta: EmsConnectorMetadata) -> None:
        """Save the prompt blocks this step completes."""
        full = min(min(computed, len(req.tokens)) // self.block_size, len(req.hashes), len(req.blocks))
        if self._cc is None or full <= req.saved:
            return
        meta.saves.setdefault(req_id, []).append(BlockJob(req.blocks[req.saved:full], req.hashes[req.saved:full]))
        req.save_ranges.append((req.saved, full))
        req.saved = full
        req.has_saves = True

    def finished(self, request: "Request") -> bool:
        """Whether the request's blocks must outlive it: saves or a load still running."""
        req = self._reqs.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        if request.request_id in self._loads:  # planned, never sent: nothing will touch the blocks
            del self._loads[request.request_id]
            self.loading.discard(request.request_id)
            return False
        if req is not None and req.has_saves:
            self._saving[request.request_id] = req
        return request.request_id in self.loading or (req is not None and req.has_saves)

    def confirm_saves(self, finished_sending: Iterable[str]) -> None:
        """The workers finished the saves of ``finished_sending``: their blocks are stored."""
        size = self.block_size
        for req_id in finished_sending:
            req = self._saving.pop(req_id, None)
            if req is None:
                continue
            for start, end in req.save_ranges:
                self.events.stored(req.hashes[start:end], req.hashes[start - 1] if start else None,
                                   req.tokens[start * size:end * size].tolist())
