"""``python -m datadist.bench``: the standard workloads through the public API.

Two real processes: this one is a PROMPT engine that pushes, a spawned DECODER engine owns
the destination cache and links to it (transports shm, tcp, gloo).  ``--transport local`` moves the same plan between
two caches of this process (``swap_blocks``).  After the timed rounds the destination is
checked block by block against the source (a digest per side), and a raw copy of the same
bytes (the yardstick, not a ceiling) is measured in the same run, on the same bytes, the way ``peer_bench.py`` measures it.

Workloads (see PERF.md):
  inorder-256k  1024 blocks x 256 KiB, block i -> block i, one tensor
  scatter-32k   2048 blocks x 32 KiB, destination order a random permutation
  small-4k      one 4 KiB block per call, repeated (latency)
  kv-7b         a 7B model's cache: 32 layers x K,V (64 tensors) of 16-token blocks (128 KiB per
                tensor block), caches of 128 blocks; 8 requests at once (a thread each, started
                behind a barrier), each pushing its own 16 blocks to scattered destinations one
                layer per push_blocks (2 tensors x 16 blocks = 4 MiB a call), in layer order.
                batch_ms / gbps: the whole batch (8 x 32 calls); p50_us / p99_us: one layer
                call, over all calls of all rounds.  --requests and --layers shrink it.
  plan          validation + plan building for 4096 blocks x 64 tensors (all 32 layers, in
                order and scattered), in one process; p50/p99 per plan; "cached": the same
                call repeated, finding its plan (keys of both lists, one lookup)
  --sweep       32 MiB in order at block sizes 4 KiB .. 1 MiB

``--plot OUT`` draws whatever ran into ``OUT.png`` and ``OUT.svg`` (matplotlib, extra
``[plot]``): GB/s against block size for a sweep, GB/s per workload otherwise.

``--device cuda`` puts both caches on the GPU (``Placement.DEVICE``, ``device_type`` cuda;
shm then moves them by CUDA IPC, tcp and gloo through host staging, ``nccl`` becomes
available), and the raw copy is a torch copy of the same blocks on that GPU.  ``--device
npu`` does the same on NPU 0 (torch_npu): ``hccl`` becomes available.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import threading
from dataclasses import dataclass, replace
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .. import __version__
from .plan import print_plan_rows
from .record import record
from ..engine.executor import EXECUTORS, executor, set_executor

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .._cache_manager import CacheManager
    from .._objects import Cache, CacheDesc

__all__ = ["main", "WORKLOADS", "run", "sized"]

#: One result row (:func:`datadist.bench.record.record`).
Row = Dict[str, Any]


@dataclass(frozen=True)
class Workload:
    name: str
    block_bytes: int
    blocks: int            # blocks per call: per batch, or per request and layer (layerwise)
    cache_blocks: int      # blocks in each cache
    num_tensors: int
    scatter: bool
    layerwise: bool = False
    rounds: int = 5
    requests: int = 1      # layerwise: requests pushing at once, a thread each

    @property
    def layers(self) -> int:
        return self.num_tensors // 2 if self.layerwise else 1

    @property
    def batch_blocks(self) -> int:
        """Blocks of each tensor a batch moves (all requests together)."""
        return self.blocks * self.requests

    @property
    def batch_bytes(self) -> int:
        return self.block_bytes * self.batch_blocks * self.num_tensors


WORKLOADS = {
    "inorder-256k": Workload("inorder-256k", 256 << 10, 1024, 1024, 1, False),
    "scatter-32k": Workload("scatter-32k", 32 << 10, 2048, 2048, 1, True),
    "small-4k": Workload("small-4k", 4 << 10, 1, 16, 1, False, rounds=2000),
    "kv-7b": Workload("kv-7b", 128 << 10, 16, 128, 64, True, layerwise=True, rounds=5, requests=8),
}
#: ``--sweep``: 32 MiB in order at each block size, for GB/s against block size (``--plot``).
SWEEP_KIB = (4, 16, 64, 256, 1024)
WORKLOADS.update({f"sweep-{k}k": Workload(f"sweep-{k}k", k << 10, (32 << 10) // k, (32 << 10) // k, 1, False,
                                          rounds=5) for k in SWEEP_KIB})
TRANSPORTS = ("local", "shm", "tcp", "gloo", "nccl", "hccl")
DEVICES = ("cpu", "cuda", "npu")
#: Transports that move device memory of one kind only.
_DEVICE_ONLY = {"nccl": "cuda", "hccl": "npu"}


def sized(workload: str, rounds: Optional[int] = None, requests: Optional[int] = None,
          layers: Optional[int] = None) -> Workload:
    """The workload ``workload`` with fewer (or more) rounds, requests or layers.

    Raises ``ValueError`` for requests or layers of a workload that is not layer-wise, or
    for more blocks than a cache holds."""
    w = WORKLOADS[workload]
    if (requests is not None or layers is not None) and not w.layerwise:
        raise ValueError(f"requests and layers apply to layer-wise workloads, not to {workload}")
    w = replace(w, rounds=w.rounds if rounds is None else rounds,
                requests=w.requests if requests is None else requests,
                num_tensors=w.num_tensors if layers is None else 2 * layers)
    if min(w.rounds, w.requests, w.num_tensors) < 1:
        raise ValueError(f"{workload}: rounds, requests and layers must be at least 1")
    if w.batch_blocks > w.cache_blocks:
        raise ValueError(f"{workload}: {w.requests} requests x {w.blocks} blocks do not fit caches of "
                         f"{w.cache_blocks} blocks")
    return w


def _blocks(w: Workload) -> Tuple[List[int], List[int]]:
    """Source and destination blocks of a batch; request r owns the r-th ``w.blocks`` of each."""
    src = list(range(w.batch_blocks))
    if w.scatter:
        dst = [int(b) for b in np.random.default_rng(7).permutation(w.cache_blocks)[: w.batch_blocks]]
    else:
        dst = list(range(w.batch_blocks))
    return src, dst


def _digest(tensors: Iterable["torch.Tensor"], blocks: Sequence[int]) -> str:
    """Digest of the listed blocks of every tensor, in list order."""
    h = hashlib.blake2b(digest_size=16)
    idx = np.asarray(blocks)
    for t in tensors:
        h.update(t.view(-1, t.shape[-1]).cpu().numpy()[idx].tobytes())
    return h.hexdigest()


def _config(transport: str, pool_bytes: int, listen: Optional[str] = None, device: str = "cpu") -> Dict[str, str]:
    from datadist import LLMConfig

    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 60000
    pool = json.dumps({"memory_size": pool_bytes, "page_shift": 16})
    if device != "cpu":
        cfg.mem_pool_cfg = pool
        cfg.device_type = device
    else:
        cfg.host_mem_pool_cfg = pool
        cfg.device_type = "cpu"
    cfg.transfer_backend = "shm" if transport == "local" else transport
    if listen:
        cfg.listen_ip_info = listen
    return cfg.generate_options()


def _desc(w: Workload, device: str = "cpu") -> "CacheDesc":
    from datadist import CacheDesc, DataType, Placement

    return CacheDesc(w.num_tensors, [w.cache_blocks, w.block_bytes // 2], DataType.DT_FLOAT16,
                     Placement.DEVICE if device != "cpu" else Placement.HOST)


def _pool_bytes(w: Workload) -> int:
    return w.block_bytes * w.cache_blocks * w.num_tensors + (1 << 20)


def _decoder(conn: Connection, w: Workload, transport: str, port: int, device: str,
             prompt_ip: str = "127.0.0.1", netns: Optional[str] = None) -> None:
    """Child: own the destination cache, link to the prompt at ``prompt_ip`` (from network
    namespace ``netns`` when given: another host), report digests on request."""
    if netns is not None:
        from .netns import enter

        enter(netns)
    from datadist import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMRole

    engine = LLMDataDist(LLMRole.DECODER, 2)
    try:
        engine.init(_config(transport, _pool_bytes(w), device=device))
        cache = engine.cache_manager.allocate_blocks_cache(_desc(w, device), BlocksCacheKey(2, 0))
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_remote_ip_info(prompt_ip, port)
        ret, _ = engine.link_clusters([info], timeout=10000)
        conn.send(("linked", int(ret)))
        if conn.poll(600) and conn.recv() == "digest":
            _, dst = _blocks(w)
            conn.send(("digest", _digest(engine.cache_manager.get_cache_tensors(cache), dst)))
        conn.recv()
    except BaseException as exc:  # reported to the parent, which fails the run
        conn.send(("error", repr(exc)))
    finally:
        engine.finalize()


def _memcpy(w: Workload, src_blocks: List[int], dst_blocks: List[int], device: str = "cpu") -> float:
    """Seconds per batch of a numpy copy of the same blocks in one process (median); on
    device, of a torch copy of them on that device."""
    if device != "cpu":
        return _torch_copy(w, src_blocks, dst_blocks, device)
    src = np.ones((w.num_tensors * w.cache_blocks, w.block_bytes), np.uint8)
    dst = np.zeros_like(src)
    n = len(src_blocks)
    times = []
    for _ in range(min(w.rounds, 20) + 1):
        t = time.perf_counter()
        for k in range(w.num_tensors):
            off = k * w.cache_blocks
            if w.scatter:
                for i, j in zip(src_blocks, dst_blocks):
                    dst[off + j] = src[off + i]
            else:
                np.copyto(dst[off: off + n], src[off: off + n])
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _torch_copy(w: Workload, src_blocks: List[int], dst_blocks: List[int], device: str) -> float:
    import torch

    src = torch.ones((w.num_tensors * w.cache_blocks, w.block_bytes), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    si = torch.tensor(src_blocks, device=device)
    di = torch.tensor(dst_blocks, device=device)
    backend = getattr(torch, device)  # torch.cuda, or torch.npu (torch_npu's)
    times = []
    for _ in range(min(w.rounds, 20) + 1):
        backend.synchronize()
        t = time.perf_counter()
        for k in range(w.num_tensors):
            off = k * w.cache_blocks
            if w.scatter:
                dst[off: off + w.cache_blocks].index_copy_(0, di, src[off: off + w.cache_blocks].index_select(0, si))
            else:
                dst[off: off + len(src_blocks)].copy_(src[off: off + len(src_blocks)])
        backend.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


class _Decoder:
    """The spawned DECODER process of a run (:func:`_decoder`) and the pipe to it."""

    def __init__(self, w: Workload, transport: str, port: Optional[int], device: str,
                 hosts: Optional[Tuple[str, str]] = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_decoder, args=(child_conn, w, transport, port, device, *(hosts or ())))

    def link(self) -> None:
        """Start the process and wait until it has linked to this one."""
        self.process.start()
        if not self.conn.poll(60):
            raise RuntimeError("decoder process did not link within 60 s")
        msg = self.conn.recv()
        if msg[0] != "linked" or msg[1] != 0:
            raise RuntimeError(f"decoder failed to link: {msg}")

    def ask_digest(self) -> None:
        """Let the process hash its destination blocks (while this one hashes the source)."""
        self.conn.send("digest")

    def digest(self) -> str:
        """The digest :meth:`ask_digest` asked for, then let the process end."""
        if not self.conn.poll(120):
            raise RuntimeError("decoder did not report its digest")
        reply = self.conn.recv()
        if reply[0] != "digest":
            raise RuntimeError(f"decoder failed: {reply}")
        self.conn.send("bye")
        return str(reply[1])

    def join(self) -> None:
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def _filled_source(cm: "CacheManager", w: Workload, device: str) -> "Cache":
    """The source blocks cache (``BlocksCacheKey(1, 0)``), filled with seeded random data:
    one random tensor, xor-ed with each tensor's index (every block differs from every other,
    at a fraction of the cost of drawing each tensor)."""
    import torch
    from datadist import BlocksCacheKey

    src = cm.allocate_blocks_cache(_desc(w, device), BlocksCacheKey(1, 0))
    tensors = cm.get_cache_tensors(src)
    base = torch.randint(-2**15, 2**15, tuple(tensors[0].shape), dtype=torch.int16,
                         generator=torch.Generator().manual_seed(1))
    for k, tensor in enumerate(tensors):
        tensor.view(torch.int16).copy_(base ^ k)
    return src


def _push_batch(cm: "CacheManager", src: "Cache", src_blocks: List[int],
                dst_blocks: List[int]) -> Callable[[], None]:
    """One batch to the decoder's cache: one push_blocks of every block of every tensor."""
    from datadist import BlocksCacheKey

    key = BlocksCacheKey(2, 0)

    def one_batch() -> None:
        cm.push_blocks(key, src, src_blocks, dst_blocks, tensor_num_per_layer=1)

    return one_batch


