"""What ``ems-server`` counts for Prometheus (``--metrics-port``; docs/operations.md).

The store counts gets by tier, evictions and puts (its ``counters``, under its lock); the
tiers count their own faults; :class:`ServerMetrics` counts requests (latency by
operation, outcome) and refused connections.  :class:`DaemonCollector` reads all of them
when Prometheus scrapes, so serving a request costs one clock read and a short lock more.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Protocol, Tuple

from datadist.engine.exporter import MetricsServer, process_registry
from datadist.engine.metrics import OpCounts, cumulative

if TYPE_CHECKING:
    from .store import Store

__all__ = ["ServerMetrics", "DaemonCollector", "Endpoint", "Observed", "REFUSED_OUTCOMES", "health", "serve_metrics"]

log = logging.getLogger("ems.server")

#: Request outcomes that refuse the client (counted as refusals too).
REFUSED_OUTCOMES = ("auth", "version")


class Observed(Protocol):
    """What the families and the health check read of a daemon (``ems.server.daemon.Daemon``)."""

    @property
    def metrics(self) -> "ServerMetrics": ...

    @property
    def store(self) -> Optional[Store]: ...

    @property
    def stopped(self) -> threading.Event: ...

    def connections(self) -> int: ...


class ServerMetrics:
    """Requests by operation (latency histogram, outcomes) and refused connections by
    reason; any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Dict[str, OpCounts] = {}
        self._refused: Dict[str, int] = {}

    def request(self, op: str, outcome: str, start: float) -> None:
        """A request ``op`` begun at ``start`` (``time.monotonic``) ended with
        ``outcome`` (``ok``, an error kind, or ``disconnected``)."""
        seconds = time.monotonic() - start
        with self._lock:
            counts = self._requests.get(op)
            if counts is None:
                counts = self._requests[op] = OpCounts()
            if outcome != "ok":
                counts.failed[outcome] = counts.failed.get(outcome, 0) + 1
            counts.observe(seconds)

    def refused(self, reason: str) -> None:
        """A connection was refused before it was served (``max_connections``, ``bad_frame``)."""
        with self._lock:
            self._refused[reason] = self._refused.get(reason, 0) + 1

    def snapshot(self) -> Dict[str, Any]:
        """Requests as ``{op: {"outcomes": {outcome: n}, "count", "sum_seconds", "buckets"}}``
        and refusals by reason (those of :data:`REFUSED_OUTCOMES` included)."""
        with self._lock:
            requests = {op: counts.copy() for op, counts in self._requests.items()}
            refused = dict(self._refused)
        out: Dict[str, Any] = {}
        for op, counts in sorted(requests.items()):
            outcomes = dict(counts.failed, **({"ok": counts.ok} if counts.ok else {}))
            for reason in REFUSED_OUTCOMES:
                refused[reason] = refused.get(reason, 0) + counts.failed.get(reason, 0)
            out[op] = {"outcomes": outcomes, "count": sum(counts.buckets), "sum_seconds": counts.seconds,
                       "buckets": cumulative(counts.buckets)}
        return {"requests": out, "refusals": refused}


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class DaemonCollector:
    """A ``prometheus_client`` collector of one daemon's families (read at each scrape)."""

    def __init__(self, daemon: Observed) -> None:
        self._daemon = daemon

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        d = self._daemon
        served = d.metrics.snapshot()
        requests = CounterMetricFamily("ems_requests", "Requests by operation and outcome (ok, or the error "
                                       "kind answered)", labels=["operation", "outcome"])
        latency = HistogramMetricFamily("ems_request_seconds", "Request latency, from its arrival to its answer",
                                        labels=["operation"])
        for op, row in served["requests"].items():
            for outcome, n in sorted(row["outcomes"].items()):
                requests.add_metric([op, outcome], n)
            latency.add_metric([op], [(_le(le), n) for le, n in row["buckets"]], row["sum_seconds"])
        refusals = CounterMetricFamily("ems_refusals", "Connections and requests refused, by reason",
                                       labels=["reason"])
        for reason, n in sorted(served["refusals"].items()):
            refusals.add_metric([reason], n)
        connections = GaugeMetricFamily("ems_connections", "Client connections open")
        connections.add_metric([], d.connections())
        yield from (requests, latency, refusals, connections)
        store = d.store
        if store is not None:
            yield from _store_families(store, CounterMetricFamily, GaugeMetricFamily)


