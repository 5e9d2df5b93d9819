"""``DatadistConnector``: vLLM's v1 KV connector for prefill/decode disaggregation.

The request protocol is NixlConnector's, so a proxy written for it works unchanged:

1. The proxy sends the prompt to the prefill instance (``kv_role="kv_producer"``) with
   ``kv_transfer_params={"do_remote_decode": True}`` and ``max_tokens=1``.
2. When that request finishes, the prefill instance keeps its blocks and answers with
   ``kv_transfer_params``: ``do_remote_prefill``, ``remote_block_ids``,
   ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``,
   ``tp_size`` and ours, ``remote_cluster_ids`` (one datadist engine per tensor-parallel rank).
3. The proxy passes them unchanged to the decode instance (``kv_role="kv_consumer"``).  Its
   scheduler counts the prompt as external tokens loaded asynchronously; its worker links
   to the prefill worker (once per peer), ``pull_blocks`` the prompt's blocks straight into
   vLLM's cache, then sends the prefill worker a notification over the link.
4. The prefill worker frees the blocks on that notification, or when their lease runs out:
   ``kv_lease_duration`` seconds (as NixlConnector's) after it held them, renewed by the
   decode worker while the pull waits in its queue or runs.  A dead decode instance's
   blocks are free within one lease; a slow one keeps them.

A prefill instance's blocks may be smaller than the decode instance's by a whole factor
(``remote_block_size``), and its tensor parallelism may differ when one size divides the
other (each decode rank joins or splits the KV heads, :mod:`.heads`), in the layouts where
blocks split (:mod:`.blocks`); any other difference refuses the load.

The decode scheduler checks ``kv_transfer_params`` first (:mod:`.params`): malformed ones
make the prompt computed locally.  A pull that fails, or that too few remote blocks would
leave partly unwritten, reports the request's blocks through ``get_block_ids_with_load_errors``
(vLLM then fails or recomputes the request, per ``kv_load_failure_policy``); other
requests go on.  Pulls run on threads of the worker (``max_concurrent_pulls`` of them):
the engine loop never waits on a peer, and a slow or dead peer holds one thread only.

Configuration (``kv_connector_extra_config``): ``host`` (address the prefill worker
listens on and advertises; default ``$DATADIST_VLLM_HOST`` or 127.0.0.1), ``port`` (0..65535;
0: any free port; else port + tensor-parallel rank), ``transfer_backend`` (``auto``),
``sync_kv_timeout_ms`` (10000; 1..3600000), ``kv_lease_duration`` (30 s), ``max_concurrent_pulls`` (4:
pulls in flight per worker), ``link_secret_file``, ``transfer_checksum`` (false: true
sums every pulled payload on both ends and fails a pull whose checksums differ, whose
blocks are then reported as load errors; ``datadist.TransferChecksum``),
``idle_wait_ms`` (10, 0..1000: on a step that computes nothing while blocks wait for their pull,
the prefill worker waits this long for the decode side's notification instead of letting
vLLM's engine loop spin; a notification ends the wait at once).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from .base import SplitConnector, extra_int
from .params import RemoteParams, parse_remote
from .stats import DATADIST_METRICS, ConnectorStats
from .worker import DatadistWorker, Endpoint, RecvJob, Settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["DatadistConnector", "DatadistConnectorMetadata", "DatadistHandshake"]

log = logging.getLogger("datadist.vllm")

# vLLM is not installed where mypy runs (ignore_missing_imports): its metadata bases are Any.
@dataclass
class DatadistHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells its scheduler: where its datadist engine listens."""

    host: str
    port: int
    cluster_id: int


@dataclass
class DatadistConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One scheduler step's work for the workers: pulls to start, blocks to hold."""

    reqs_to_recv: dict[str, RecvJob] = field(default_factory=dict)
    #: request id -> seconds the prefill worker holds its blocks for a pull
    reqs_to_send: dict[str, float] = field(default_factory=dict)
    #: the step computes nothing: the engine only waits (e.g. for pulls of held blocks)
    idle: bool = False


