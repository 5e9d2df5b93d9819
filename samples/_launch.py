"""Process plumbing shared by the samples.

Every engine runs in its own spawned process (one initialized ``LLMDataDist`` per process,
as in ``llm_datadist``).  The parent, a :class:`Launcher`, is the hub: each child talks to
it over one ``Pipe`` to send messages, to return a result, or to meet the other children
at a named barrier where they also swap small values (a listen port, a cache id), the way
the official samples use ``torch.distributed`` barriers.  Every wait has a deadline.  A
child that raises sends its traceback before it exits; a child that dies, or a wait that
passes its deadline, fails the run with :class:`ChildFailed`, and the other children are
killed.

Also here: the engine set-up every sample repeats (``init``, ``link_clusters``, allocating a
cache filled with seeded data or zeroed), the layer synchronizer of a compute loop that
``transfer_cache_async`` samples feed, a private ``ems`` pool daemon for samples that use
one, and the byte-for-byte checks the call samples verify transfers with.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from datadist import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheManager, CacheTask, LayerSynchronizer,
                      LLMClusterInfo, LLMConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode)
from ems.client.autostart import read_ready

__all__ = [
    "LOCALHOST", "WAIT_S", "SYNC_KV_TIMEOUT_MS", "PROMPT_CLUSTER_ID", "DECODER_CLUSTER_ID", "NUM_TENSORS",
    "BLOCK_TOKENS", "KV_SHAPE", "ChildFailed", "Peer", "Launcher", "run_sample", "positive_int",
    "init_llm_datadist", "engine", "listening", "linked", "link_clusters", "unlink_clusters", "blocks_cache",
    "contiguous_cache", "ComputedLayers", "finish_task", "private_pool", "source_tensors", "fill", "expect_bytes",
    "expect_tensors",
]

LOCALHOST = "127.0.0.1"
#: Deadline of one wait, in seconds; starting an engine process imports torch, which
#: takes seconds on a small, busy machine.
WAIT_S = 120.0
#: Deadline of every transfer (``sync_kv_timeout``) and link, in ms: the defaults (1000 and
#: 3000) leave no slack on a loaded machine.
SYNC_KV_TIMEOUT_MS = 10_000
LINK_TIMEOUT_MS = 10_000
_EXIT_S = 15.0

# The engines and cache layout of the call samples (push/pull blocks and cache, xpyd).
PROMPT_CLUSTER_ID = 1
DECODER_CLUSTER_ID = 2
NUM_TENSORS = 2 * 4  # K and V of each of 4 layers: K0, V0, K1, V1, ...
BLOCK_TOKENS = 16
KV_SHAPE = [2, 32]  # KV heads, head dim

_CTX = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools half-initialized


class ChildFailed(RuntimeError):
    """A child process raised (the message carries its traceback), died, or missed a deadline."""


# ------------------------------------------------------------------------ child side


class Peer:
    """A child's end of its pipe to the launcher."""

    def __init__(self, name: str, conn: multiprocessing.connection.Connection, wait_s: float) -> None:
        self.name = name
        self._conn = conn
        self._wait_s = wait_s

    def send(self, payload: Any) -> None:
        """Send a message to the launcher (:meth:`Launcher.recv` reads it)."""
        self._conn.send(("msg", payload))

    def recv(self, timeout: Optional[float] = None) -> Any:
        """The launcher's next message (:meth:`Launcher.send`)."""
        kind, payload = self._next(timeout)
        if kind != "msg":
            raise RuntimeError(f"{self.name}: expected a message from the launcher, got {kind!r}")
        return payload

    def barrier(self, step: str, value: Any = None, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Wait until every process of the sample reached ``step``.

        Returns the ``value`` each process passed, by process name.
        """
        self._conn.send(("barrier", (step, value)))
        kind, payload = self._next(timeout)
        if kind != "go" or payload[0] != step:
            raise RuntimeError(f"{self.name}: waiting at barrier {step!r}, got {kind!r} {payload!r}")
        return payload[1]

    def _next(self, timeout: Optional[float]) -> Tuple[str, Any]:
        limit = self._wait_s if timeout is None else timeout
        if not self._conn.poll(limit):
            raise TimeoutError(f"{self.name}: nothing from the launcher within {limit:.0f} s")
        return self._conn.recv()


def _child_main(conn: multiprocessing.connection.Connection, name: str, target: Callable[..., Any],
                args: Tuple[Any, ...], wait_s: float) -> None:
    """Process target: run ``target(peer, *args)``, then report its result or its traceback."""
    try:
        result = target(Peer(name, conn, wait_s), *args)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass  # the launcher is gone: nobody is left to tell, the exit code says it
        raise SystemExit(1)
    conn.send(("done", result))


# ------------------------------------------------------------------------ parent side


class _Child:
    """The launcher's record of one child: its process, pipe, unread messages and result."""

    def __init__(self, name: str, process: Any, conn: multiprocessing.connection.Connection) -> None:
        self.name = name
        self.process = process
        self.conn = conn
        self.inbox: Deque[Any] = collections.deque()
        self.done = False
        self.closed = False
        self.result: Any = None


class Launcher:
    """Starts named child processes and serves them: messages, barriers, results, deadlines.

    Use it as a context manager: leaving the block normally waits for every child to exit
    and checks that each exited with code 0; leaving it on an exception kills them all.
    """

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self._wait_s = wait_s
        self._children: Dict[str, _Child] = {}
        self._barriers: Dict[str, Dict[str, Any]] = {}

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(clean=exc_type is None)

    def start(self, name: str, target: Callable[..., Any], *args: Any) -> None:
        """Spawn ``target(peer, *args)`` as the child ``name`` (``target`` must be importable)."""
        parent_conn, child_conn = _CTX.Pipe()
        process = _CTX.Process(target=_child_main, args=(child_conn, name, target, args, self._wait_s),
                               name=name, daemon=True)
        process.start()
        child_conn.close()
        self._children[name] = _Child(name, process, parent_conn)

    def send(self, name: str, payload: Any) -> None:
        """Send a message to child ``name`` (its :meth:`Peer.recv` reads it)."""
        self._children[name].conn.send(("msg", payload))

    def recv(self, name: str, timeout: Optional[float] = None) -> Any:
        """The next message child ``name`` sent with :meth:`Peer.send`."""
        child = self._children[name]
        self._serve_until(lambda: bool(child.inbox) or child.done, f"a message from {name}", timeout)
        if not child.inbox:
            raise ChildFailed(f"{name} returned while a message from it was awaited")
        return child.inbox.popleft()

    def result(self, name: str, timeout: Optional[float] = None) -> Any:
        """Wait until child ``name`` returns; what it returned."""
        child = self._children[name]
        self._serve_until(lambda: child.done, f"{name} to finish", timeout)
        return child.result

    def serve(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Serve barriers until every child returned; what each returned, by name."""
        children = list(self._children.values())
        self._serve_until(lambda: all(c.done for c in children), "every process to finish", timeout)
        return {c.name: c.result for c in children}

    def close(self, clean: bool = True) -> None:
        """Reap every child.  ``clean``: give each time to exit and require exit code 0;
        otherwise (or when one does not exit in time) kill them."""
        for child in self._children.values():
            if clean:
                child.process.join(_EXIT_S)
            if child.process.is_alive():
                child.process.kill()
                child.process.join(_EXIT_S)
            child.conn.close()
        if clean:
            bad = [f"{c.name} (exit code {c.process.exitcode})" for c in self._children.values()
                   if c.process.exitcode != 0]
            if bad:
                raise ChildFailed(f"not a clean exit: {', '.join(bad)}")

    # -- the serving loop

    def _serve_until(self, condition: Callable[[], bool], what: str, timeout: Optional[float]) -> None:
        limit = self._wait_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not condition():
            waitables: List[Any] = []
            for child in self._children.values():
                if not child.closed:
                    waitables.append(child.conn)
                if not child.done:
                    waitables.append(child.process.sentinel)
            left = deadline - time.monotonic()
            if left <= 0 or not waitables:
                raise ChildFailed(f"no progress within {limit:.0f} s while waiting for {what}")
            ready = set(multiprocessing.connection.wait(waitables, left))
            for child in self._children.values():
                if child.conn in ready or child.process.sentinel in ready:
                    self._pump(child)
                if child.process.sentinel in ready and not child.done:
                    child.process.join(_EXIT_S)  # the sentinel fires before the exit code can be read
                    raise ChildFailed(f"{child.name} died (exit code {child.process.exitcode}) "
                                      f"while the launcher waited for {what}")
            self._release_barriers()

    def _pump(self, child: _Child) -> None:
        """Take in everything ``child`` sent; raise with its traceback if it reported one."""
        while not child.closed and child.conn.poll():
            try:
                kind, payload = child.conn.recv()
            except (EOFError, OSError):
                child.closed = True
                break
            if kind == "error":
                raise ChildFailed(f"{child.name} failed:\n{payload}")
            if kind == "done":
                child.done, child.result = True, payload
            elif kind == "barrier":
                step, value = payload
                self._barriers.setdefault(step, {})[child.name] = value
            else:
                child.inbox.append(payload)

    def _release_barriers(self) -> None:
        for step, arrived in list(self._barriers.items()):
            if len(arrived) == len(self._children):
                del self._barriers[step]
                for name in arrived:
                    self._children[name].conn.send(("go", (step, arrived)))
                continue
            gone = [c.name for c in self._children.values() if c.done and c.name not in arrived]
            if gone:
                raise ChildFailed(f"{', '.join(gone)} returned without reaching barrier {step!r}")


def positive_int(text: str) -> int:
    """``argparse`` type of a count flag: an int of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run_sample(title: str, description: str, processes: Dict[str, Callable[..., Any]],
               argv: Optional[Sequence[str]] = None) -> int:
    """Command line of a call sample: run each ``processes[name](peer, transport)`` in its own
    process and print ``<title>: bytes match`` when all return; on a failure print what
    failed (a child's traceback included) and return 1."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("auto", "shm", "tcp"), default="auto",
                        help="transfer_backend of every engine (default: auto, shm on one host)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        with Launcher() as launcher:
            for name, target in processes.items():
                launcher.start(name, target, args.transport)
            launcher.serve()
    except ChildFailed as exc:
        print(f"{title}: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"{title}: bytes match ({len(processes)} processes, {args.transport}, "
          f"{time.perf_counter() - start:.1f} s)")
    return 0


# ------------------------------------------------------------------------ engines


def init_llm_datadist(role: LLMRole, cluster_id: int, transport: str = "auto", *, listen: bool = False,
                      pool_bytes: int = 64 << 20) -> LLMDataDist:
    """An initialized engine with a ``pool_bytes`` pool for ``Placement.DEVICE`` caches.

    ``listen``: make it a link server on a loopback port the system picks (port 0), which
    ``LLMDataDist.listen_port`` then tells; no port can be taken by someone else meanwhile.
    """
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = SYNC_KV_TIMEOUT_MS
    config.mem_pool_cfg = json.dumps({"memory_size": pool_bytes, "page_shift": 16})
    # The sample models compute on the CPU, so their caches live there too, GPU or not.
    config.device_type = "cpu"
    config.transfer_backend = transport
    if listen:
        config.listen_ip_info = f"{LOCALHOST}:0"
    datadist = LLMDataDist(role, cluster_id)
    datadist.init(config.generate_options())
    return datadist


@contextlib.contextmanager
def engine(role: LLMRole, cluster_id: int, transport: str = "auto", *, listen: bool = False,
           pool_bytes: int = 64 << 20) -> Iterator[LLMDataDist]:
    """:func:`init_llm_datadist`, finalized when the block exits, whichever way."""
    datadist = init_llm_datadist(role, cluster_id, transport, listen=listen, pool_bytes=pool_bytes)
    try:
        yield datadist
    finally:
        datadist.finalize()


def listening(peer: Peer, datadist: LLMDataDist, info: Any = None) -> None:
    """A link server's side of barrier ``"listening"``: tell its port, and ``info`` (a cache
    id, digests) to the processes that :func:`linked` to it."""
    peer.barrier("listening", (datadist.listen_port, info))


@contextlib.contextmanager
def linked(peer: Peer, datadist: LLMDataDist, servers: Dict[int, str], done: str) -> Iterator[Dict[str, Any]]:
    """Link to the servers (cluster id -> process name) once they are :func:`listening`;
    yields the ``info`` each server told, by process name.  When the block exits normally,
    unlink and meet the others at barrier ``done``: the servers keep their caches until then."""
    told = peer.barrier("listening")
    link_clusters(datadist, {cluster_id: told[name][0] for cluster_id, name in servers.items()})
    yield {name: told[name][1] for name in servers.values()}
    unlink_clusters(datadist, servers)
    peer.barrier(done)


def link_clusters(datadist: LLMDataDist, servers: Dict[int, int]) -> None:
    """Link to every server on this host (cluster id -> listen port); raise unless all link."""
    clusters = []
    for cluster_id, port in servers.items():
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = cluster_id
        cluster.append_local_ip_info(LOCALHOST, 0)
        cluster.append_remote_ip_info(LOCALHOST, port)
        clusters.append(cluster)
    ret, rets = datadist.link_clusters(clusters, timeout=LINK_TIMEOUT_MS)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link_clusters to {list(servers)} failed: {ret!r}, per cluster {rets!r}")


def unlink_clusters(datadist: LLMDataDist, cluster_ids: Iterable[int]) -> None:
    """Unlink from every cluster in ``cluster_ids`` (both ends); raise unless all unlink."""
    clusters = [LLMClusterInfo(remote_cluster_id=cid) for cid in cluster_ids]
    ret, rets = datadist.unlink_clusters(clusters, timeout=LINK_TIMEOUT_MS)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink_clusters failed: {ret!r}, per cluster {rets!r}")


@contextlib.contextmanager
def blocks_cache(cache_manager: CacheManager, desc: CacheDesc, key: Optional[BlocksCacheKey] = None, *,
                 seed: Optional[int] = None) -> Iterator[Tuple[Cache, List[torch.Tensor]]]:
    """``allocate_blocks_cache(desc, key)`` and its tensors, filled as :func:`_filled` says;
    deallocated when the block exits normally."""
    cache = cache_manager.allocate_blocks_cache(desc, key)
    yield cache, _filled(cache_manager.get_cache_tensors(cache), seed)
    cache_manager.deallocate_blocks_cache(cache)


@contextlib.contextmanager
def contiguous_cache(cache_manager: CacheManager, desc: CacheDesc, keys: Sequence[CacheKey] = (), *,
                     seed: Optional[int] = None) -> Iterator[Tuple[Cache, List[torch.Tensor]]]:
    """``allocate_cache(desc, keys)`` and its tensors, filled as :func:`_filled` says;
    deallocated when the block exits normally."""
    cache = cache_manager.allocate_cache(desc, keys)
    yield cache, _filled(cache_manager.get_cache_tensors(cache), seed)
    cache_manager.deallocate_cache(cache)


def _filled(tensors: List[torch.Tensor], seed: Optional[int]) -> List[torch.Tensor]:
    """A sender's tensors get :func:`source_tensors` of ``seed``; without a seed, zeros, so a
    receiver's blocks that nothing was sent to are known (pool memory is not cleared when it
    is reused)."""
    if seed is None:
        for tensor in tensors:
            tensor.zero_()
    else:
        fill(tensors, seed)
    return tensors


class ComputedLayers(LayerSynchronizer):
    """Fed by a compute loop: layer i is ready once :meth:`computed` was called for it.
    (On CPU a layer's tensors are final when the loop moves on; on an accelerator the loop
    would record an event on its stream here and ``synchronize_layer`` would wait on it.)"""

    def __init__(self, num_layers: int, all_computed: bool = False) -> None:
        self._computed = [all_computed] * num_layers
        self._answered = [threading.Event() for _ in range(num_layers)]
        if all_computed:
            for event in self._answered:
                event.set()

    def computed(self, layer: int) -> None:
        self._computed[layer] = True
        self._answered[layer].set()

    def abandon(self) -> None:
        """Answer False for every layer not computed yet (the compute loop failed): the
        task then fails those layers at once instead of waiting for them (it gives
        ``synchronize_layer`` no timeout, as CANN does)."""
        for event in self._answered:
            event.set()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        if not self._answered[layer_index].wait(timeout):
            # Only with a timeout (the task passes None). Not False, which would say the layer
            # never will be: the task reports LLM_TIMEOUT.
            raise TimeoutError(f"layer {layer_index} was not computed within {timeout_in_millis} ms")
        return self._computed[layer_index]


def finish_task(task: CacheTask, timeout_ms: int) -> None:
    """Wait for a ``transfer_cache_async`` task; raise unless every config succeeded."""
    status = task.synchronize(timeout_ms)
    if status != LLMStatusCode.LLM_SUCCESS:
        raise LLMException(f"transfer_cache_async ended with {status!r}: {task.get_results(0)}", status_code=status)


# ------------------------------------------------------------------------ ems pool


@contextlib.contextmanager
def private_pool(capacity: int, wait_s: float = WAIT_S) -> Iterator[str]:
    """An ``ems-server`` of this run's own, serving a fresh temporary directory.

    Yields its address (the directory) for ``EmsConfig(server=...)``.  On exit the daemon
    is stopped (SIGTERM) and the directory removed, so nothing of the pool outlives the
    run, and the node's shared pool (``/dev/shm/ems``, which the ``auto`` address would use
    or start) is never touched.  Raises :class:`ChildFailed`, with the daemon's log, when
    it does not start or does not exit cleanly.
    """
    with tempfile.TemporaryDirectory(prefix="ems-pool-") as directory:
        log = os.path.join(directory, "ems-server.log")
        ready_r, ready_w = os.pipe()
        try:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "ems.server", "serve", "--dir", directory, "--capacity", str(capacity),
                 "--log-level", "WARNING", "--log-file", log, "--ready-fd", str(ready_w)],
                pass_fds=(ready_w,), stdin=subprocess.DEVNULL)
        finally:
            os.close(ready_w)
        try:
            line = read_ready(ready_r, time.monotonic() + wait_s)
        finally:
            os.close(ready_r)
        try:
            if line is None or not line.startswith("READY"):
                raise ChildFailed(f"ems-server did not start within {wait_s:.0f} s: {line or 'no answer'}"
                                  f"{_log_tail(log)}")
            yield directory
        finally:
            daemon.terminate()
            try:
                code = daemon.wait(_EXIT_S)
            except subprocess.TimeoutExpired:
                daemon.kill()
                code = daemon.wait(_EXIT_S)
        if code != 0:
            raise ChildFailed(f"ems-server exited with code {code}{_log_tail(log)}")


def _log_tail(path: str, lines: int = 20) -> str:
    """The last lines of a log file, as a block to append to an error message."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            tail = f.readlines()[-lines:]
    except OSError:
        return ""
    return "\n" + "".join(tail) if tail else ""