def _store_families(store: Any, counter: Any, gauge: Any) -> Iterator[Any]:
    stats = store.stats()
    tiers = store.tiers
    families: List[Any] = []
    for name, doc, key in (("ems_tier_hits", "Values a get found in the tier", "hits"),
                           ("ems_tier_misses", "Gets that looked in the tier and did not find the value", "misses"),
                           ("ems_tier_hit_bytes", "Bytes of the values a get found in the tier", "hit_bytes")):
        family = counter(name, doc, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier], stats[f"{tier}_{key}"])
        families.append(family)
    errors = counter("ems_tier_errors", "Faults of a tier below memory (a Redis tier's failed calls)",
                     labels=["tier"])
    for below in (store.disk, store.remote):
        if below is not None:
            errors.add_metric([below.name], below.stats().get("errors", 0))
    families.append(errors)
    for name, doc, key in (("ems_evictions", "Values evicted from memory (spilled to disk when there is one)",
                            "evictions"),
                           ("ems_spills", "Evicted values written to the disk tier", "spills"),
                           ("ems_corrupt_values", "Values dropped because they failed their checksum", "corrupt"),
                           ("ems_puts_committed", "Values committed (phase two of a put)", "committed"),
                           ("ems_puts_no_space", "Reservations refused: the pool was full of pinned values",
                            "no_space")):
        family = counter(name, doc)
        family.add_metric([], stats[key])
        families.append(family)
    pending = gauge("ems_puts_pending", "Two-phase puts reserved and not yet committed or aborted")
    pending.add_metric([], store.pending_puts())
    memory = gauge("ems_memory_bytes", "Shared memory of the pool: used, and the capacity", labels=["state"])
    memory.add_metric(["used"], stats["used"])
    memory.add_metric(["capacity"], stats["capacity"])
    values = gauge("ems_values", "Values held in memory")
    values.add_metric([], stats["values"])
    yield from (*families, pending, memory, values)


def health(daemon: Observed) -> Tuple[bool, str]:
    """Whether the daemon is ready (``/healthz``): it serves, and every tier it has
    answers (:meth:`~.tiers.base.Tier.health`); with a line per part."""
    store = daemon.store
    if store is None or daemon.stopped.is_set():
        return False, "not ready: the daemon is not serving"
    problems = [f"{tier.name}: {why}" for tier in (store.disk, store.remote)
                if tier is not None and (why := tier.health()) is not None]
    parts = ["memory"] + [t.name for t in (store.disk, store.remote) if t is not None]
    return (False, "not ready: " + "; ".join(problems)) if problems else (True, "ready: " + ", ".join(parts))


class Endpoint:
    """A daemon's families and health served over HTTP (:func:`serve_metrics`)."""

    def __init__(self, server: MetricsServer, registry: Any, collector: DaemonCollector) -> None:
        self.server = server
        self._registry = registry
        self._collector = collector

    def close(self) -> None:
        """Stop serving and forget the daemon's families (another daemon of this process
        may serve its own later)."""
        self.server.close()
        self._registry.unregister(self._collector)


def serve_metrics(daemon: Observed, address: str) -> Endpoint:
    """Serve ``daemon``'s families and health on ``[HOST:]PORT`` (host 0.0.0.0 by default).
    Raises ``ImportError`` without prometheus_client, ``ValueError`` for an address that
    cannot be listened on."""
    host, _, port = address.rpartition(":")
    registry = process_registry()
    try:
        server = MetricsServer(host or "0.0.0.0", int(port), registry, lambda: health(daemon))
    except (OSError, ValueError, OverflowError) as exc:
        raise ValueError(f"--metrics-port {address}: expected [HOST:]PORT this host can listen on ({exc})") from None
    collector = DaemonCollector(daemon)
    registry.register(collector)
    log.info("metrics at http://%s:%d/metrics", *server.address)
    return Endpoint(server, registry, collector)
