"""The worker half of ``DatadistConnector``: one datadist engine per vLLM worker.

The engine registers vLLM's KV cache tensors as one blocks cache (no copy; see
:mod:`datadist.integrations.paged`).  A prefill worker listens and holds each finished
request's blocks until the decode worker's notification, or until their lease runs out
(``kv_lease_duration`` seconds after it held them or after the decode worker last renewed
it); a decode worker pulls on threads of its own (up to ``max_concurrent_pulls`` requests at
once), renews the lease of every pull still queued from a second thread (and of every
pull to a peer as one to it begins), and reports each request as received, with its
blocks as load errors when the pull failed.  Prefill blocks of a size that divides ours
are pulled into parts of our blocks, and the heads of a prefill instance of other tensor
parallelism are joined or split per rank, where the KV cache layout allows it
(:mod:`.blocks`, :mod:`.heads`); a prefill rank that several decode ranks read frees a
request's blocks after the last one's notice.

No peer holds back the others: each peer has a lock of its own for linking, a link is
made on a thread of its own as soon as a request names a new peer (so a pull queued
behind others has its link, and its lease renewals, before its turn), the renewal thread
never links and never waits on a link that a pull is using, and one failed link attempt
answers every pull that waited on it.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Optional

from ... import (BlocksCacheKey, Cache, LLMClusterInfo, LLMConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode,
                  TransferHandle)
from ..affinity import on_instance_cpus
from ..paged import PagedLayout, paged_layout
from .blocks import attention_kind, chunk_desc, split_pairs, token_runs
from .heads import Read, TPPlan, readers, sources, tp_plan
from .notes import parse_note, parse_readers, pulled_note, renew_note
from .stats import ConnectorStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["Settings", "Endpoint", "RecvJob", "DatadistWorker"]

log = logging.getLogger("datadist.vllm")


@dataclass(frozen=True)
class Settings:
    """The connector's configuration (``kv_connector_extra_config`` and the role)."""

    host: str
    port: int
    transfer_backend: str
    timeout_ms: int
    lease_s: float
    max_pulls: int
    idle_wait_ms: int
    link_secret_file: Optional[str]
    producer: bool
    consumer: bool
    engine_id: str
    #: End-to-end checksums of the transfers this worker starts (``datadist.TransferChecksum``).
    transfer_checksum: bool = False


@dataclass(frozen=True)
class Endpoint:
    """Where one prefill worker's engine listens."""

    host: str
    port: int
    cluster_id: int


@dataclass
class RecvJob:
    """One request's pull: the prompt's remote blocks into the local ones, then a notice
    to the prefill worker.  ``local_blocks`` empty: notify only (nothing to load)."""

    local_blocks: list[int]
    remote_blocks: list[int]
    remote_request_id: str
    peers: list[Endpoint]      # one per prefill tensor-parallel rank
    awaited: bool              # the scheduler waits for this request's load
    lease_s: float = 0.0       # the prefill side's lease on the blocks (0: not renewed)
    refused: str = ""          # why the load cannot be done (it fails, the peer is told)
    ratio: int = 1             # local block size / the prefill side's (its blocks fill parts of ours)


class _Refused(ValueError):
    """A pull that cannot be done with these caches (nothing moved)."""


