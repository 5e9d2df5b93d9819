"""The part of a vLLM KV connector that only routes: vLLM makes one connector object per
role, so each of ours holds a scheduler half or a worker half and forwards to it.

A worker half provides ``register(kv_caches)``, ``finished(finished_req_ids) -> (sent,
received, failed)``, ``take_load_errors()``, ``stats`` (what it did, for vLLM's logs and
``/metrics``; the connector class names its metrics in ``METRICS``) and ``close()``; a
scheduler half provides ``stats`` too (vLLM adds both up), and
``matched_tokens(request, num_computed_tokens)`` and ``after_alloc(request, blocks,
num_external_tokens)``.  Loads finish before their request is scheduled, so there is no
layer-wise wait, and saves (where a connector has them) run after the forward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Mapping, Optional, Protocol, TypeVar, Union

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                              KVConnectorTransferResults)

from .stats import ConnectorPromMetrics, ConnectorStats, MetricSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["SplitConnector", "SchedulerHalf", "WorkerHalf", "extra_int"]


def extra_int(connector: str, extra: Mapping[str, Any], key: str, default: int, low: int, high: int,
              unit: str = "") -> int:
    """``extra[key]`` of ``kv_connector_extra_config`` (``default`` when absent), an integer
    ``low..high``; else ``ValueError`` naming ``connector`` at startup: a value the engine
    would refuse mid-serving (inside vLLM's scheduler, ending the engine) is refused
    before serving."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{connector}: kv_connector_extra_config {key}={value!r} must be an integer "
                         f"{low}..{high}{unit}")
    return value


class WorkerHalf(Protocol):
    """What a worker-role connector forwards to."""

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None: ...

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(sent, received, failed) request ids since the last call."""
        ...

    def take_load_errors(self) -> set[int]: ...

    @property
    def stats(self) -> ConnectorStats: ...

    def close(self) -> None: ...


class SchedulerHalf(Protocol):
    """What a scheduler-role connector forwards to."""

    def matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]: ...

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None: ...

    @property
    def stats(self) -> ConnectorStats: ...


_S = TypeVar("_S", bound=SchedulerHalf)
_W = TypeVar("_W", bound=WorkerHalf)


# vLLM is not installed where mypy runs (ignore_missing_imports), so its base class is Any.
class SplitConnector(KVConnectorBase_V1, Generic[_S, _W]):  # type: ignore[misc]
    """Base of our connectors: ``_make_scheduler``/``_make_worker`` build the halves."""

    #: The statistics the worker half records, and their Prometheus metrics.
    METRICS: tuple[MetricSpec, ...] = ()

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler: Optional[_S] = None
        self._worker: Optional[_W] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config)
        else:
            self._worker = self._make_worker(vllm_config, kv_cache_config)

    def _make_scheduler(self, vllm_config: "VllmConfig") -> _S:
        raise NotImplementedError

    def _make_worker(self, vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"]) -> _W:
        raise NotImplementedError

    @property
    def _scheduler_half(self) -> _S:
        """The scheduler half (a connector of the scheduler role has one)."""
        if self._scheduler is None:
            raise RuntimeError(f"{type(self).__name__}: scheduler call on a connector of the worker role")
        return self._scheduler

    @property
    def _worker_half(self) -> _W:
        """The worker half (a connector of the worker role has one)."""
        if self._worker is None:
            raise RuntimeError(f"{type(self).__name__}: worker call on a connector of the scheduler role")
        return self._worker

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_half.register(kv_caches)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a request's blocks are all loaded before it is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # nothing moves layer by layer

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self._worker_half.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_half.take_load_errors()

    def get_kv_connector_stats(self) -> Optional[ConnectorStats]:
        half: Optional[Union[_S, _W]] = self._worker if self._worker is not None else self._scheduler
        return half.stats.take() if half is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> ConnectorStats:
        return ConnectorStats(data={k: list(v) for k, v in (data or {}).items()})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Optional[ConnectorPromMetrics]:
        if not cls.METRICS:
            return None
        return ConnectorPromMetrics(cls.METRICS, vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler_half.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler_half.after_alloc(request, blocks, num_external_tokens)
