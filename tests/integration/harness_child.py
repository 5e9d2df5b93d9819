"""The engine process side of the harness: one engine, driven by commands over a Pipe.

``child_main`` is the process target.  It answers every command with ``("ok", result)`` or
``("exc", payload)`` (exception class and MRO names, status code, message, formatted
traceback); long commands may send ``("note", ...)`` first.  Caches are kept by name, and
the memory of registered caches is held here so it outlives the registration.
"""
from __future__ import annotations

import contextlib
import enum
import multiprocessing.connection
import os
import re
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from harness_specs import DTYPES, Desc, Key, Ref

__all__ = ["child_main", "GATE_HOLD_S"]

#: How long a :class:`_Gate` holds a layer that the test never opens.
GATE_HOLD_S = 60.0


def child_main(conn: multiprocessing.connection.Connection, role: str, cluster_id: int,
               config: Dict[str, Any], init: bool, netns: Optional[str] = None) -> None:
    """Entry point of an engine process: set up (inside network namespace ``netns`` when
    given), then serve commands until ``exit``."""
    try:
        if netns is not None:
            from datadist.bench.netns import enter

            enter(netns)
        child = _Child(conn, role, cluster_id, config)
        if init:
            child.op_init()
    except BaseException:
        conn.send(("exc", _exc_payload()))
        conn.close()
        raise SystemExit(1)
    conn.send(("ready", {"pid": os.getpid()}))
    while True:
        try:
            op, args, kwargs = conn.recv()
        except EOFError:
            # The test process went away: nothing left to answer to.
            raise SystemExit(3)
        try:
            result = getattr(child, f"op_{op}")(*args, **kwargs)
        except BaseException:
            conn.send(("exc", _exc_payload()))
            continue
        conn.send(("ok", result))
        if op == "exit":
            conn.close()
            return


def _exc_payload() -> Dict[str, Any]:
    """The exception being handled, as the answer to a failed command."""
    exc = sys.exc_info()[1]
    code = getattr(exc, "status_code", None)
    return {
        "exc_type": type(exc).__name__,
        "status_code": None if code is None else int(code),
        "message": str(exc),
        "remote_traceback": traceback.format_exc(),
        "bases": [c.__name__ for c in type(exc).__mro__],
    }


def _exc_report(exc: BaseException) -> Dict[str, Any]:
    """An expected exception as data: class, MRO names, status code, message."""
    code = getattr(exc, "status_code", None)
    return {"error": type(exc).__name__, "bases": [c.__name__ for c in type(exc).__mro__],
            "status_code": None if code is None else int(code), "message": str(exc)}


def _plain(value: Any) -> Any:
    """An engine result as plain data (enums as ints, caches as id and addresses), so the
    test process can unpickle it without datadist objects."""
    if isinstance(value, enum.Enum):
        return int(value.value) if isinstance(value.value, int) else value.name
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "cache_id") and hasattr(value, "tensor_addrs"):
        return {"cache_id": value.cache_id, "addrs": list(value.tensor_addrs)}
    return value


