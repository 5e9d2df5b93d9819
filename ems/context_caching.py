"""``ContextCaching``: save / load / exists of KV blocks through the pool.

Order of calls (one process): ``Ems.init`` -> ``Ems.get_cc`` -> ``register_kvcache`` (not
needed for the V0 form) -> any mix of ``save`` / ``load`` / ``exists`` and their async
twins, from any thread.

A save is RESERVE (room in the arena, invisible) -> copy straight from the KV cache into
the mapped arena -> checksum -> COMMIT (visible).  A load is GET (pins the leading present
values under a lease) -> copy out of the arena -> verify -> RELEASE.  Every wait on the
daemon carries the call's deadline (``option.timeout``; 0: ``NO_TIMEOUT_BOUND_MS``).

At shutdown (process exit included) async calls not started are cancelled; running ones
get until their deadline (those of ``timeout=0``: ``EXIT_GRACE_S``), then their
connections are shut so that they fail at once; nothing waits without a bound.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional

from ._errors import EmsError, PoolDisconnected, to_ems
from .client.conn import Connection
from .client.mover import Mover, mover_for
from .client.pool import PoolClient
from .common.exception import EmsErrorCode, EmsException
from .forms import V0, Request, parse_exists, parse_transfer
from .future import CcFuture
from .keys import Namespace
from .kvcache import Copier, DeviceCopier, HostCopier, KvLayout
from .pool import wire
from .profiling import Profiler
from .types import CcResult, call_deadline

log = logging.getLogger("ems")

__all__ = ["ContextCaching"]

_HOST = HostCopier()

#: Seconds shutdown waits for running async calls of ``timeout=0`` (others: until their
#: own deadline), and then again for calls whose connections it shut.
EXIT_GRACE_S = 5.0


def _leading(flags: List[bool]) -> int:
    n = 0
    for ok in flags:
        if not ok:
            break
        n += 1
    return n


class ContextCaching:
    """Context caching on the pool; obtained from :meth:`ems.Ems.get_cc`."""

    def __init__(self, pool: PoolClient, ns: Namespace, kvcache_type: str, verify_reads: bool,
                 max_inflight: int, profiler: Profiler) -> None:
        self._pool = pool
        self._ns = ns
        self._kvcache_type = kvcache_type
        self._verify = verify_reads
        self._max_inflight = max_inflight
        self._profiler = profiler
        self._layout: Optional[KvLayout] = None
        self._lock = threading.Lock()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._executor_pid = 0
        #: Async calls not finished -> their deadline (None for ``timeout=0``), for shutdown.
        self._calls: Dict["concurrent.futures.Future[CcResult]", Optional[float]] = {}

    # -- registration -------------------------------------------------------------------
    def register_kvcache(self, kvcache: Any, store_layer_group_desc: Optional[List[List[int]]] = None) -> None:
        """Register the KV cache the hash, token and chunk forms address.

        Args:
            kvcache: ``kvcache[layer][kv]`` tensors ``[blocks, block_size, heads, head_size]``
                (``kv``: K and V; for MLA one tensor, or the latent and rope parts), one
                ``blocks`` and ``block_size``, one device; a layer's tensors may differ in
                width and dtype, and every layer repeats layer 0's.
            store_layer_group_desc: layer-index lists, one per layer group of the chunk
                form (default: one group of all layers).
        Raises:
            EmsException(EMS_INVALID_ARGUMENT) naming the argument.
        """
        try:
            layout = KvLayout(kvcache, store_layer_group_desc, self._kvcache_type)
        except Exception as exc:
            raise to_ems(exc) from None
        with self._lock:
            self._layout = layout

    # -- public calls -------------------------------------------------------------------
    def save(self, *args: Any, **kwargs: Any) -> CcResult:
        """Save values; ``success`` = leading keys stored.  Forms: see :mod:`ems.forms`.

        Raises: EMS_INVALID_ARGUMENT, EMS_IO_TIMEOUT (deadline), EMS_IO_ERROR (pool down).
        """
        req = self._parse("save", "sync", args, kwargs)
        return self._run("save", "sync", req, self._deadline(req))

    def load(self, *args: Any, **kwargs: Any) -> CcResult:
        """Load values from the first key until the first miss; ``success`` = keys filled."""
        req = self._parse("load", "sync", args, kwargs)
        return self._run("load", "sync", req, self._deadline(req))

    def async_save(self, *args: Any, **kwargs: Any) -> CcFuture:
        """``save`` in the background; arguments are checked now (raising at once)."""
        req = self._parse("save", "async", args, kwargs)
        return self._submit("save", req)

    def async_load(self, *args: Any, **kwargs: Any) -> CcFuture:
        """``load`` in the background; the buffers must stay untouched until it is done."""
        req = self._parse("load", "async", args, kwargs)
        return self._submit("load", req)

    def exists(self, *args: Any, **kwargs: Any) -> CcResult:
        """How many leading hashes the pool holds.  Never raises for pool faults or the
        deadline (they read as 0 hits); raises EMS_INVALID_ARGUMENT for bad arguments."""
        started = time.perf_counter()
        try:
            keys, option = parse_exists(args, kwargs, self._ns, self._layout)
        except Exception as exc:
            raise self._refused("exists", "sync", exc, started) from None
        hits = 0
        error = None
        if len(keys):
            deadline = call_deadline(option.timeout)
            try:
                hits = self._pool.exists(keys, option.read_local_only, deadline)
            except (EmsError, OSError) as exc:
                error = to_ems(exc).status_code().name
        self._profiler.record("exists", "sync", "hash", len(keys), hits, 0, started, error)
        return CcResult(hits, len(keys))

    def is_ready(self, future: CcFuture) -> bool:
        """Whether ``future`` finished; never blocks."""
        if not isinstance(future, CcFuture):
            raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT,
                               f"invalid argument 'ccfuture': must be a CcFuture, got {type(future).__name__}")
        return future.done()

    def get_result(self, future: CcFuture) -> CcResult:
        """Block until ``future`` finishes; its result, or its ``EmsException``."""
        if not isinstance(future, CcFuture):
            raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT,
                               f"invalid argument 'ccfuture': must be a CcFuture, got {type(future).__name__}")
        return future.result()

    # -- machinery ----------------------------------------------------------------------
    def _parse(self, op: str, mode: str, args: Any, kwargs: Any) -> Request:
        started = time.perf_counter()
        try:
            return parse_transfer(op if mode == "sync" else f"async_{op}", args, kwargs, self._ns, self._layout)
        except Exception as exc:
            raise self._refused(op, mode, exc, started) from None

    def _refused(self, op: str, mode: str, exc: Exception, started: float) -> EmsException:
        """The exception of a call refused before it reached the pool, its profiling
        record written (one per call, refused ones too: form ``unknown``, no keys)."""
        err = to_ems(exc)
        self._profiler.record(op, mode, "unknown", 0, 0, 0, started, err.status_code().name)
        return err

    @staticmethod
    def _deadline(req: Request) -> float:
        return call_deadline(req.option.timeout)

    def _submit(self, op: str, req: Request) -> CcFuture:
        deadline = self._deadline(req)
        with self._lock:
            if self._executor is None or self._executor_pid != os.getpid():
                # After fork the parent's worker threads do not exist here: start anew.
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self._max_inflight, thread_name_prefix="ems-cc")
                self._executor_pid = os.getpid()
            executor = self._executor
            fut = executor.submit(self._run, op, "async", req, deadline)
            self._calls[fut] = deadline if req.option.timeout else None
        fut.add_done_callback(self._finished)
        return CcFuture(fut)

    def _finished(self, fut: "concurrent.futures.Future[CcResult]") -> None:
        with self._lock:
            self._calls.pop(fut, None)

    def _run(self, op: str, mode: str, req: Request, deadline: Optional[float]) -> CcResult:
        started = time.perf_counter()
        moved = [0]
        try:
            if op == "save":
                done = self._save(req, deadline, moved)
            else:
                done = self._load(req, deadline, moved)
        except Exception as exc:
            err = to_ems(exc)
            self._profiler.record(op, mode, req.form, req.total, 0, moved[0], started, err.status_code().name)
            raise err from None
        self._profiler.record(op, mode, req.form, req.total, done, moved[0], started)
        return CcResult(done, req.total)

    def _mover(self, req: Request, conn: Connection) -> Mover:
        """What moves ``req``'s values on ``conn``'s transport."""
        if req.form == V0:
            copier: Copier = _HOST if req.device == "cpu" else DeviceCopier(req.device)
            what = "value_list"
        else:
            assert self._layout is not None
            copier, what = self._layout.copier, "kvcache"
        return mover_for(conn, copier, self._verify, what)

    def _save(self, req: Request, deadline: Optional[float], moved: List[int]) -> int:
        ok: List[bool] = []
        with self._pool.connection(deadline) as conn:
            mover = self._mover(req, conn)
            # Reservations cannot be evicted until committed, so a call larger than the pool
            # goes in batches of at most half its capacity: each batch's commits make room.
            # A batch also holds at most the keys one frame may list.
            budget = max(1, conn.info.capacity // 2)
            start = 0
            while start < req.total:
                end, size = start, 0
                while end < min(req.total, start + wire.MAX_KEYS) and \
                        (end == start or size + req.values[end].size <= budget):
                    size += req.values[end].size
                    end += 1
                ok.extend(self._save_batch(req, start, end, conn, mover, deadline, moved))
                start = end
        return _leading(ok)

    def _save_batch(self, req: Request, start: int, end: int, conn: Connection, mover: Mover,
                    deadline: Optional[float], moved: List[int]) -> List[bool]:
        sizes = [v.size for v in req.values[start:end]]
        reply = conn.call(wire.Reserve(req.keys[start:end], sizes, skip_existing=req.form != V0), deadline,
                          wire.ReserveReply)
        offsets = list(reply.offsets)
        if len(offsets) != end - start:
            raise PoolDisconnected("the pool answered RESERVE for another number of keys")
        keys: List[str] = []
        offs: List[int] = []
        crcs: List[int] = []
        try:
            for i, off in enumerate(offsets, start):
                if off < 0:
                    continue
                vp = req.values[i]
                crcs.append(mover.save(vp, off, deadline))
                keys.append(req.keys[i])
                offs.append(off)
                moved[0] += vp.size
        except BaseException:
            conn.broken = True  # the daemon frees the reservations when the connection closes
            raise
        stored = {}
        if keys:
            # The daemon stores a value only if its checksum matches: over TCP it compares
            # them with what it received (a value changed on the way is not stored).
            commit = conn.call(wire.Commit(keys, offs, crcs, req.option.write_rcache), deadline, wire.CommitReply)
            stored = dict(zip(offs, commit.stored))
        return [off == wire.SKIPPED or bool(stored.get(off)) for off in offsets]

    def _load(self, req: Request, deadline: Optional[float], moved: List[int]) -> int:
        """How many leading values were loaded: in batches of the keys one frame may list,
        up to the first miss."""
        n = 0
        with self._pool.connection(deadline) as conn:
            mover = self._mover(req, conn)
            for start in range(0, req.total, wire.MAX_KEYS):
                end = min(req.total, start + wire.MAX_KEYS)
                n += self._load_batch(req, start, end, conn, mover, deadline, moved)
                if n < end:
                    break
        return n

    def _load_batch(self, req: Request, start: int, end: int, conn: Connection, mover: Mover,
                    deadline: Optional[float], moved: List[int]) -> int:
        reply = conn.call(wire.Get(req.keys[start:end], req.option.read_local_only), deadline, wire.GetReply)
        n = 0
        bad = None
        try:
            for i, (off, size, crc) in enumerate(zip(reply.offsets, reply.sizes, reply.checksums), start):
                vp = req.values[i]
                if size != vp.size:
                    break  # stored under another layout: a miss, never a partial fill
                if not mover.load(vp, off, crc, deadline):
                    log.error("the value of %r failed its checksum when loaded from the pool at %s: "
                              "a miss, dropped from the pool", req.keys[i], self._pool.address)
                    bad = (req.keys[i], off)
                    break
                moved[0] += size
                n += 1
        finally:
            if not conn.broken:
                if bad is not None:
                    conn.call(wire.Drop([bad[0]], [bad[1]]), deadline)
                conn.send(wire.Release(reply.lease), deadline)
        return n

    def _close(self) -> bool:
        """Stop the async calls, within a bound: those not started are cancelled, running
        ones get until their deadline (``timeout=0``: :data:`EXIT_GRACE_S`), then their
        connections are shut and they get :data:`EXIT_GRACE_S` more to fail.  Whether
        none is left running (only then may the arena be unmapped under them)."""
        with self._lock:
            executor, self._executor = self._executor, None
            calls = dict(self._calls)
        if executor is None or self._executor_pid != os.getpid():
            return True
        executor.shutdown(wait=False, cancel_futures=True)
        now = time.monotonic()
        until = max((now + EXIT_GRACE_S if d is None else d for d in calls.values()), default=now)
        # Cancelled calls are done() but never "notified": wait() would wait on them.
        running = [f for f in calls if not f.done()]
        _, left = concurrent.futures.wait(running, timeout=max(0.0, until - now))
        if left:
            log.warning("%d async EMS call(s) still running at shutdown: their pool connections are shut",
                        len(left))
            self._pool.interrupt()
            _, left = concurrent.futures.wait(left, timeout=EXIT_GRACE_S)
        return not left