class DatadistWorker:
    def __init__(self, vllm_config: "VllmConfig", settings: Settings,
                 kv_cache_config: Optional["KVCacheConfig"], attention: Optional[str] = None) -> None:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)

        self.settings = settings
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.kv_cache_config = kv_cache_config
        self.cluster_id = secrets.randbits(63)
        self.endpoint: Optional[Endpoint] = None
        self.layout: Optional[PagedLayout] = None
        self._vllm_config = vllm_config
        #: The attention kernel (``backend:isa``, .blocks); None: read from vLLM when registering.
        self.attention = attention
        self.runs = 0               # runs of token rows per block, where blocks can be split (.blocks)
        model = getattr(vllm_config, "model_config", None)
        self.mla = bool(getattr(model, "use_mla", False))  # one latent head, whole on every rank (.heads)
        self.total_kv_heads = int(model.get_total_num_kv_heads()) if model is not None else 0
        self._split: dict[int, Cache] = {}  # decode: our cache cut in chunks of a prefill block's run, per ratio
        self._datadist: Optional[LLMDataDist] = None
        self._cache: Optional[Cache] = None
        # Several pulls in flight: one slow or dead prefill peer holds one thread (up to
        # the link timeout), not the pulls from other peers.  Pulls on one link still run
        # one at a time (datadist serializes a link's transfers).
        self._pool = ThreadPoolExecutor(settings.max_pulls, thread_name_prefix="datadist-vllm-pull")
        self._lock = threading.Lock()
        #: Per peer: its lock for linking and preparing (a dead peer's link attempt, which
        #: lasts until the link timeout, holds back only the pulls from that peer).
        self._peer_locks: dict[int, threading.Lock] = {}
        #: Per peer: its last failed link attempt (when, why), answering the pulls that waited on it.
        self._link_failures: dict[int, tuple[float, str, LLMStatusCode]] = {}
        self._linking: set[int] = set()          # peers a link thread is linking
        self._busy: dict[int, int] = {}          # peer -> pull threads linking to or pulling from it
        self.stats = ConnectorStats()
        self._pending: dict[str, RecvJob] = {}   # decode: pulls queued or running, whose leases we renew
        self._stop = threading.Event()
        self._wake = threading.Event()  # wakes the renewal thread: a pull of a shorter lease, or closing
        self._pace = 0.5                # seconds between the renewal thread's rounds now
        self._renewer: Optional[threading.Thread] = None
        self._linked: set[int] = set()
        #: A prepared pull per prefill peer and block-size ratio: its cache looked up and checked once.
        self._pulls: dict[tuple[int, int], TransferHandle] = {}
        self._holding: dict[str, float] = {}     # prefill: request id -> end of its blocks' lease
        self._released: set[str] = set()         # prefill: pulled (the decode side told us), free now
        self._early: dict[str, float] = {}       # prefill: pulled before we held them -> when told
        #: prefill: pulled notices of requests that more decode ranks read -> (notices, when last told)
        self._notices: dict[str, tuple[int, float]] = {}
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self._errors: set[int] = set()
        self._idle = False  # this step computes nothing
        self._lease_warned = False  # a prefill lease no longer than a pull may take was reported

    # -- setup ---------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, "torch.Tensor"]) -> None:
        cfg = self.kv_cache_config
        if cfg is None:
            raise ValueError("DatadistConnector needs vLLM's KVCacheConfig (vLLM >= 0.11)")
        if len(cfg.kv_cache_groups) != 1:
            raise NotImplementedError(f"DatadistConnector moves one KV cache group; this model has "
                                      f"{len(cfg.kv_cache_groups)} (hybrid models are not supported yet)")
        self.layout = layout = paged_layout(kv_caches, cfg.num_blocks)
        device_type, _, index = layout.device.partition(":")
        config = LLMConfig()
        config.device_type = device_type
        config.device_id = int(index or 0)
        config.sync_kv_timeout = self.settings.timeout_ms
        config.transfer_backend = self.settings.transfer_backend
        if self.settings.link_secret_file:
            config.link_secret_file = self.settings.link_secret_file
        config.transfer_checksum = self.settings.transfer_checksum
        port = self.settings.port + self.tp_rank if self.settings.port else 0
        if self.settings.producer:
            config.listen_ip_info = f"{self.settings.host}:{port}"
        role = LLMRole.PROMPT if self.settings.producer else LLMRole.DECODER
        # The agent and the pull thread start on every core of this instance, not only on
        # the model thread's (see datadist.integrations.affinity).
        with on_instance_cpus():
            self._datadist = datadist = LLMDataDist(role, self.cluster_id)
            datadist.init(config.generate_options())
            for _ in range(self.settings.max_pulls):  # the pull threads start here
                self._pool.submit(lambda: None).result()
            if self.settings.consumer:
                self._renewer = threading.Thread(target=self._renew_loop, name="datadist-vllm-lease", daemon=True)
                self._renewer.start()
        self._cache = datadist.cache_manager.register_blocks_cache(layout.cache_desc(), list(layout.addrs),
                                                                   BlocksCacheKey(self.cluster_id, 0))
        self._register_runs(kv_caches, layout)
        if self.settings.producer:
            self.endpoint = Endpoint(self.settings.host, int(datadist.listen_port or 0), self.cluster_id)
        log.info("datadist connector: %d layers x %d tensors of %d blocks x %d bytes on %s registered%s",
                 layout.num_layers, layout.tensors_per_layer, layout.num_blocks, layout.block_bytes, layout.device,
                 f"; listening on {self.endpoint.host}:{self.endpoint.port}" if self.endpoint else "")

    def _register_runs(self, kv_caches: Mapping[str, "torch.Tensor"], layout: PagedLayout) -> None:
        """Where blocks split into runs of token rows (:mod:`.blocks`), a prefill worker
        registers its memory a second time, in chunks of one run: what a decode instance
        of larger blocks pulls."""
        if self.attention is None:  # vLLM picks the kernels (the ISA) after making the connector
            self.attention = attention_kind(self._vllm_config)
        self.runs = token_runs(self.attention, kv_caches)
        if self.settings.producer and self.runs:
            self._engine().cache_manager.register_blocks_cache(chunk_desc(layout, self.runs), list(layout.addrs),
                                                               BlocksCacheKey(self.cluster_id, 1))
        log.info("datadist connector: attention kernel %r; %s", self.attention,
                 f"blocks split in {self.runs} runs of token rows" if self.runs else "blocks are not split")

    def _engine(self) -> LLMDataDist:
        """The datadist engine (``register`` starts it, ``close`` ends it)."""
        if self._datadist is None:
            raise RuntimeError("DatadistConnector worker: no datadist engine (register_kv_caches not run, or closed)")
        return self._datadist

    # -- per step ------------------------------------------------------------------------
    def start(self, to_recv: Mapping[str, RecvJob], to_send: Mapping[str, float], idle: bool = False) -> None:
        self._idle = idle
        now = time.monotonic()
        with self._lock:
            for req_id, lease in to_send.items():
                if self._early.pop(req_id, None) is None:
                    self._holding[req_id] = now + lease
                else:
                    self._released.add(req_id)  # already pulled: freed on the next report
            self._pending.update(to_recv)
        if any(0 < job.lease_s / 6 < self._pace for job in to_recv.values()):
            self._wake.set()  # a shorter lease than the renewal thread paces itself on
        self._check_leases(to_recv.values())
        for req_id, job in to_recv.items():
            if job.local_blocks and not job.refused:
                for peer in self._targets(job):
                    self._link_soon(peer)
            self._pool.submit(self._pull, req_id, job)

    def _check_leases(self, jobs: Iterable[RecvJob]) -> None:
        """Warn once when a prefill instance's lease is no longer than a pull may take here.
        A pull renews its peer's leases as it begins and not while it runs (a renewal on
        its link would wait behind it), so a pull that runs longer than the lease may read
        blocks the prefill instance has freed and reused."""
        if self._lease_warned:
            return
        limit_s = self.settings.timeout_ms / 1000.0
        short = [job.lease_s for job in jobs if job.local_blocks and 0 < job.lease_s <= limit_s]
        if short:
            self._lease_warned = True
            log.warning("a prefill instance holds blocks for %.1f s (its kv_lease_duration), no longer than a pull "
                        "may take here (sync_kv_timeout_ms=%d): a pull that slow could read blocks it has freed; "
                        "raise its kv_lease_duration above this instance's sync_kv_timeout_ms, or lower that",
                        min(short), self.settings.timeout_ms)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(freed on the prefill side, loads done, loads failed) since the last call."""
        notes = []
        if self._datadist is not None and self.settings.producer:
            # A step that computes nothing while blocks wait for their pull: wait a little
            # for the notification rather than let the engine loop spin on empty steps.
            waiting = any(deadline > time.monotonic() for deadline in list(self._holding.values()))
            notes = self._datadist.get_notifications(timeout_ms=self.settings.idle_wait_ms if self._idle and waiting
                                                     else 0)
        now = time.monotonic()
        with self._lock:
            for _, text in notes:
                self._note(text, now)
            sent = self._free(now)
            received, failed = self._received, self._failed
            self._received, self._failed = set(), set()
        return sent, received, failed

    def _free(self, now: float) -> set[str]:
        """Requests whose blocks the prefill side frees now: pulled or out of lease (under the lock)."""
        expired = {r for r, deadline in self._holding.items() if deadline <= now}
        for _ in expired:
            self.stats.record("num_kv_expired_reqs")
        sent = (self._released & set(self._holding)) | expired
        for req_id in sent:
            del self._holding[req_id]
            self._notices.pop(req_id, None)
        self._released.clear()
        stale = now - self.settings.lease_s
        self._early = {r: t for r, t in self._early.items() if t > stale}
        self._notices = {r: n for r, n in self._notices.items() if r in self._holding or n[1] > stale}
        return sent

    def _note(self, text: str, now: float) -> None:
        """A decode worker's notification: blocks pulled (free them once every decode rank
        that reads them said so) or a lease renewed."""
        pulled = parse_note(text, "pulled")
        count = parse_readers(text) if pulled else 1
        if not count:
            log.warning("a decode worker's pulled notice names a bad count of readers; ignored (the blocks are "
                        "freed when their lease runs out)")
            pulled = []
        for req_id in pulled:
            seen = self._notices.pop(req_id, (0, now))[0] + 1
            if seen < count:
                self._notices[req_id] = (seen, now)
            elif req_id in self._holding:
                self._released.add(req_id)
            else:
                self._early[req_id] = now
        for req_id in parse_note(text, "renew"):
            if req_id in self._holding:
                self._holding[req_id] = max(self._holding[req_id], now + self.settings.lease_s)

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    # -- the pull thread -----------------------------------------------------------------
    def _targets(self, job: RecvJob) -> list[Endpoint]:
        """The prefill ranks this rank reads from or tells, as NixlConnector maps them (:mod:`.heads`)."""
        return [job.peers[i] for i in sources(len(job.peers), self.tp_size, self.tp_rank)]

    def _plan(self, job: RecvJob) -> TPPlan:
        """What to pull for ``job``; ``ValueError`` (a refusal: nothing moves) when it
        cannot be done with these caches."""
        if job.refused:
            raise ValueError(job.refused)
        if not job.peers:
            raise ValueError("kv_transfer_params name no prefill endpoints (remote_cluster_ids is empty)")
        if job.ratio > 1 and not self.runs:
            raise ValueError(f"prefill blocks of 1/{job.ratio} of this instance's block size: DatadistConnector "
                             f"splits blocks only in the KV cache layouts it knows (see datadist.integrations.vllm."
                             f"blocks), not in this one ({self.attention or 'attention kernel unknown'})")
        return tp_plan(len(job.peers), self.tp_size, self.tp_rank, self.runs, mla=self.mla,
                       total_kv_heads=self.total_kv_heads, kind=self.attention or "attention kernel unknown")

    def _pull(self, req_id: str, job: RecvJob) -> None:
        """Pull ``job`` and tell the prefill ranks: all of them after a pull or a refusal
        (nothing moved, nobody will pull those blocks again), after a failure those still
        linked (a dead peer is not linked again to be told).  Whatever goes wrong, the
        request is reported (a failure: its blocks are load errors) and leaves the leases
        this worker renews: nothing an exception skips keeps it waiting for ever."""
        error: Optional[BaseException] = None
        refused = False
        try:
            refused, error = self._load(req_id, job)
        except BaseException as exc:  # reported below, then raised on (the pool's future holds it)
            error = exc
            raise
        finally:
            try:
                self._tell_all(job, error is None or refused)
            finally:
                self._report(req_id, job, error is not None)

    def _load(self, req_id: str, job: RecvJob) -> tuple[bool, Optional[Exception]]:
        """The pull of ``job``: (refused, the error; None when its blocks arrived)."""
        peer: Optional[Endpoint] = None
        try:
            try:
                plan = self._plan(job)
            except ValueError as exc:
                raise _Refused(str(exc)) from exc
            if job.local_blocks:
                started = time.perf_counter()
                moved = 0
                for read in plan.reads:
                    peer = job.peers[read.source]
                    moved += self._pull_from(peer, job, plan, read)
                self.stats.record("transfer_duration", time.perf_counter() - started)
                self.stats.record("num_blocks", len(job.local_blocks))
                self.stats.record("bytes_transferred", moved)
            return False, None
        except Exception as exc:  # any failure is this request's failed load; the others go on
            self.stats.record("num_failed_transfers")
            where = peer or "the prefill instance"
            if isinstance(exc, (LLMException, OSError, _Refused)):
                log.warning("request %s: pulling %d blocks from %s failed: %s", req_id, len(job.local_blocks),
                            where, exc)
            else:
                log.exception("request %s: pulling %d blocks from %s failed", req_id, len(job.local_blocks), where)
            if peer is not None and isinstance(exc, LLMException):
                self._forget(peer.cluster_id)
            return isinstance(exc, _Refused), exc

    def _tell_all(self, job: RecvJob, everyone: bool) -> None:
        """Tell the prefill ranks of ``job`` that its blocks are done with: ``everyone``,
        or those still linked (a failed peer is not linked again to be told)."""
        try:
            count = readers(len(job.peers), self.tp_size)
            for target in self._targets(job):
                if everyone or target.cluster_id in self._linked:
                    self._tell_pulled(target, job.remote_request_id, count)
        except Exception:  # the prefill side frees the blocks when their lease runs out
            log.exception("could not tell the prefill instance that request %s is done with", job.remote_request_id)

    def _report(self, req_id: str, job: RecvJob, failed: bool) -> None:
        """The request's load is over: reported at the next ``finished`` (with its blocks
        as load errors when ``failed``), and its lease no longer renewed."""
        with self._lock:
            self._pending.pop(req_id, None)
            if job.awaited:
                self._received.add(req_id)
            if failed and job.awaited:
                self._failed.add(req_id)
                self._errors.update(job.local_blocks)

    def _pull_from(self, peer: Endpoint, job: RecvJob, plan: TPPlan, read: Read) -> int:
        """One pull of ``read`` from ``peer``; the bytes it moved."""
        with self._using(peer):
            self._link(peer)
            self._renew_for(peer)
            return self._pull_blocks(peer, job, plan, read)

    def _pull_blocks(self, peer: Endpoint, job: RecvJob, plan: TPPlan, read: Read) -> int:
        if self._cache is None or self.layout is None:
            raise RuntimeError("DatadistConnector worker: no registered KV cache (register_kv_caches not run)")
        chunked = plan.split or job.ratio > 1
        key = (peer.cluster_id, job.ratio if chunked else 0)
        with self._peer_lock(peer.cluster_id):
            handle = self._pulls.get(key)
            if handle is None:
                local = self._split_cache(job.ratio) if chunked else self._cache
                handle = self._engine().cache_manager.prepare_pull_blocks(
                    BlocksCacheKey(peer.cluster_id, 1 if chunked else 0), local)
                self._pulls[key] = handle
        per_block = len(self.layout.addrs) * self.layout.block_bytes
        if not chunked:
            handle.run(job.remote_blocks, job.local_blocks)
            return len(job.remote_blocks) * per_block
        handle.run(*split_pairs(job.remote_blocks, job.local_blocks, job.ratio, self.runs, plan.src_runs,
                                read.src_first, read.dst_first, read.count))
        return len(job.remote_blocks) * per_block // (self.runs * job.ratio) * read.count

    def _split_cache(self, ratio: int) -> Cache:
        """Our cache in chunks of a prefill block's run, for prefill blocks 1/``ratio`` of
        ours or heads split or joined (registered once per ratio; called under a peer lock)."""
        assert self.layout is not None
        with self._lock:
            cache = self._split.get(ratio)
            if cache is None:
                cache = self._engine().cache_manager.register_blocks_cache(
                    chunk_desc(self.layout, self.runs * ratio), list(self.layout.addrs))
                self._split[ratio] = cache
        return cache

    def _peer_lock(self, cluster_id: int) -> threading.Lock:
        with self._lock:
            return self._peer_locks.setdefault(cluster_id, threading.Lock())

    @contextmanager
    def _using(self, peer: Endpoint) -> Iterator[None]:
        """A pull thread links to or pulls from ``peer`` (the renewal thread leaves it be)."""
        with self._lock:
            self._busy[peer.cluster_id] = self._busy.get(peer.cluster_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._busy.pop(peer.cluster_id) - 1
                if left:
                    self._busy[peer.cluster_id] = left

    def _link(self, peer: Endpoint) -> None:
        """Link to ``peer`` unless linked; a link attempt that failed while this call waited
        for it fails this call too (a dead peer costs one link timeout, not one per pull)."""
        asked = time.monotonic()
        with self._peer_lock(peer.cluster_id):
            if peer.cluster_id in self._linked:
                return
            failure = self._link_failures.get(peer.cluster_id)
            if failure is not None and failure[0] >= asked:
                raise LLMException(failure[1], status_code=failure[2])
            cluster = LLMClusterInfo(remote_cluster_id=peer.cluster_id)
            cluster.append_remote_ip_info(peer.host, peer.port)
            ret, _ = self._engine().link_clusters([cluster], timeout=self.settings.timeout_ms)
            if ret != LLMStatusCode.LLM_SUCCESS:
                why = f"link to prefill worker {peer.host}:{peer.port} failed: {ret.name}"
                self._link_failures[peer.cluster_id] = (time.monotonic(), why, ret)
                raise LLMException(why, status_code=ret)
            self._link_failures.pop(peer.cluster_id, None)
            self._linked.add(peer.cluster_id)

    def _link_soon(self, peer: Endpoint) -> None:
        """Link to a new peer on a thread of its own (the pulls from it wait for that link)."""
        with self._lock:
            if peer.cluster_id in self._linked or peer.cluster_id in self._linking:
                return
            self._linking.add(peer.cluster_id)
        with on_instance_cpus():  # called on the model thread, pinned to one core: see register
            threading.Thread(target=self._link_quietly, args=(peer,), name="datadist-vllm-link", daemon=True).start()

    def _link_quietly(self, peer: Endpoint) -> None:
        try:
            self._link(peer)
        except (LLMException, RuntimeError) as exc:  # the pulls from the peer report it
            log.debug("link to %s:%d failed: %s", peer.host, peer.port, exc)
        finally:
            with self._lock:
                self._linking.discard(peer.cluster_id)

    def _forget(self, cluster_id: int) -> None:
        """Drop a link that failed; the next request to that peer links again."""
        with self._peer_lock(cluster_id):
            if cluster_id not in self._linked:
                return
            self._linked.discard(cluster_id)
            for key in [k for k in self._pulls if k[0] == cluster_id]:
                del self._pulls[key]
            if self._datadist is not None:
                try:
                    self._datadist.unlink_clusters([LLMClusterInfo(remote_cluster_id=cluster_id)], timeout=1000,
                                                   force=True)
                except LLMException:
                    pass

    # -- the lease thread ----------------------------------------------------------------
    def _renew_loop(self) -> None:
        """Renew the prefill side's lease of every pull still queued, a few times per lease
        (NixlConnector renews at a sixth of it), so that a slow decode instance keeps its
        blocks and a dead one frees them within one lease.  A pull renews its peer's leases
        as it begins, so it has a whole lease to run (keep ``sync_kv_timeout_ms``, the
        longest a pull runs, below the lease)."""
        while not self._stop.is_set():
            with self._lock:
                pending = list(self._pending.values())
            leases = [job.lease_s for job in pending if job.lease_s > 0]
            if leases:
                self._renew(pending)
            self._pace = min(leases) / 6 if leases else 0.5
            self._wake.wait(self._pace)
            self._wake.clear()

    def _renew(self, pending: list[RecvJob]) -> None:
        """Renew the leases of ``pending`` over the links already made.  A peer that a pull
        thread is linking to or pulling from is left out: its pulls renew every lease of
        that peer as they begin (a renewal would wait for the link behind the pull)."""
        by_peer: dict[int, tuple[Endpoint, list[str]]] = {}
        for job in pending:
            for peer in self._targets(job) if job.lease_s > 0 else []:
                by_peer.setdefault(peer.cluster_id, (peer, []))[1].append(job.remote_request_id)
        for cluster_id, (peer, ids) in by_peer.items():
            with self._lock:
                ready = cluster_id in self._linked and not self._busy.get(cluster_id)
            if ready:
                self._send_renewal(peer, ids)

    def _renew_for(self, peer: Endpoint) -> None:
        """Renew every lease held by ``peer`` for this worker, as a pull from it begins."""
        with self._lock:
            ids = [job.remote_request_id for job in self._pending.values()
                   if job.lease_s > 0 and any(p.cluster_id == peer.cluster_id for p in self._targets(job))]
        if ids:
            self._send_renewal(peer, ids)

    def _send_renewal(self, peer: Endpoint, ids: list[str]) -> None:
        try:
            self._engine().send_notification(peer.cluster_id, renew_note(ids))
            self.stats.record("num_lease_renewals", len(ids))
        except (LLMException, RuntimeError) as exc:  # the pull reports the peer's failure
            log.debug("lease renewal to %s:%d failed: %s", peer.host, peer.port, exc)

    def _tell_pulled(self, peer: Endpoint, remote_request_id: str, count: int = 1) -> None:
        """Let the prefill worker free the request's blocks (also after a failed pull:
        nobody will pull them again) once all ``count`` decode ranks that read it said so."""
        try:
            self._link(peer)
            self._engine().send_notification(peer.cluster_id, pulled_note([remote_request_id], count))
        except Exception as exc:  # never fatal to the pull thread: the lease frees the blocks
            log.warning("could not tell %s:%d that request %s is pulled (%s); it frees the blocks when "
                        "their lease runs out", peer.host, peer.port, remote_request_id, exc,
                        exc_info=not isinstance(exc, (LLMException, RuntimeError)))
            if isinstance(exc, LLMException):
                self._forget(peer.cluster_id)

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._renewer is not None:
            self._renewer.join(10.0)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._datadist is not None:
            self._datadist.finalize()
            self._datadist = None