def _positive(extra: dict[str, Any], key: str, default: float) -> float:
    value = float(extra.get(key, default))
    if not value > 0:
        raise ValueError(f"DatadistConnector: kv_connector_extra_config {key}={extra.get(key)!r} must be > 0")
    return value


def _flag(extra: dict[str, Any], key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"DatadistConnector: kv_connector_extra_config {key}={value!r} must be true or false")
    return value


def _settings(vllm_config: "VllmConfig") -> Settings:
    cfg = vllm_config.kv_transfer_config
    extra = dict(cfg.kv_connector_extra_config or {})
    known = {"host", "port", "transfer_backend", "sync_kv_timeout_ms", "kv_lease_duration", "link_secret_file",
             "idle_wait_ms", "max_concurrent_pulls", "transfer_checksum"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"DatadistConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
    return Settings(host=str(extra.get("host") or os.environ.get("DATADIST_VLLM_HOST") or "127.0.0.1"),
                    port=extra_int("DatadistConnector", extra, "port", 0, 0, 65535),
                    transfer_backend=str(extra.get("transfer_backend", "auto")),
                    timeout_ms=extra_int("DatadistConnector", extra, "sync_kv_timeout_ms", 10000, 1, 3_600_000),
                    lease_s=_positive(extra, "kv_lease_duration", 30.0),
                    max_pulls=extra_int("DatadistConnector", extra, "max_concurrent_pulls", 4, 1, 64),
                    idle_wait_ms=extra_int("DatadistConnector", extra, "idle_wait_ms", 10, 0, 1000),
                    link_secret_file=extra.get("link_secret_file"),
                    producer=bool(cfg.is_kv_producer), consumer=bool(cfg.is_kv_consumer),
                    engine_id=str(cfg.engine_id), transfer_checksum=_flag(extra, "transfer_checksum"))


class DatadistConnector(SplitConnector["_Scheduler", DatadistWorker]):
    """vLLM KV connector over datadist (see the module docstring)."""

    METRICS = DATADIST_METRICS

    def _make_scheduler(self, vllm_config: "VllmConfig") -> "_Scheduler":
        return _Scheduler(vllm_config, _settings(vllm_config))

    def _make_worker(self, vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"]) -> DatadistWorker:
        return DatadistWorker(vllm_config, _settings(vllm_config), kv_cache_config)

    # -- worker side ---------------------------------------------------------------------
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DatadistConnectorMetadata)
        self._worker_half.start(meta.reqs_to_recv, meta.reqs_to_send, meta.idle)

    def wait_for_save(self) -> None:
        return  # pull mode: the decode instance reads the prefill instance's cache

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        if self._worker is None or self._worker.endpoint is None:
            return None
        ep = self._worker.endpoint
        return DatadistHandshake(host=ep.host, port=ep.port, cluster_id=ep.cluster_id)

    # -- scheduler side ------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler_half.endpoints = [Endpoint(m.host, m.port, m.cluster_id)
                                          for _, m in sorted(metadata.items())]

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = self._scheduler_half.build_meta()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._scheduler_half.finished(request, block_ids)


