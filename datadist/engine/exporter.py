"""Prometheus exposition: one registry per process, an HTTP endpoint serving ``/metrics``
and ``/healthz``, and the engine's families built from its snapshot.

``prometheus_client`` is optional (``pip install 'datadist[metrics]'``): it is imported
only here, and only when an endpoint or a collector is asked for, so an engine without it
still counts (``LLMDataDist.metrics()``).  Families are built when Prometheus scrapes,
from the same snapshot the dict view returns, so a transfer costs no more with an
endpoint than without one.  ``ems-server`` serves its own families through
:class:`MetricsServer` as well.
"""
from __future__ import annotations

import importlib
import logging
import socketserver
import threading
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

__all__ = ["MissingPackage", "MetricsServer", "Health", "prometheus", "process_registry", "engine_families",
           "EngineCollector", "Exposure", "serve_engine"]

log = logging.getLogger("datadist")

#: A health check: (ready, text for the operator).
Health = Callable[[], Tuple[bool, str]]
#: A source of engine snapshots (``Engine.snapshot``).
Snapshot = Callable[[], Dict[str, Any]]


class MissingPackage(ImportError):
    """``prometheus_client`` is not installed and something needs it."""


def prometheus(what: str) -> ModuleType:
    """The ``prometheus_client`` module, or :class:`MissingPackage` saying that ``what``
    needs it and how to install it."""
    try:
        return importlib.import_module("prometheus_client")
    except ImportError:
        raise MissingPackage(f"{what} needs the prometheus_client package, which is not installed: "
                             "pip install prometheus_client (or the package's 'metrics' extra)") from None


_registry_lock = threading.Lock()
_registry: Any = None


def process_registry() -> Any:
    """The process's ``prometheus_client.CollectorRegistry`` (made on first use): every
    endpoint of this process serves it."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = prometheus("a metrics endpoint").CollectorRegistry(auto_describe=True)
        return _registry


# ----------------------------------------------------------------------------- the engine's families

def _labels(cluster: str, *values: object) -> List[str]:
    return [cluster, *(str(v) for v in values)]


def engine_families(snap: Dict[str, Any]) -> Iterator[Any]:
    """The Prometheus families of one engine snapshot (``Engine.snapshot``); the table of
    docs/operations.md lists them."""
    core = importlib.import_module("prometheus_client.core")
    cluster = str(snap["cluster_id"])
    transfers = core.CounterMetricFamily("datadist_transfers", "Transfers by operation, transport and outcome "
                                         "(status code name)", labels=["cluster", "operation", "transport", "outcome"])
    moved = core.CounterMetricFamily("datadist_transfer_bytes", "Bytes moved by transfers that went through",
                                     labels=["cluster", "operation", "transport"])
    for row in snap["transfers"]:
        transfers.add_metric(_labels(cluster, row["operation"], row["transport"], row["outcome"]), row["count"])
        if row["bytes"]:
            moved.add_metric(_labels(cluster, row["operation"], row["transport"]), row["bytes"])
    latency = core.HistogramMetricFamily("datadist_transfer_seconds", "Transfer latency, from the call to its "
                                         "outcome", labels=["cluster", "operation", "transport"])
    for row in snap["latency"]:
        buckets = [("+Inf" if le == float("inf") else repr(le), n) for le, n in row["buckets"]]
        latency.add_metric(_labels(cluster, row["operation"], row["transport"]), buckets, row["sum_seconds"])
    timeouts = core.CounterMetricFamily("datadist_timeouts", "Transfers that ended with LLM_TIMEOUT",
                                        labels=["cluster", "operation"])
    for op, n in sorted(snap["timeouts"].items()):
        timeouts.add_metric(_labels(cluster, op), n)
    yield from (transfers, moved, latency, timeouts)
    yield from _link_families(core, cluster, snap)


def _link_families(core: ModuleType, cluster: str, snap: Dict[str, Any]) -> Iterator[Any]:
    links = snap["links"]
    up = core.GaugeMetricFamily("datadist_links_up", "Links ready for transfers", labels=["cluster"])
    up.add_metric([cluster], links["up"])
    attempts = core.CounterMetricFamily("datadist_link_attempts", "Links this engine dialled, by outcome",
                                        labels=["cluster", "outcome"])
    for outcome, n in sorted(links["attempts"].items()):
        attempts.add_metric([cluster, outcome], n)
    failures = core.CounterMetricFamily("datadist_link_failures", "Links that broke (peer gone, stream lost)",
                                        labels=["cluster"])
    failures.add_metric([cluster], links["failures"])
    relinks = core.CounterMetricFamily("datadist_relinks", "Links made to a cluster linked before",
                                       labels=["cluster"])
    relinks.add_metric([cluster], links["relinks"])
    pool = core.GaugeMetricFamily("datadist_pool_bytes", "Pool memory by pool (host, device) and state "
                                  "(used, free)", labels=["cluster", "pool", "state"])
    for name, sizes in sorted(snap["pools"].items()):
        pool.add_metric([cluster, name, "used"], sizes["used_bytes"])
        pool.add_metric([cluster, name, "free"], sizes["free_bytes"])
    queue = core.GaugeMetricFamily("datadist_agent_queue_depth", "Work waiting for the agent thread: calls "
                                   "handed to it, connections in their handshake", labels=["cluster", "queue"])
    queue.add_metric([cluster, "calls"], snap["agent"]["pending_calls"])
    queue.add_metric([cluster, "handshakes"], snap["agent"]["pending_handshakes"])
    handed_off = core.GaugeMetricFamily("datadist_agent_handed_off", "Transfers served off the agent thread "
                                        "(a push's payload still arriving, a pull's answer larger than the "
                                        "free send buffer)", labels=["cluster"])
    handed_off.add_metric([cluster], snap["agent"]["handed_off"])
    yield from (up, attempts, failures, relinks, pool, queue, handed_off)


class EngineCollector:
    """A ``prometheus_client`` collector of the engines of this process that asked for it
    (in practice one: one initialized ``LLMDataDist`` per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: Dict[int, Snapshot] = {}

    def add(self, key: int, source: Snapshot) -> None:
        with self._lock:
            self._sources[key] = source

    def remove(self, key: int) -> None:
        with self._lock:
            self._sources.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sources)

    def collect(self) -> Iterable[Any]:
        with self._lock:
            sources = list(self._sources.values())
        for source in sources:
            yield from engine_families(source())


