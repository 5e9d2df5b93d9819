"""``LLMDataDist``: the engine object of the public API (SPEC-datadist section 4)."""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, NoReturn, Optional, Sequence, Tuple

from ._cache_manager import CacheManager
from ._comm import CommDomain, parse_comm_args
from ._config import EngineOptions, parse_options
from ._cluster import LLMClusterInfo, ip_to_str
from ._status import LLMStatusCode, api_class, raise_error, status_code_of_fault, status_of, to_status_code
from ._types import LLMRole, RegisterMemStatus
from .engine.core import MAX_LINK_CLUSTERS, Engine
from .engine.errors import Fault
from .engine.notes import MAX_NOTE_BYTES

if TYPE_CHECKING:  # pragma: no cover
    from .engine.agent import Agent

__all__ = ["LLMDataDist"]

log = logging.getLogger("datadist")

def _outcome(exc: BaseException) -> str:
    """A failed transfer's label in the metrics: its status code's name."""
    return status_of(exc).name


def _code_name(code: int) -> str:
    return to_status_code(code).name


# One initialized engine per process, as in llm_datadist.
_active_lock = threading.Lock()
_active: Optional["weakref.ref[LLMDataDist]"] = None


@api_class
class LLMDataDist:
    """A prompt, decoder or mixed engine of cluster ``cluster_id``.

    ``init(options)`` starts it (pools, agent thread, listener when
    ``llm.listenIpInfo`` is set); ``finalize()`` releases everything and is idempotent;
    an engine still initialized at interpreter exit is finalized then.
    ``LLMDataDist.llm_engine_instance`` is the initialized engine of this process (None
    while there is none), as in CANN.
    """

    #: The initialized engine of this process, or None (CANN's class attribute).
    llm_engine_instance: Optional["LLMDataDist"] = None

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._role = _role_arg(role)
        if isinstance(cluster_id, bool) or not isinstance(cluster_id, int):
            raise TypeError(f"cluster_id must be an int, got {type(cluster_id).__name__}")
        if not 0 <= cluster_id < 2**64:
            raise ValueError(f"cluster_id = {cluster_id} must be in [0, 2**64)")
        self._cluster_id = cluster_id
        self._engine: Optional[Engine] = None
        self._finalized = False
        self._options: Optional[EngineOptions] = None
        self._cache_manager = CacheManager(self)
        self._comms: Dict[int, CommDomain] = {}

    # -- properties ------------------------------------------------------------------------
    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        return self._role

    @property
    def cache_manager(self) -> CacheManager:
        """The engine's :class:`CacheManager`.  As in CANN, only while the engine is
        initialized: ``LLM_FAILED`` before ``init``, ``LLM_ENGINE_FINALIZED`` after
        ``finalize`` (both ``RuntimeError``s, as CANN raises)."""
        self._engine_or_raise()
        return self._cache_manager

    @property
    def kv_cache_manager(self) -> Any:
        """CANN's KvCacheManager of the mode without ``llm.EnableCacheManager``, which this
        library does not have: raises as CANN does in CacheManager mode
        (``LLM_PARAM_INVALID``; before ``init`` / after ``finalize`` as
        :attr:`cache_manager`)."""
        self._engine_or_raise()
        _cache_manager_mode_only("kv_cache_manager")

    def check_link_status(self, remote_cluster_id: int) -> None:
        """CANN's link check of the mode without ``llm.EnableCacheManager``: raises as
        CANN does in CacheManager mode (``LLM_PARAM_INVALID``; before ``init`` / after
        ``finalize`` as :attr:`cache_manager`)."""
        self._engine_or_raise()
        _cache_manager_mode_only("check_link_status")

    def _engine_or_raise(self) -> Engine:
        if self._engine is None:
            if self._finalized:
                raise_error(LLMStatusCode.LLM_ENGINE_FINALIZED, f"engine of cluster {self._cluster_id} was finalized")
            raise_error(LLMStatusCode.LLM_FAILED, f"engine of cluster {self._cluster_id} is not initialized; call init()")
        return self._engine

    def _running(self) -> Tuple[Engine, EngineOptions]:
        """The running engine and the options it was started with (raises as
        :meth:`_engine_or_raise` does)."""
        engine = self._engine_or_raise()
        assert self._options is not None  # init sets it with the engine
        return engine, self._options

    # -- lifecycle -------------------------------------------------------------------------
    def init(self, options: Dict[str, str]) -> None:
        """Start the engine with the options dict from ``LLMConfig.generate_options()``.

        As in CANN, ``init`` on a running engine does nothing, and a finalized engine can be
        initialized again (serving adapters finalize and re-init one object)."""
        global _active
        if not isinstance(options, dict):
            raise TypeError(f"options must be a dict of option strings, got {type(options).__name__}")
        if self._engine is not None:  # CANN returns at once; the running engine stays as it is
            log.info("engine of cluster %d is already initialized; init ignored", self._cluster_id)
            return
        parsed = parse_options(options)
        if len(parsed.device_ids) > 1:
            raise_error(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                        f"ge.exec.deviceId names {len(parsed.device_ids)} devices {list(parsed.device_ids)}: an engine "
                        "runs on one device here; give one id (LLMConfig.device_id)")
        with _active_lock:
            other = _active() if _active is not None else None
            if other is not None and other._engine is not None:
                raise_error(LLMStatusCode.LLM_FAILED,
                            f"this process already runs the engine of cluster {other.cluster_id}; "
                            "one initialized LLMDataDist per process")
            try:
                self._engine = Engine(self._cluster_id, int(self._role), parsed)
                self._engine.metrics.outcome_of = _outcome
                self._engine.metrics.code_name = _code_name
            except OSError as exc:
                raise_error(LLMStatusCode.LLM_FAILED, f"engine start failed: {exc}")
            self._options = parsed
            self._finalized = False  # CANN lets a finalized engine be initialized again
            _active = weakref.ref(self)
            LLMDataDist.llm_engine_instance = self
        atexit.register(self.finalize)

    def finalize(self) -> None:
        """Release pools, links, threads and sockets; idempotent."""
        global _active
        engine, self._engine = self._engine, None
        self._finalized = True
        if engine is not None:
            for domain in self._comms.values():
                domain.cancel.set()
            engine.close()
            for domain in self._comms.values():
                if domain.thread is not None:
                    domain.thread.join(5.0)
            self._comms.clear()
        with _active_lock:
            if _active is not None and _active() is self:
                _active = None
            if LLMDataDist.llm_engine_instance is self:
                LLMDataDist.llm_engine_instance = None
        atexit.unregister(self.finalize)

    # -- links -----------------------------------------------------------------------------
    @staticmethod
    def _check_clusters(clusters: Sequence[LLMClusterInfo], timeout: int) -> Tuple[List[LLMClusterInfo], float]:
        if not isinstance(clusters, (list, tuple)):
            raise TypeError(f"clusters must be a list of LLMClusterInfo, got {type(clusters).__name__}")
        for i, c in enumerate(clusters):
            if not isinstance(c, LLMClusterInfo):
                raise TypeError(f"clusters[{i}] must be an LLMClusterInfo, got {type(c).__name__}")
        if isinstance(timeout, bool) or not isinstance(timeout, int):
            raise TypeError(f"timeout must be an int (ms), got {type(timeout).__name__}")
        if timeout <= 0:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID, f"timeout = {timeout} ms must be > 0")
        return list(clusters), time.monotonic() + timeout / 1000.0

    def link_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
                      ) -> Tuple[LLMStatusCode, List[LLMStatusCode]]:
        """Link to each cluster's server (its address in ``remote_ip_info``).

        Returns the overall status and one status per cluster (never raises for a peer's
        failure: ``LLM_LINK_FAILED``, ``LLM_ALREADY_LINK``...)."""
        engine = self._engine_or_raise()
        clusters, deadline = self._check_clusters(clusters, timeout)
        if len(clusters) > MAX_LINK_CLUSTERS:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, [LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(clusters)
        for c in clusters:  # all checked before any is linked: bad input changes nothing
            if c.remote_cluster_id is None or not c.remote_ip_info_list:
                raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                            f"cluster info {c!r} needs remote_cluster_id and a remote ip (append_remote_ip_info)")
        # Each cluster within the whole timeout, all at once, as CANN links a list.
        faults = engine.at_once(lambda c: _link_one(engine, c, deadline), [c.remote_cluster_id for c in clusters],
                                clusters)
        results = [status_code_of_fault(f) for f in faults]
        return _overall(results), results

    def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
                        ) -> Tuple[LLMStatusCode, List[LLMStatusCode]]:
        """Unlink each cluster (both ends; ``force=True``: only this end)."""
        engine = self._engine_or_raise()
        clusters, deadline = self._check_clusters(clusters, timeout)
        if len(clusters) > MAX_LINK_CLUSTERS:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, [LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(clusters)
        faults = engine.at_once(lambda c: _unlink_one(engine, c.remote_cluster_id, deadline, bool(force)),
                                [c.remote_cluster_id for c in clusters], clusters)
        results = [status_code_of_fault(f) for f in faults]
        return _overall(results), results

    # -- comm domains (collective linking) ----------------------------------------------
    def link(self, comm_name: str, cluster_rank_info: Dict[int, int], rank_table: str) -> int:
        """Join comm domain ``comm_name`` (2 to 4 members, every member calls this with the
        same arguments); returns its comm id at once, the links come up in the background
        (``query_register_mem_status``).  Transfers before that: ``LLM_NOT_YET_LINK``."""
        engine, options = self._running()
        name, members, addresses = parse_comm_args(comm_name, cluster_rank_info, rank_table, self._cluster_id)
        for other in self._comms.values():
            if other.name == name:
                raise_error(LLMStatusCode.LLM_ALREADY_LINK, f"comm {name!r} is already linked (comm id {other.comm_id})")
        domain = CommDomain(name, members, addresses)
        domain.start(engine, time.monotonic() + options.link_total_time_s)
        self._comms[domain.comm_id] = domain
        return domain.comm_id

    def _comm(self, comm_id: int) -> CommDomain:
        if isinstance(comm_id, bool) or not isinstance(comm_id, int):
            raise TypeError(f"comm_id must be an int, got {type(comm_id).__name__}")
        domain = self._comms.get(comm_id)
        if domain is None:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID, f"comm_id {comm_id} is not a linked comm domain of this engine")
        return domain

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """``PREPARING`` while the domain's links come up, ``OK`` when all are, ``FAILED``
        if they could not be made before ``link_total_time``."""
        self._engine_or_raise()
        return self._comm(comm_id).status

    def unlink(self, comm_id: int) -> None:
        """Leave a comm domain: its links are unlinked on both ends."""
        engine, options = self._running()
        domain = self._comm(comm_id)
        domain.stop(engine, time.monotonic() + options.sync_kv_timeout_s + 3.0)
        del self._comms[comm_id]

    # -- roles -----------------------------------------------------------------------------
    def switch_role(self, role: LLMRole, switch_options: Optional[Dict[str, str]] = None) -> None:
        """Become ``role``.  Not while links exist (``LLM_EXIST_LINK``).

        Listening follows the role, as in CANN: with ``switch_options["llm.listenIpInfo"]``
        the engine listens there (and nowhere else); without it a DECODER stops listening and
        a PROMPT or MIX engine keeps its address.  A closed address is free for another
        process as soon as this returns (CANN's switch_role sample hands one ip:port over).
        Listeners of comm domains (``link``) are left alone."""
        engine = self._engine_or_raise()
        new_role = _role_arg(role)
        if switch_options is not None and not isinstance(switch_options, dict):
            raise TypeError(f"switch_options must be a dict or None, got {type(switch_options).__name__}")
        listen = parse_options(switch_options).listen_address if switch_options else None
        linked = engine.linked_clusters()
        if linked:
            raise_error(LLMStatusCode.LLM_EXIST_LINK,
                        f"cannot switch role while linked to cluster(s) {linked}; unlink them first")
        self._follow_role(engine.live_agent(), listen, new_role)
        self._role = new_role
        engine.role = int(new_role)

    def _follow_role(self, agent: "Agent", listen: Optional[Tuple[str, int]], role: LLMRole) -> None:
        """Listen where ``role`` does after ``switch_role``: at ``listen`` only if given,
        else nowhere for a DECODER and where it listens now otherwise; comm domains keep
        their listeners."""
        keep = {d.listener for d in self._comms.values() if d.listener is not None}
        if listen is not None:
            keep.add(_listen_on(agent, listen))
        elif role != LLMRole.DECODER:
            keep.update(agent.listeners)
        for addr in [a for a in agent.listeners if a not in keep]:
            agent.remove_listener(addr)

    @property
    def listen_port(self) -> Optional[int]:
        """The port the agent listens on (useful with ``listen_ip_info`` port 0)."""
        return self._engine_or_raise().listen_port

    def metrics(self) -> Dict[str, Any]:
        """What this engine counted so far, as plain data (docs/operations.md lists every
        key): ``transfers`` (one dict per operation, transport and outcome, with ``count``
        and ``bytes``), ``latency`` (histograms per operation and transport: ``count``,
        ``sum_seconds``, cumulative ``buckets`` of ``(le_seconds, count)``), ``timeouts``
        by operation, ``links`` (``up``, ``failures``, ``relinks``, ``attempts`` by
        outcome), ``pools`` (``size_bytes``, ``used_bytes``, ``free_bytes`` by pool) and
        ``agent`` (``pending_calls``, ``pending_handshakes``, ``handed_off``).  Counters only grow while
        the engine lives; a new ``init`` starts from zero.  Needs no ``prometheus_client``."""
        return self._engine_or_raise().snapshot()

    @property
    def metrics_address(self) -> Optional[Tuple[str, int]]:
        """Where the Prometheus endpoint of this engine listens (``datadist.MetricsPort``
        or ``DATADIST_METRICS_PORT``); None: it has none."""
        exposure = self._engine_or_raise().exposure
        return None if exposure is None else exposure.address

    def link_path(self, cluster_id: int) -> str:
        """Transport of the link to ``cluster_id`` (``shm``, ``tcp``, ``gloo``, ``nccl`` or
        ``hccl``); for diagnostics."""
        return self._engine_or_raise().get_link(cluster_id).path

    # -- notifications (datadist extension) ---------------------------------------------------
    def send_notification(self, cluster_id: int, message: str) -> None:
        """Send ``message`` to the linked engine ``cluster_id`` (a datadist extension; CANN
        has none).  One-way and in order with the link's transfers: a notification sent
        after ``pull_blocks`` returns reaches the peer after it served that pull.  Goes from
        the engine that called ``link_clusters`` to the engine it linked to; at most
        ``MAX_NOTE_BYTES`` (60 KiB) of UTF-8.  Raises ``LLM_NOT_YET_LINK`` without such a
        link, ``LLM_LINK_FAILED``/``LLM_TIMEOUT`` when the link cannot carry it."""
        if not isinstance(message, str):
            raise TypeError(f"message must be a str, got {type(message).__name__}")
        try:
            size = len(message.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID, f"message is not encodable as UTF-8: {exc}")
        if size > MAX_NOTE_BYTES:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                        f"message is {size} bytes of UTF-8, more than a notification carries ({MAX_NOTE_BYTES})")
        if isinstance(cluster_id, bool) or not isinstance(cluster_id, int):
            raise TypeError(f"cluster_id must be an int, got {type(cluster_id).__name__}")
        self._engine_or_raise().get_link(cluster_id).send_note(message)

    def get_notifications(self, timeout_ms: int = 0) -> List[Tuple[int, str]]:
        """Every notification received since the last call, oldest first, as
        ``(sender cluster id, message)``; the sender is the authenticated peer of the link
        it came on.  With ``timeout_ms`` > 0 and none received yet, waits up to that long
        for the first (returns at once when one comes).  Up to 65536 uncollected
        notifications are kept (oldest dropped first)."""
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or not 0 <= timeout_ms <= 3_600_000:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID, f"timeout_ms = {timeout_ms!r} must be an int in [0, 3600000]")
        return self._engine_or_raise().notes.take(timeout_ms / 1000.0)