class _Scheduler:
    """The scheduler half: which requests to pull, which blocks to hold for a pull."""

    def __init__(self, vllm_config: "VllmConfig", settings: Settings) -> None:
        self.settings = settings
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.endpoints: list[Endpoint] = []
        self.stats = ConnectorStats()  # the workers record; this half has nothing of its own
        self._recv: dict[str, RecvJob] = {}
        self._send: dict[str, float] = {}

    @staticmethod
    def _remote(request: "Request") -> Optional[RemoteParams]:
        """The request's remote prefill, if it asks for one and its ``kv_transfer_params``
        are sound; malformed ones are logged and dropped (the prompt is computed here; the
        prefill side, whose address is not trusted then, frees its blocks at the lease's end)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return parse_remote(params)
        except ValueError as exc:
            params["do_remote_prefill"] = False  # judged once
            log.warning("request %s: kv_transfer_params for a remote prefill are unusable (%s); its prompt is "
                        "computed here", request.request_id, exc)
            return None

    def matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if self._remote(request) is not None:
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True  # loaded between steps; vLLM recomputes the last token itself
        return 0, False

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        remote = self._remote(request)
        if remote is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request
        # Blocks the local prefix cache already holds are not pulled again; the remote
        # list is clipped to match (both end with the prompt's last block).
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        remote_size = self.block_size if remote.block_size is None else remote.block_size
        ratio = self._ratio(remote_size)
        job = self._job(remote, local, awaited=num_external_tokens > 0, ratio=ratio or 1)
        if not ratio:
            # A remote block would not fill whole parts of a local block: refuse the load
            # (vLLM fails or recomputes the request, per its policy) rather than scramble it.
            job.refused = (f"prefill instance's block size is {remote_size!r}, this one's {self.block_size}; "
                           "DatadistConnector needs the prefill block size to equal this one or divide it")
        self._recv[request.request_id] = job

    def _ratio(self, remote_size: Any) -> int:
        """How many prefill blocks of ``remote_size`` tokens fill one of ours (0: they do not)."""
        if isinstance(remote_size, bool) or not isinstance(remote_size, int) or not 0 < remote_size <= self.block_size:
            return 0
        return self.block_size // remote_size if self.block_size % remote_size == 0 else 0

    @staticmethod
    def _job(remote: RemoteParams, local: list[int], awaited: bool, ratio: int = 1) -> RecvJob:
        """The pull of ``remote``'s blocks into ``local``.  Both lists end with the prompt's
        last block; ``ratio`` remote blocks fill one of ours, and the remote blocks of a
        local prefix-cache hit (the leading ones no local block is given for) are skipped.
        Too few remote blocks to fill every local one is refused: vLLM counted all of them
        as loaded, so the load fails (their blocks reported as load errors) rather than
        leave some unwritten."""
        blocks = list(remote.block_ids)
        refused = ""
        if local:
            filled = -(-len(blocks) // ratio)
            if filled < len(local):
                refused = (f"kv_transfer_params name {len(blocks)} prefill blocks, which fill {filled} of this "
                           f"instance's blocks; the prompt's KV takes {len(local)}")
            else:
                blocks = blocks[ratio * (filled - len(local)):]
        else:
            blocks = []
        return RecvJob(local_blocks=list(local), remote_blocks=blocks, remote_request_id=remote.request_id,
                       peers=list(remote.peers), awaited=awaited, lease_s=remote.lease_s if awaited else 0.0,
                       refused=refused, ratio=ratio)

    def build_meta(self) -> DatadistConnectorMetadata:
        meta = DatadistConnectorMetadata(reqs_to_recv=self._recv, reqs_to_send=self._send)
        self._recv, self._send = {}, {}
        return meta

    def finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished before it was scheduled (aborted): tell the prefill side to free.
            remote = self._remote(request)
            params["do_remote_prefill"] = False
            if remote is not None:
                self._recv[request.request_id] = self._job(remote, [], awaited=False)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted prefill: nobody will pull, free now
        if not block_ids or not self.endpoints:
            return False, None
        self._send[request.request_id] = self.settings.lease_s
        first = self.endpoints[0]
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": list(block_ids), "remote_engine_id": self.settings.engine_id,
            "remote_request_id": request.request_id, "remote_host": first.host, "remote_port": first.port,
            "remote_hosts": [e.host for e in self.endpoints], "remote_ports": [e.port for e in self.endpoints],
            "remote_cluster_ids": [e.cluster_id for e in self.endpoints], "tp_size": self.tp_size,
            "remote_num_tokens": request.num_computed_tokens, "kv_lease_duration": self.settings.lease_s,
            "remote_block_size": self.block_size,
        }
