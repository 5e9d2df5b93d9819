"""Connector statistics for vLLM's logs and ``/metrics``.

A worker records what it did into a :class:`ConnectorStats` (one list of observations
per key); vLLM takes it every step (``get_kv_connector_stats``), adds the workers' up in
the scheduler process (``aggregate``), prints ``reduce()`` in its periodic log line and
hands the data to the connector's :class:`ConnectorPromMetrics`, which ``/metrics`` shows.

:data:`DATADIST_METRICS` and :data:`EMS_METRICS` name each key's Prometheus metric: a
histogram for timings and sizes, a counter (incremented by each observation) for events.
DatadistConnector's names follow NixlConnector's (``vllm:nixl_xfer_time_seconds`` ->
``vllm:datadist_xfer_time_seconds``, ``..._bytes_transferred``, ``..._num_failed_transfers``,
``..._num_kv_expired_reqs``) so dashboards carry over.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["MetricSpec", "ConnectorStats", "ConnectorPromMetrics", "DATADIST_METRICS", "EMS_METRICS"]


@dataclass(frozen=True)
class MetricSpec:
    """One statistic: its key, Prometheus name and help, and histogram buckets (None: a counter)."""

    key: str
    name: str
    help: str
    buckets: Optional[Sequence[float]] = None


_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BYTES = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB
_BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

DATADIST_METRICS = (
    MetricSpec("transfer_duration", "vllm:datadist_xfer_time_seconds",
               "Seconds per DatadistConnector pull of one request's blocks", _SECONDS),
    MetricSpec("bytes_transferred", "vllm:datadist_bytes_transferred",
               "Bytes per DatadistConnector pull of one request's blocks", _BYTES),
    MetricSpec("num_blocks", "vllm:datadist_num_blocks", "Blocks per DatadistConnector pull", _BLOCKS),
    MetricSpec("num_failed_transfers", "vllm:datadist_num_failed_transfers",
               "DatadistConnector pulls that failed (link, transfer or peer failure)"),
    MetricSpec("num_kv_expired_reqs", "vllm:datadist_num_kv_expired_reqs",
               "Requests whose held blocks a prefill instance freed when their lease ran out "
               "(counted on the prefill instance)"),
    MetricSpec("num_lease_renewals", "vllm:datadist_num_lease_renewals",
               "Lease renewals a decode instance sent for pulls still queued"),
)

EMS_METRICS = (
    MetricSpec("load_duration", "vllm:ems_load_time_seconds", "Seconds per EmsConnector load of a request's blocks",
               _SECONDS),
    MetricSpec("hit_blocks", "vllm:ems_hit_blocks", "Prompt blocks found in the ems pool"),
    MetricSpec("miss_blocks", "vllm:ems_miss_blocks", "Prompt blocks looked up in the ems pool and not found"),
    MetricSpec("bytes_loaded", "vllm:ems_bytes_loaded", "Bytes loaded from the ems pool"),
    MetricSpec("bytes_saved", "vllm:ems_bytes_saved", "Bytes saved into the ems pool"),
    MetricSpec("num_failed_loads", "vllm:ems_num_failed_loads", "EmsConnector loads that failed"),
)


@dataclass
class ConnectorStats(KVConnectorStats):  # type: ignore[misc]  # vLLM's base is Any to mypy
    """Observations per key since the last ``take``; ``data`` stays plain lists (vLLM
    serializes it from the worker to the scheduler process)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[float]] = {}

    def record(self, key: str, value: float = 1) -> None:
        self.data.setdefault(key, []).append(value)

    def take(self) -> Optional["ConnectorStats"]:
        """The observations so far (None when there are none), and start over."""
        if self.is_empty():
            return None
        taken = copy.copy(self)
        self.reset()
        return taken

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, values in (other.data or {}).items():
            self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Per key: the count of observations, and the sum where it is not a pure count."""
        out: dict[str, int | float] = {}
        for key, values in sorted(self.data.items()):
            out[f"{key} n"] = len(values)
            if any(v != 1 for v in values):
                out[f"{key} sum"] = round(float(sum(values)), 6)
        return out


class ConnectorPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # vLLM's base is Any to mypy
    """Prometheus metrics of ``specs``, one child per engine (vLLM's labels)."""

    def __init__(self, specs: Sequence[MetricSpec], vllm_config: Any, metric_types: Mapping[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, dict[int, Any]] = {}
        self._histogram: dict[str, bool] = {}
        for spec in specs:
            if spec.buckets is not None:
                metric = self._histogram_cls(name=spec.name, documentation=spec.help, buckets=list(spec.buckets),
                                             labelnames=labelnames)
            else:
                metric = self._counter_cls(name=spec.name, documentation=spec.help, labelnames=labelnames)
            self._metrics[spec.key] = {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}
            self._histogram[spec.key] = spec.buckets is not None

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, values in transfer_stats_data.items():
            per_engine = self._metrics.get(key)
            if per_engine is None or engine_idx not in per_engine:
                continue
            metric = per_engine[engine_idx]
            for value in values:
                if self._histogram[key]:
                    metric.observe(value)
                else:
                    metric.inc(value)
