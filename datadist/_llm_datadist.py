"""``LLMDataDist``: the engine object of the public API (SPEC-datadist section 4)."""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import List, Optional, Sequence, Tuple

from ._cache_manager import CacheManager
from ._config import EngineOptions, parse_options
from ._objects import LLMClusterInfo
from ._status import LLMStatusCode, raise_error
from ._types import LLMRole
from .engine.core import MAX_LINK_CLUSTERS, Engine

__all__ = ["LLMDataDist"]

log = logging.getLogger("datadist")

# One initialized engine per process, as in llm_datadist.
_active_lock = threading.Lock()
_active: Optional["weakref.ref[LLMDataDist]"] = None


class LLMDataDist:
    """A prompt, decoder or mixed engine of cluster ``cluster_id``.

    ``init(options)`` starts it (pools, agent thread, listener when
    ``llm.listenIpInfo`` is set); ``finalize()`` releases everything and is idempotent;
    an engine still initialized at interpreter exit is finalized then.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        if isinstance(role, bool) or not isinstance(role, int):
            raise TypeError(f"role must be an LLMRole, got {type(role).__name__}")
        try:
            self._role = LLMRole(role)
        except ValueError:
            raise ValueError(f"role = {role} is not an LLMRole") from None
        if isinstance(cluster_id, bool) or not isinstance(cluster_id, int):
            raise TypeError(f"cluster_id must be an int, got {type(cluster_id).__name__}")
        if not 0 <= cluster_id < 2**64:
            raise ValueError(f"cluster_id = {cluster_id} must be in [0, 2**64)")
        self._cluster_id = cluster_id
        self._engine: Optional[Engine] = None
        self._finalized = False
        self._options: Optional[EngineOptions] = None
        self._cache_manager = CacheManager(self)

    # -- properties ------------------------------------------------------------------------
    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        return self._role

    @property
    def cache_manager(self) -> CacheManager:
        return self._cache_manager

    def _engine_or_raise(self) -> Engine:
        if self._engine is None:
            if self._finalized:
                raise_error(LLMStatusCode.LLM_ENGINE_FINALIZED, f"engine of cluster {self._cluster_id} was finalized")
            raise_error(LLMStatusCode.LLM_FAILED, f"engine of cluster {self._cluster_id} is not initialized; call init()")
        return self._engine

    # -- lifecycle -------------------------------------------------------------------------
    def init(self, options: dict) -> None:
        """Start the engine with the options dict from ``LLMConfig.generate_options()``."""
        global _active
        if not isinstance(options, dict):
            raise TypeError(f"options must be a dict of option strings, got {type(options).__name__}")
        if self._finalized:
            raise_error(LLMStatusCode.LLM_ENGINE_FINALIZED, f"engine of cluster {self._cluster_id} was finalized")
        if self._engine is not None:
            raise_error(LLMStatusCode.LLM_FAILED, f"engine of cluster {self._cluster_id} is already initialized")
        parsed = parse_options(options)
        with _active_lock:
            other = _active() if _active is not None else None
            if other is not None and other._engine is not None:
                raise_error(LLMStatusCode.LLM_FAILED,
                            f"this process already runs the engine of cluster {other.cluster_id}; "
                            "one initialized LLMDataDist per process")
            try:
                self._engine = Engine(self._cluster_id, int(self._role), parsed)
            except OSError as exc:
                raise_error(LLMStatusCode.LLM_FAILED, f"engine start failed: {exc}")
            self._options = parsed
            _active = weakref.ref(self)
        atexit.register(self.finalize)

    def finalize(self) -> None:
        """Release pools, links, threads and sockets; idempotent."""
        global _active
        engine, self._engine = self._engine, None
        self._finalized = True
        if engine is not None:
            engine.close()
        with _active_lock:
            if _active is not None and _active() is self:
                _active = None
        atexit.unregister(self.finalize)

    # -- links -----------------------------------------------------------------------------
    @staticmethod
    def _check_clusters(clusters, timeout) -> Tuple[list, float]:
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
        results = []
        for c in clusters:
            if c.remote_cluster_id is None or not c.remote_ip_info_list:
                raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                            f"cluster info {c!r} needs remote_cluster_id and a remote ip (append_remote_ip_info)")
            ip, port = c.remote_ip_info_list[0]
            results.append(engine.link(c.remote_cluster_id, ip, port, deadline))
        return _overall(results), results

    def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
                        ) -> Tuple[LLMStatusCode, List[LLMStatusCode]]:
        """Unlink each cluster (both ends; ``force=True``: only this end)."""
        engine = self._engine_or_raise()
        clusters, deadline = self._check_clusters(clusters, timeout)
        if len(clusters) > MAX_LINK_CLUSTERS:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, [LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(clusters)
        results = [engine.unlink(c.remote_cluster_id, deadline, bool(force)) for c in clusters]
        return _overall(results), results

    @property
    def listen_port(self) -> Optional[int]:
        """The port the agent listens on (useful with ``listen_ip_info`` port 0)."""
        return self._engine_or_raise().listen_port

    def link_path(self, cluster_id: int) -> str:
        """Transport of the link to ``cluster_id`` (``shm`` or ``tcp``); for diagnostics."""
        return self._engine_or_raise().get_link(cluster_id).path


def _overall(results: List[LLMStatusCode]) -> LLMStatusCode:
    return next((r for r in results if r != LLMStatusCode.LLM_SUCCESS), LLMStatusCode.LLM_SUCCESS)