def _cache_manager_mode_only(what: str) -> NoReturn:
    """Refuse a call of CANN's mode without ``llm.EnableCacheManager`` (CacheManager mode
    is this library's only mode), with CANN's message."""
    raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                f"{what} is not supported when llm.EnableCacheManager is configured "
                "(this library runs CacheManager mode only)")


def _role_arg(role: object) -> LLMRole:
    """``role`` checked: an ``LLMRole`` (or its int value)."""
    if isinstance(role, bool) or not isinstance(role, int):
        raise TypeError(f"role must be an LLMRole, got {type(role).__name__}")
    try:
        return LLMRole(role)
    except ValueError:
        raise ValueError(f"role = {role} is not an LLMRole") from None


def _listen_on(agent: "Agent", listen: Tuple[str, int]) -> Tuple[str, int]:
    """The agent's listener at ``listen`` (opened if it has none there): its bound address."""
    if listen in agent.listeners:
        return listen
    try:
        return agent.add_listener(listen)
    except OSError as exc:
        raise_error(LLMStatusCode.LLM_FAILED, f"switch_role cannot listen on {listen[0]}:{listen[1]}: {exc}")


def _link_one(engine: Engine, cluster: LLMClusterInfo, deadline: float) -> Fault:
    ip, port = cluster.remote_ip_info_list[0]  # ip in CANN's int form, as llm_datadist stores it
    assert cluster.remote_cluster_id is not None  # checked by link_clusters
    return engine.link(cluster.remote_cluster_id, ip_to_str(ip), port, deadline)


def _unlink_one(engine: Engine, cluster_id: Optional[int], deadline: float, force: bool) -> Fault:
    if cluster_id is None:  # a cluster info without remote_cluster_id names no link
        return Fault.NOT_LINKED
    return engine.unlink(cluster_id, deadline, force)


def _overall(results: List[LLMStatusCode]) -> LLMStatusCode:
    return next((r for r in results if r != LLMStatusCode.LLM_SUCCESS), LLMStatusCode.LLM_SUCCESS)