class _Gate:
    """The layer synchronizer of the async tests (registered as a ``LayerSynchronizer``):
    ``synchronize_layer(i)`` blocks until the test opens layer i, then answers what the test
    chose for it (True: computed, False: never will be).  It records the timeout each call
    is given (:attr:`timeouts`) and otherwise ignores it; a layer never opened raises
    ``TimeoutError`` after :data:`GATE_HOLD_S`, so its thread ends even if a test forgets it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._answers: Dict[int, bool] = {}
        #: ``(layer_index, timeout_in_millis)`` of every call, in call order.
        self.timeouts: List[Tuple[int, Optional[int]]] = []

    def open(self, layers: Sequence[int], answer: bool) -> None:
        with self._cond:
            self._answers.update((layer, answer) for layer in layers)
            self._cond.notify_all()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        with self._cond:
            self.timeouts.append((layer_index, timeout_in_millis))
            if not self._cond.wait_for(lambda: layer_index in self._answers, GATE_HOLD_S):
                raise TimeoutError(f"layer {layer_index} was never opened")
            return self._answers[layer_index]


class _Child:
    """State of one engine process: the engine, its caches and the memory it registered."""

    def __init__(self, conn: multiprocessing.connection.Connection, role: str,
                 cluster_id: int, config: Dict[str, Any]) -> None:
        import torch  # noqa: F401  (imported before the baseline snapshot is taken)

        import datadist

        self.dd = datadist
        self.conn = conn
        self.role = role
        self.cluster_id = cluster_id
        self.config = config
        self.engine: Any = None
        self.caches: Dict[str, Any] = {}
        self.kinds: Dict[str, str] = {}
        self.memory: Dict[str, List[Any]] = {}
        self.tasks: Dict[str, Tuple[Any, _Gate]] = {}
        self.handles: Dict[str, Any] = {}
        datadist.LayerSynchronizer.register(_Gate)

    # building datadist objects

    def _desc(self, d: Desc) -> Any:
        dd = self.dd
        return dd.CacheDesc(d.num_tensors, list(d.shape), getattr(dd.DataType, DTYPES[d.dtype][0]),
                            getattr(dd.Placement, d.placement))

    def _resolve(self, value: Any) -> Any:
        if isinstance(value, Key):
            return getattr(self.dd, value.kind)(*self._resolve(value.args))
        if isinstance(value, Ref):
            return self.caches[value.name]
        if isinstance(value, Desc):
            return self._desc(value)
        if isinstance(value, list):
            return [self._resolve(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self._resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: self._resolve(v) for k, v in value.items()}
        return value

    def _options(self, config: Dict[str, Any]) -> Dict[str, str]:
        cfg = self.dd.LLMConfig()
        for prop, value in config.items():
            setattr(cfg, prop, value)
        return cfg.generate_options()

    def _user_tensors(self, d: Desc) -> List[Any]:
        import torch

        dtype = getattr(torch, DTYPES[d.dtype][1])
        return [torch.zeros(tuple(d.shape), dtype=dtype, device=d.device) for _ in range(d.num_tensors)]

    def _byte_views(self, name: str) -> List[Any]:
        if name in self.memory:
            return self._byte_views_of(self.memory[name])
        return self._byte_views_of(self.engine.cache_manager.get_cache_tensors(self.caches[name]))

    @staticmethod
    def _byte_views_of(tensors: Sequence[Any]) -> List[Any]:
        import torch

        return [t.reshape(-1).view(torch.uint8) for t in tensors]

    # commands

    def op_init(self, config: Optional[Dict[str, Any]] = None) -> None:
        if config is not None:
            self.config = config
        role = getattr(self.dd.LLMRole, self.role)
        self.engine = self.dd.LLMDataDist(role, self.cluster_id)
        self.engine.init(self._options(self.config))

    def op_construct(self) -> None:
        """Create the engine without initializing it."""
        self.engine = self.dd.LLMDataDist(getattr(self.dd.LLMRole, self.role), self.cluster_id)

    def op_ping(self) -> int:
        return os.getpid()

    def op_exit(self) -> None:
        if self.engine is not None:
            self.engine.finalize()

    def op_finalize(self) -> None:
        self.engine.finalize()

    def op_second_engine(self, role: str, cluster_id: int, config: Dict[str, Any]) -> None:
        """Create and init another engine in this process (the contract forbids it)."""
        other = self.dd.LLMDataDist(getattr(self.dd.LLMRole, role), cluster_id)
        other.init(self._options(config))

    def op_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _plain(getattr(self.engine, method)(*self._resolve(args),
                                                   **self._resolve(kwargs)))

    def _cluster_infos(self, clusters: Sequence[Tuple[int, str, int]]) -> List[Any]:
        infos = []
        for remote_id, ip, port in clusters:
            ci = self.dd.LLMClusterInfo()
            ci.remote_cluster_id = remote_id
            ci.append_local_ip_info(ip, 0)
            ci.append_remote_ip_info(ip, port)
            infos.append(ci)
        return infos

    def op_link(self, clusters: Sequence[Tuple[int, str, int]], timeout: int = 3000
                ) -> Tuple[int, List[int]]:
        ret, rets = self.engine.link_clusters(self._cluster_infos(clusters), timeout=timeout)
        return int(ret), [int(r) for r in rets]

    def op_timed_link(self, clusters: Sequence[Tuple[int, str, int]], timeout: int = 3000
                      ) -> Tuple[int, List[int], float]:
        t0 = time.monotonic()
        ret, rets = self.op_link(clusters, timeout)
        return ret, rets, time.monotonic() - t0

    def op_unlink(self, clusters: Sequence[Tuple[int, str, int]], timeout: int = 3000,
                  force: bool = False) -> Tuple[int, List[int]]:
        ret, rets = self.engine.unlink_clusters(self._cluster_infos(clusters), timeout=timeout,
                                                force=force)
        return int(ret), [int(r) for r in rets]

    def op_alloc(self, name: str, desc: Desc, *, blocks: bool = False,
                 keys: Sequence[Key] = (), bkey: Optional[Key] = None) -> Dict[str, Any]:
        cm = self.engine.cache_manager
        if blocks:
            cache = cm.allocate_blocks_cache(self._desc(desc), self._resolve(bkey))
        else:
            cache = cm.allocate_cache(self._desc(desc), self._resolve(list(keys)))
        self.caches[name] = cache
        self.kinds[name] = "blocks" if blocks else "cache"
        return _plain(cache)

    def op_register(self, name: str, desc: Desc, *, blocks: bool = False,
                    keys: Sequence[Key] = (), bkey: Optional[Key] = None) -> Dict[str, Any]:
        cm = self.engine.cache_manager
        tensors = self._user_tensors(desc)
        # NPU memory registers as its tensors here (by address: test_fake_npu_device)
        addrs = tensors if desc.device.startswith("npu") else [t.data_ptr() for t in tensors]
        if blocks:
            cache = cm.register_blocks_cache(self._desc(desc), addrs, self._resolve(bkey))
        else:
            cache = cm.register_cache(self._desc(desc), addrs, self._resolve(list(keys)))
        self.caches[name] = cache
        self.kinds[name] = "registered"
        self.memory[name] = tensors
        return _plain(cache)

    def op_cpu_cache(self, name: str, desc: Desc) -> Dict[str, Any]:
        tensors = self._user_tensors(desc)
        cache = self.dd.Cache.create_cpu_cache(self._desc(desc), [t.data_ptr() for t in tensors])
        self.caches[name] = cache
        self.kinds[name] = "cpu"
        self.memory[name] = tensors
        return _plain(cache)

    def op_free(self, name: str) -> None:
        cm = self.engine.cache_manager
        cache = self.caches.pop(name)
        kind = self.kinds.pop(name)
        if kind == "blocks":
            cm.deallocate_blocks_cache(cache)
        elif kind == "cache":
            cm.deallocate_cache(cache)
        elif kind == "registered":
            cm.unregister_cache(cache.cache_id)
        self.memory.pop(name, None)

    def op_free_all(self) -> None:
        for name in list(self.caches):
            self.op_free(name)

    def op_cm(self, method: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        fn = getattr(self.engine.cache_manager, method)
        args, kwargs = self._resolve(tuple(args)), self._resolve(kwargs)
        t0 = time.monotonic()
        result = fn(*args, **kwargs)
        return {"result": _plain(result), "elapsed": time.monotonic() - t0}

    def op_timed_cm(self, method: str, args: Sequence[Any], kwargs: Dict[str, Any]
                    ) -> Dict[str, Any]:
        """Run a call that is expected to fail; report the error and when it came."""
        fn = getattr(self.engine.cache_manager, method)
        args, kwargs = self._resolve(tuple(args)), self._resolve(kwargs)
        t0 = time.monotonic()
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            return dict(_exc_report(exc), elapsed=time.monotonic() - t0)
        return {"error": None, "elapsed": time.monotonic() - t0}

    def op_loop(self, method: str, args: Sequence[Any], kwargs: Dict[str, Any],
                max_seconds: float) -> Dict[str, Any]:
        """Repeat a call until it raises (or ``max_seconds``); a note after the first success."""
        fn = getattr(self.engine.cache_manager, method)
        args, kwargs = self._resolve(tuple(args)), self._resolve(kwargs)
        end = time.monotonic() + max_seconds
        done = 0
        while time.monotonic() < end:
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                return dict(_exc_report(exc), iterations=done, t_error=time.monotonic())
            done += 1
            if done == 1:
                self.conn.send(("note", "running"))
        return {"iterations": done, "error": None, "t_error": None}

    def op_concurrent(self, method: str, calls: Sequence[Tuple[Sequence[Any], Dict[str, Any]]],
                      repeat: int = 1) -> List[Optional[Dict[str, Any]]]:
        """Each call of ``calls`` (``cache_manager.<method>(*args, **kwargs)``) in a thread
        of its own, all started behind one barrier, ``repeat`` times in a row; per call,
        None or the first error it raised."""
        fn = getattr(self.engine.cache_manager, method)
        resolved = [(self._resolve(tuple(a)), self._resolve(k)) for a, k in calls]
        barrier = threading.Barrier(len(resolved), timeout=30)
        errors: List[Optional[Dict[str, Any]]] = [None] * len(resolved)

        def one(i: int) -> None:
            args, kwargs = resolved[i]
            barrier.wait()
            for _ in range(repeat):
                try:
                    fn(*args, **kwargs)
                except Exception as exc:
                    errors[i] = _exc_report(exc)
                    return

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(resolved))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            if t.is_alive():
                raise TimeoutError("a concurrent call did not return within 60 s")
        return errors

    def op_keep_calling(self, method: str, args: Sequence[Any], kwargs: Dict[str, Any], stop_file: str,
                        max_seconds: float) -> Dict[int, int]:
        """Repeat a call, whatever it raises, until ``stop_file`` exists (at most
        ``max_seconds``): how many ended with each status code (0: went through)."""
        fn = getattr(self.engine.cache_manager, method)
        args, kwargs = self._resolve(tuple(args)), self._resolve(kwargs)
        end = time.monotonic() + max_seconds
        counts: Dict[int, int] = {}
        while not os.path.exists(stop_file) and time.monotonic() < end:
            try:
                fn(*args, **kwargs)
                code = 0
            except self.dd.LLMException as exc:
                code = int(exc.status_code)
            counts[code] = counts.get(code, 0) + 1
        return counts

    def op_free_under_pushes(self, name: str, bkey: Key, rounds: int, mark: int) -> Dict[str, Any]:
        """Free blocks cache ``name`` (named by ``bkey``) while a peer pushes bytes
        ``mark`` into it, allocate a probe cache of its size at once (the pool's first
        fit: where the freed one was) and fill it, name a new cache by ``bkey``, and once
        the peer's next push lands there (its previous one has ended then) count the
        probe's bytes that changed.  Per round: whether the probe took the freed memory,
        and its bytes overwritten."""
        import torch

        cm = self.engine.cache_manager
        desc = self.caches[name].cache_desc
        same, overwritten = [], []
        for _ in range(rounds):
            self._await_mark(name, mark)  # pushes are landing: one is under way now
            freed = self.caches[name].tensor_addrs[0]
            self.op_free(name)
            probe = cm.allocate_blocks_cache(desc)
            probe_bytes = cm.get_cache_tensors(probe)[0].view(-1).view(torch.uint8)
            probe_bytes.fill_(0xA5)
            self.caches[name] = cm.allocate_blocks_cache(desc, self._resolve(bkey))
            self.kinds[name] = "blocks"
            self._byte_views(name)[0].zero_()
            self._await_mark(name, mark)
            same.append(probe.tensor_addrs[0] == freed)
            overwritten.append(int((probe_bytes != 0xA5).sum()))
            cm.deallocate_blocks_cache(probe)
        return {"same_address": same, "overwritten": overwritten}

    def op_unregister_under_pushes(self, name: str, mark: int) -> None:
        """Unregister cache ``name`` while a peer's push is landing in it, and zero its
        memory at once (kept as ``name + "-kept"``, to read back once the peer stopped)."""
        self._await_mark(name, mark)
        tensors = self.memory[name]
        self.op_free(name)  # returns once no peer copies into the memory any more
        for view in self._byte_views_of(tensors):
            view.zero_()
        self.memory[name + "-kept"] = tensors

    def _await_mark(self, name: str, mark: int, timeout: float = 20.0) -> None:
        """Wait until the first byte of cache ``name`` is ``mark`` (a peer's push landed)."""
        first = self._byte_views(name)[0][:1]
        deadline = time.monotonic() + timeout
        while int(first[0]) != mark:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no push into {name} within {timeout} s")
            os.sched_yield()

    def op_finalize_under_load(self, method: str, args: Sequence[Any], kwargs: Dict[str, Any], threads: int,
                               bound_s: float) -> Dict[str, Any]:
        """``threads`` threads repeat ``cache_manager.<method>`` until it raises; once each
        has finished one call, the engine is finalized.  Returns, per thread, the error
        that ended its loop (None: it never ended within ``bound_s`` after finalize), the
        calls each finished, and how long finalize took."""
        fn = getattr(self.engine.cache_manager, method)
        args, kwargs = self._resolve(tuple(args)), self._resolve(kwargs)
        ended: List[Optional[Dict[str, Any]]] = [None] * threads
        counts = [0] * threads
        started = threading.Barrier(threads + 1, timeout=30)

        def loop(i: int) -> None:
            while True:
                try:
                    fn(*args, **kwargs)
                except Exception as exc:
                    ended[i] = _exc_report(exc)
                    if not counts[i]:
                        started.abort()
                    return
                counts[i] += 1
                if counts[i] == 1:
                    started.wait()

        workers = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
        for t in workers:
            t.start()
        started.wait()  # every thread has finished a call and is in its next one (or about to be)
        t0 = time.monotonic()
        self.engine.finalize()
        took = time.monotonic() - t0
        for t in workers:
            t.join(max(0.0, t0 + bound_s - time.monotonic()))
        return {"errors": ended, "calls": counts, "finalize_s": took, "ended_s": time.monotonic() - t0}

    def op_agent_faults(self, n: int) -> bool:
        """Queue ``n`` calls that raise on the engine's agent thread; whether it runs."""
        agent = self.engine._engine_or_raise().live_agent()

        def broken() -> None:
            raise RuntimeError("a bug in a call queued for the agent")

        for _ in range(n):
            agent.call(broken)
        return agent._thread.is_alive()

    def op_prepare(self, name: str, method: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
        """Keep the transfer handle ``cache_manager.<method>(*args, **kwargs)`` returns
        (``prepare_push_blocks`` / ``prepare_pull_blocks``) as ``name``; returns its repr."""
        fn = getattr(self.engine.cache_manager, method)
        self.handles[name] = fn(*self._resolve(tuple(args)), **self._resolve(kwargs))
        return repr(self.handles[name])

    def op_run(self, name: str, *args: Any) -> None:
        """``run(*args)`` of the handle kept as ``name``."""
        self.handles[name].run(*self._resolve(args))

    def op_release(self, name: str) -> None:
        """``release()`` of the handle kept as ``name``."""
        self.handles[name].release()

    def op_run_batch(self, name: str, pairs: Sequence[Tuple[List[int], List[int]]]) -> None:
        """``run_batch(pairs)`` of the handle kept as ``name``."""
        self.handles[name].run_batch([tuple(p) for p in pairs])

    def op_transfer_async(self, name: str, src: str, configs: Sequence[Key], *, gate: bool = True,
                          **kwargs: Any) -> None:
        """``transfer_cache_async`` of cache ``src`` with a fresh :class:`_Gate` (``gate=False``:
        a plain object instead, which the call must refuse); the task is kept as ``name``."""
        synchronizer = _Gate() if gate else object()
        task = self.engine.cache_manager.transfer_cache_async(self.caches[src], synchronizer,
                                                              self._resolve(list(configs)),
                                                              **self._resolve(kwargs))
        self.tasks[name] = (task, synchronizer)

    def op_open_layers(self, name: str, layers: Sequence[int], answer: bool = True) -> None:
        """Let task ``name``'s synchronizer answer ``answer`` for ``layers``."""
        self.tasks[name][1].open(layers, answer)

    def op_gate_calls(self, name: str) -> List[Tuple[int, Optional[int]]]:
        """``(layer_index, timeout_in_millis)`` of each call task ``name`` made to its gate."""
        with self.tasks[name][1]._cond:
            return list(self.tasks[name][1].timeouts)

    def op_task(self, name: str, method: str, timeout_ms: Optional[int]) -> Dict[str, Any]:
        """``synchronize`` or ``get_results`` of task ``name``; statuses as ints, and the
        seconds the call took."""
        t0 = time.monotonic()
        result = getattr(self.tasks[name][0], method)(timeout_ms)
        return {"result": _plain(result), "elapsed": time.monotonic() - t0}

    def op_write(self, name: str, data: Sequence[bytes]) -> None:
        import torch

        views = self._byte_views(name)
        assert len(views) == len(data), (len(views), len(data))
        for view, chunk in zip(views, data):
            view.copy_(torch.frombuffer(bytearray(chunk), dtype=torch.uint8))
        if views and views[0].device.type == "cuda":
            torch.cuda.synchronize(views[0].device)

    def op_read(self, name: str) -> List[bytes]:
        return [v.cpu().numpy().tobytes() for v in self._byte_views(name)]

    def op_tensor_info(self, name: str) -> List[Dict[str, Any]]:
        tensors = self.engine.cache_manager.get_cache_tensors(self.caches[name])
        return [{"shape": list(t.shape), "dtype": str(t.dtype), "ptr": t.data_ptr(),
                 "device": str(t.device)} for t in tensors]

    def op_links(self) -> Dict[int, Dict[str, Any]]:
        """Per linked cluster: the transport's name and how many of the peer's device
        allocations it has open by CUDA IPC (shm links)."""
        engine = self.engine._engine_or_raise()
        return {cid: {"path": link.path,
                      "ipc_open": sum(r is not None for r in getattr(link.transport, "_device", {}).values())}
                for cid in engine.linked_clusters() for link in [engine.find_link(cid)] if link is not None}

    def op_tamper_copy(self, how: str) -> None:
        """Make this process's next summed one-sided copy (:func:`native.copy_plan_stream`,
        the real one) go wrong: ``"after"`` changes one byte of its destination right after
        it (for a push: the peer's memory, mapped here, before the peer sums it);
        ``"shifted"`` reads its source one word off (a wrong plan, as a stale mapping would)."""
        import ctypes

        from datadist.engine import native

        real = native.copy_plan_stream

        def tampered(plan: Any, summed: Any, threads: int = native.COPY_THREADS) -> int:
            native.copy_plan_stream = real  # once
            moved = real(plan.rebase(src_delta=8) if how == "shifted" else plan, summed, threads)
            if how == "after":
                ctypes.c_uint8.from_address(int(plan.dst_bases[0]) + int(plan.dst_offs[0])).value ^= 0x10
            return moved

        native.copy_plan_stream = tampered

    def op_warm_collectives(self) -> None:
        """Create and drop one TCPStore server: torch.distributed opens a wake-up pipe the
        first time it does so and keeps it for the process's life.  Leak checks of the
        collective transports take their baseline after this, so they see only what a link
        itself holds."""
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
        del store

    def op_snapshot(self) -> Dict[str, Any]:
        """Open fds, Python threads, and shared-memory files (named or memfd) mapped here."""
        fds: Dict[int, str] = {}
        for entry in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                fds[int(entry)] = os.readlink(f"/proc/self/fd/{entry}")
        shm = {t for t in fds.values() if t.startswith("/dev/shm/")}
        maps = set()
        with open("/proc/self/maps") as lines:
            for line in lines:
                m = re.search(r"\s(/dev/shm/\S+|/memfd:\S+)( \(deleted\))?$", line.rstrip("\n"))
                if m:
                    maps.add(m.group(1))
                    if m.group(1).startswith("/dev/shm/") and not m.group(2):
                        shm.add(m.group(1))
        return {
            "fds": fds,
            "threads": sorted((t.ident, t.name) for t in threading.enumerate()),
            "shm": sorted(s for s in shm if not os.path.basename(s).startswith("sem.")),
            "maps": sorted(maps),
        }