def _push_layer(cm: "CacheManager", src: "Cache", src_blocks: List[int], dst_blocks: List[int],
                layer: range) -> None:
    from datadist import BlocksCacheKey

    cm.push_blocks(BlocksCacheKey(2, 0), src, src_blocks, dst_blocks, src_layer_range=layer, dst_layer_range=layer)


#: What one request's thread reports: its start (after the barrier), its end, each call's seconds.
_RequestTimes = Tuple[float, float, List[float]]


def _one_request(push: Callable[[range], None], layers: int, barrier: threading.Barrier,
                 out: List[_RequestTimes], errors: List[BaseException]) -> None:
    """A request's thread: wait for the others, then push its layers in order, one call each."""
    try:
        barrier.wait()
        start = time.perf_counter()
        calls = []
        for layer in range(layers):
            t = time.perf_counter()
            push(range(layer, layer + 1))
            calls.append(time.perf_counter() - t)
        out.append((start, time.perf_counter(), calls))
    except BaseException as exc:  # raised again by the thread that started this one
        errors.append(exc)
        barrier.abort()


def _layerwise_round(pushes: List[Callable[[range], None]], layers: int) -> Tuple[float, List[float]]:
    """One batch: every request's thread started behind one barrier; returns the wall time
    from the first request's start to the last one's end, and the seconds of every call."""
    barrier = threading.Barrier(len(pushes), timeout=60)
    out: List[_RequestTimes] = []
    errors: List[BaseException] = []
    threads = [threading.Thread(target=_one_request, args=(push, layers, barrier, out, errors), daemon=True)
               for push in pushes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:  # the first real failure, not the broken barrier it left to the others
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    wall = max(end for _, end, _ in out) - min(start for start, _, _ in out)
    return wall, [c for _, _, calls in out for c in calls]


def _layerwise_timed(cm: "CacheManager", src: "Cache", w: Workload, src_blocks: List[int],
                     dst_blocks: List[int]) -> Tuple[List[float], List[float]]:
    """Seconds of each of ``w.rounds`` batches and of each layer call in them, after one
    warm-up batch (lookups, plans, page faults)."""
    n = w.blocks
    pushes: List[Callable[[range], None]] = [
        partial(_push_layer, cm, src, src_blocks[r * n: (r + 1) * n], dst_blocks[r * n: (r + 1) * n])
        for r in range(w.requests)]
    _layerwise_round(pushes, w.layers)
    batches: List[float] = []
    calls: List[float] = []
    for _ in range(w.rounds):
        wall, call_times = _layerwise_round(pushes, w.layers)
        batches.append(wall)
        calls.extend(call_times)
    return batches, calls


def _timed(one_batch: Callable[[], None], rounds: int) -> List[float]:
    """Seconds of each of ``rounds`` batches, after one warm-up batch (lookups, page faults)."""
    one_batch()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        one_batch()
        times.append(time.perf_counter() - t)
    return times


def _result(w: Workload, transport: str, device: str, batches: List[float], calls: List[float],
            src_blocks: List[int], dst_blocks: List[int]) -> Row:
    """The row of a verified run: its timings (of each batch, of each call) next to a raw
    copy of the same blocks; a layer-wise workload adds its shape."""
    med = statistics.median(batches)
    memcpy_s = _memcpy(w, src_blocks, dst_blocks, device)
    us = sorted(t * 1e6 for t in calls)
    extra: Row = {}
    if w.layerwise:
        per_batch = len(calls) // len(batches)
        extra = {"requests": w.requests, "layers": w.layers, "calls": per_batch, "rounds": len(batches),
                 "call_mib": w.batch_bytes / per_batch / (1 << 20)}
    return record(system=f"datadist-{transport}" + (f"-{device}" if device != "cpu" else ""), workload=w.name,
                  gbps=w.batch_bytes / med / 1e9, batch_ms=med * 1e3, p50_us=us[len(us) // 2],
                  p99_us=us[min(len(us) - 1, int(len(us) * 0.99))], block_kib=w.block_bytes >> 10, blocks=w.blocks,
                  scatter=w.scatter, raw_copy_gbps=w.batch_bytes / memcpy_s / 1e9, verified=True,
                  executor=executor(), device=device, transport=transport, **extra)


def run(workload: str, transport: str, device: str = "cpu", *, rounds: Optional[int] = None,
        requests: Optional[int] = None, layers: Optional[int] = None,
        hosts: Optional[Tuple[str, str]] = None) -> Row:
    """Run one workload over one transport; returns the result row (raises on bad data).

    ``rounds``, ``requests`` and ``layers`` resize it (:func:`sized`).  Over ``local`` a
    batch is one ``swap_blocks`` of all its blocks (it takes no layer range).  ``hosts``
    (this process's address, the decoder's network namespace) puts the decoder on another
    host: this process listens on that address (see :mod:`.hosts`)."""
    from datadist import LLMDataDist, LLMRole

    w = sized(workload, rounds, requests, layers)
    src_blocks, dst_blocks = _blocks(w)
    local = transport == "local"
    engine = LLMDataDist(LLMRole.PROMPT if not local else LLMRole.MIX, 1)
    decoder: Optional[_Decoder] = None
    try:
        engine.init(_config(transport, _pool_bytes(w) * (2 if local else 1),
                            listen=None if local else f"{hosts[0] if hosts else '127.0.0.1'}:0", device=device))
        cm = engine.cache_manager
        src = _filled_source(cm, w, device)
        if local:
            dst = cm.allocate_blocks_cache(_desc(w, device))
            batches = calls = _timed(partial(cm.swap_blocks, src, dst, dict(zip(src_blocks, dst_blocks))), w.rounds)
        else:
            decoder = _Decoder(w, transport, engine.listen_port, device, hosts)
            decoder.link()
            if w.layerwise:
                batches, calls = _layerwise_timed(cm, src, w, src_blocks, dst_blocks)
            else:
                batches = calls = _timed(_push_batch(cm, src, src_blocks, dst_blocks), w.rounds)
        if decoder is not None:
            decoder.ask_digest()
        expected = _digest(cm.get_cache_tensors(src), src_blocks)
        got = _digest(cm.get_cache_tensors(dst), dst_blocks) if decoder is None else decoder.digest()
        if got != expected:
            raise RuntimeError(f"data check failed for {workload} over {transport}: digest {got} != {expected}")
    finally:
        engine.finalize()
        if decoder is not None:
            decoder.join()
    return _result(w, transport, device, batches, calls, src_blocks, dst_blocks)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m datadist.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS) + ["plan"],
                    help="repeat for several (default: all)")
    ap.add_argument("--transport", action="append", choices=TRANSPORTS, help="repeat for several (default: all)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    ap.add_argument("--sweep", action="store_true", help="sweep block sizes (instead of the standard workloads)")
    ap.add_argument("--plot", metavar="OUT",
                    help="draw the rows of this run into OUT.png and OUT.svg (needs matplotlib: extra [plot])")
    ap.add_argument("--device", choices=DEVICES, default="cpu",
                    help="where both caches live (cuda: GPU memory; the raw copy is a torch copy on the GPU)")
    ap.add_argument("--executor", choices=EXECUTORS, default=None,
                    help="copy executor of both processes (default: DATADIST_EXECUTOR, else host)")
    ap.add_argument("--rounds", type=_positive, metavar="N", help="timed batches (default: the workload's own)")
    ap.add_argument("--requests", type=_positive, metavar="N",
                    help="kv-7b: requests pushing at once (default 8; at most 8 fit its caches)")
    ap.add_argument("--layers", type=_positive, metavar="N", help="kv-7b: layers of the model (default 32)")
    ap.add_argument("--hosts", action="append", metavar="RATE",
                    help="run over tcp between two hosts (network namespaces, root) whose links run at RATE "
                         "(1gbit, 10gbit), next to one raw TCP stream; repeat for several rates")
    return ap


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return int(text)


def _apply(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set the executor the arguments name and refuse combinations this machine cannot run."""
    if args.executor:
        os.environ["DATADIST_EXECUTOR"] = args.executor  # the spawned decoder reads it at import
        set_executor(args.executor)
    if args.device == "cuda":
        from ..engine import cuda

        if not cuda.available():
            ap.error("--device cuda: torch sees no CUDA device here")
    if args.device == "npu":
        from ..engine.core import npu_probe

        sees, problem = npu_probe()
        if not sees:
            ap.error(f"--device npu: {problem or 'torch_npu is not installed or sees no NPU'}")
    for transport, device in _DEVICE_ONLY.items():
        if transport in (args.transport or ()) and args.device != device:
            ap.error(f"--transport {transport} needs --device {device}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib: pip install 'datadist[plot]'")


def _run_workload(wl: str, transports: Sequence[str], args: argparse.Namespace) -> List[Row]:
    """Run ``wl`` over each transport, printing each row as it comes."""
    rows = []
    shape = {"requests": args.requests, "layers": args.layers} if WORKLOADS[wl].layerwise else {}
    for tr in transports:
        row = run(wl, tr, args.device, rounds=args.rounds, **shape)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        calls = "" if "calls" not in row else (
            f"   ({row['requests']} requests x {row['layers']} layers: {row['calls']} calls of "
            f"{row['call_mib']:g} MiB a batch; p50/p99 of one call)" if row["calls"] > 1 else
            f"   (one call of {row['call_mib']:g} MiB a batch)")
        print(f"{wl:14s} {tr:9s} {row['gbps']:8.2f} {row['batch_ms']:9.3f} {row['p50_us']:9.1f} "
              f"{row['p99_us']:9.1f} {row['raw_copy_gbps']:13.2f} {row['ratio']:6.2f}{calls}", flush=True)
    return rows


def _plot(rows: List[Row], out: str, sweep: bool) -> None:
    from .plot import plot_rows

    title = ("datadist: 32 MiB pushed between two processes" if sweep
             else "datadist: workloads between two processes")
    for path in plot_rows(rows, out, title):
        print(f"# plot written to {path}", file=sys.stderr)


def _selection(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Tuple[List[str], List[str]]:
    """The workloads and the transports to run (defaults: all that apply)."""
    standard = [w for w in WORKLOADS if not w.startswith("sweep-")] + ["plan"]
    sweep = [f"sweep-{k}k" for k in SWEEP_KIB]
    workloads: List[str] = sweep if args.sweep else (args.workload or standard)
    transports: List[str] = args.transport or [t for t in TRANSPORTS if _DEVICE_ONLY.get(t, args.device) == args.device]
    _check_sizes(ap, args, workloads)
    return workloads, transports


def _check_sizes(ap: argparse.ArgumentParser, args: argparse.Namespace, workloads: Sequence[str]) -> None:
    """Refuse ``--requests`` / ``--layers`` without a layer-wise workload, or too large."""
    layerwise = [w for w in workloads if w in WORKLOADS and WORKLOADS[w].layerwise]
    if (args.requests or args.layers) and not layerwise:
        ap.error("--requests and --layers apply to kv-7b, which is not among the workloads")
    for wl in layerwise:
        try:
            sized(wl, args.rounds, args.requests, args.layers)
        except ValueError as exc:
            ap.error(f"--requests {args.requests}: {exc}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    _apply(ap, args)
    workloads, transports = _selection(ap, args)
    if args.hosts:
        from .hosts import main_hosts

        return main_hosts(ap, args, [w for w in workloads if w != "plan"], run,
                          {w for w, spec in WORKLOADS.items() if spec.layerwise})
    rows: List[Row] = []
    if not args.json:
        print(f"{'workload':14s} {'transport':9s} {'GB/s':>8s} {'batch ms':>9s} {'p50 us':>9s} {'p99 us':>9s} "
              f"{'raw copy GB/s':>13s} {'x raw':>6s}", flush=True)
    for wl in workloads:
        if wl == "plan":
            print_plan_rows(args.json, args.rounds)
        else:
            rows.extend(_run_workload(wl, transports, args))
    if args.plot:
        _plot(rows, args.plot, args.sweep)
    return 0