# ----------------------------------------------------------------------------- the endpoint

class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
        """Scrapes are not worth a line each on stderr."""


class MetricsServer:
    """An HTTP endpoint in a thread: ``/metrics`` (prometheus_client's exposition of
    ``registry``) and ``/healthz`` (200 with ``health``'s text while it says ready, else
    503).  Binds at once (``OSError`` when the address is taken); ``close`` stops it."""

    def __init__(self, host: str, port: int, registry: Any, health: Health) -> None:
        client = prometheus("a metrics endpoint")
        self._metrics_app = client.make_wsgi_app(registry)
        self._health = health
        self._server = make_server(host, port, self._app, server_class=_Server, handler_class=_QuietHandler)
        self.address: Tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"metrics-{self.address[1]}", daemon=True)
        self._thread.start()

    def _app(self, environ: Dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            try:
                ready, text = self._health()
            except Exception as exc:  # a check that fails says so: not ready
                ready, text = False, f"health check failed: {exc!r}"
            start_response("200 OK" if ready else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8")])
            return [text.encode() + b"\n"]
        if path in ("/metrics", "/"):
            return self._metrics_app(environ, start_response)  # type: ignore[no-any-return]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"/metrics or /healthz\n"]

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5.0)
        self._server.server_close()


# ----------------------------------------------------------------------------- engines' endpoints

_engines_lock = threading.Lock()
_collector: Optional[EngineCollector] = None
_servers: Dict[Tuple[str, int], Tuple[MetricsServer, set[int]]] = {}


def _engines_health() -> Tuple[bool, str]:
    collector = _collector
    live = len(collector) if collector is not None else 0
    return live > 0, f"{live} engine(s) initialized" if live else "no engine initialized"


class Exposure:
    """An engine exposed on an endpoint (:func:`serve_engine`): ``address`` it is served
    at, ``close`` stops exposing it (the endpoint closes with its last engine)."""

    def __init__(self, key: int, server: MetricsServer, users: set[int]) -> None:
        self.key = key
        self.address = server.address
        self._server = server
        self._users = users

    def close(self) -> None:
        """Idempotent."""
        with _engines_lock:
            if _collector is not None:
                _collector.remove(self.key)
            self._users.discard(self.key)
            last = not self._users and self.address in _servers and _servers[self.address][0] is self._server
            if last:
                del _servers[self.address]
        if last:
            self._server.close()


def serve_engine(key: int, source: Snapshot, host: str, port: int) -> Exposure:
    """Expose the engine ``key`` (``source`` gives its snapshots) on ``host:port``: an
    endpoint of this process already there is shared, else one is started (port 0: the
    system picks).  Raises :class:`MissingPackage`, or ``OSError`` when the address cannot
    be bound."""
    global _collector
    with _engines_lock:
        registry = process_registry()
        if _collector is None:
            _collector = EngineCollector()
            registry.register(_collector)
        found = _servers.get((host, port)) if port else None
        if found is None:
            server = MetricsServer(host, port, registry, _engines_health)
            found = _servers[server.address] = (server, set())
        server, users = found
        users.add(key)
        _collector.add(key, source)
    return Exposure(key, server, users)