# ------------------------------------------------------------------------ data and checks


def source_tensors(num_tensors: int, shape: Sequence[int], dtype: torch.dtype, seed: int) -> List[torch.Tensor]:
    """Seeded random tensors: the sender fills its cache with them and the receiver computes
    the same ones to know what must arrive."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tuple(shape), generator=gen).to(dtype) for _ in range(num_tensors)]


def fill(tensors: Sequence[torch.Tensor], seed: int) -> None:
    """Overwrite cache tensors with :func:`source_tensors` of ``seed``."""
    for tensor, src in zip(tensors, source_tensors(len(tensors), tensors[0].shape, tensors[0].dtype, seed)):
        tensor.copy_(src)


def expect_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise ``AssertionError`` unless both tensors hold the same bytes."""
    got = actual.contiguous().reshape(-1).view(torch.uint8)
    want = expected.contiguous().reshape(-1).view(torch.uint8)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: {got.numel()} bytes, expected {want.numel()}")
    differ = (got != want).nonzero()
    if differ.numel():
        raise AssertionError(f"{what}: {differ.numel()} of {got.numel()} bytes differ, "
                             f"the first at byte {int(differ[0])}")


def expect_tensors(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], what: str = "decoder") -> None:
    """:func:`expect_bytes` of each cache tensor, named ``<what> tensor <index>``."""
    for index, (got, want) in enumerate(zip(actual, expected)):
        expect_bytes(got, want, f"{what} tensor {index}")
