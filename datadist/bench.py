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
  kv-7b         32 layers x K,V of 16-token blocks (128 KiB per tensor block), 32 blocks
                pushed layer by layer (one push_blocks per layer, tensor_num_per_layer=2)
  plan          validation + plan building for 4096 blocks x 64 tensors (all 32 layers, in
                order and scattered), in one process; p50/p99 per plan
  --sweep       32 MiB in order at block sizes 4 KiB .. 1 MiB

``--plot OUT`` draws whatever ran into ``OUT.png`` and ``OUT.svg`` (matplotlib, extra
``[plot]``): GB/s against block size for a sweep, GB/s per workload otherwise.

``--device cuda`` puts both caches on the GPU (``Placement.DEVICE``, ``device_type`` cuda;
shm then moves them by CUDA IPC, tcp and gloo through host staging, ``nccl`` becomes
available), and the raw copy is a torch copy of the same blocks on that GPU.
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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from . import __version__
from .benchrecord import record
from .engine.executor import EXECUTORS, executor, set_executor

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ._cache_manager import CacheManager
    from ._objects import Cache, CacheDesc

__all__ = ["main", "WORKLOADS", "run"]

#: One result row (:func:`datadist.benchrecord.record`).
Row = Dict[str, Any]


@dataclass(frozen=True)
class Workload:
    name: str
    block_bytes: int
    blocks: int            # blocks moved per batch
    cache_blocks: int      # blocks in each cache
    num_tensors: int
    scatter: bool
    layerwise: bool = False
    rounds: int = 5

    @property
    def batch_bytes(self) -> int:
        return self.block_bytes * self.blocks * self.num_tensors


WORKLOADS = {
    "inorder-256k": Workload("inorder-256k", 256 << 10, 1024, 1024, 1, False),
    "scatter-32k": Workload("scatter-32k", 32 << 10, 2048, 2048, 1, True),
    "small-4k": Workload("small-4k", 4 << 10, 1, 16, 1, False, rounds=2000),
    "kv-7b": Workload("kv-7b", 128 << 10, 32, 64, 64, True, layerwise=True),
}
#: ``--sweep``: 32 MiB in order at each block size, for GB/s against block size (``--plot``).
SWEEP_KIB = (4, 16, 64, 256, 1024)
WORKLOADS.update({f"sweep-{k}k": Workload(f"sweep-{k}k", k << 10, (32 << 10) // k, (32 << 10) // k, 1, False,
                                          rounds=5) for k in SWEEP_KIB})
TRANSPORTS = ("local", "shm", "tcp", "gloo", "nccl")
DEVICES = ("cpu", "cuda")
PLAN_BLOCKS, PLAN_TENSORS = 4096, 64


def _blocks(w: Workload) -> Tuple[List[int], List[int]]:
    src = list(range(w.blocks))
    if w.scatter:
        dst = [int(b) for b in np.random.default_rng(7).permutation(w.cache_blocks)[: w.blocks]]
    else:
        dst = list(range(w.blocks))
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
    if device == "cuda":
        cfg.mem_pool_cfg = pool
        cfg.device_type = "cuda"
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
                     Placement.DEVICE if device == "cuda" else Placement.HOST)


def _pool_bytes(w: Workload) -> int:
    return w.block_bytes * w.cache_blocks * w.num_tensors + (1 << 20)


def _decoder(conn: Connection, workload: str, transport: str, port: int, device: str) -> None:
    """Child: own the destination cache, link to the prompt, report digests on request."""
    from datadist import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMRole

    w = WORKLOADS[workload]
    engine = LLMDataDist(LLMRole.DECODER, 2)
    try:
        engine.init(_config(transport, _pool_bytes(w), device=device))
        cache = engine.cache_manager.allocate_blocks_cache(_desc(w, device), BlocksCacheKey(2, 0))
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_remote_ip_info("127.0.0.1", port)
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
    a GPU, of a torch copy of them on that GPU."""
    if device == "cuda":
        return _torch_copy(w, src_blocks, dst_blocks)
    src = np.ones((w.num_tensors * w.cache_blocks, w.block_bytes), np.uint8)
    dst = np.zeros_like(src)
    times = []
    for _ in range(min(w.rounds, 20) + 1):
        t = time.perf_counter()
        for k in range(w.num_tensors):
            off = k * w.cache_blocks
            if w.scatter:
                for i, j in zip(src_blocks, dst_blocks):
                    dst[off + j] = src[off + i]
            else:
                np.copyto(dst[off: off + w.blocks], src[off: off + w.blocks])
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _torch_copy(w: Workload, src_blocks: List[int], dst_blocks: List[int]) -> float:
    import torch

    src = torch.ones((w.num_tensors * w.cache_blocks, w.block_bytes), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    si = torch.tensor(src_blocks, device="cuda")
    di = torch.tensor(dst_blocks, device="cuda")
    times = []
    for _ in range(min(w.rounds, 20) + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for k in range(w.num_tensors):
            off = k * w.cache_blocks
            if w.scatter:
                dst[off: off + w.cache_blocks].index_copy_(0, di, src[off: off + w.cache_blocks].index_select(0, si))
            else:
                dst[off: off + w.blocks].copy_(src[off: off + w.blocks])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


class _Decoder:
    """The spawned DECODER process of a run (:func:`_decoder`) and the pipe to it."""

    def __init__(self, workload: str, transport: str, port: Optional[int], device: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_decoder, args=(child_conn, workload, transport, port, device))

    def link(self) -> None:
        """Start the process and wait until it has linked to this one."""
        self.process.start()
        if not self.conn.poll(60):
            raise RuntimeError("decoder process did not link within 60 s")
        msg = self.conn.recv()
        if msg[0] != "linked" or msg[1] != 0:
            raise RuntimeError(f"decoder failed to link: {msg}")

    def digest(self) -> str:
        """The digest of the destination blocks, then let the process end."""
        self.conn.send("digest")
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
    """The source blocks cache (``BlocksCacheKey(1, 0)``), filled with seeded random data."""
    import torch
    from datadist import BlocksCacheKey

    src = cm.allocate_blocks_cache(_desc(w, device), BlocksCacheKey(1, 0))
    gen = torch.Generator().manual_seed(1)
    for tensor in cm.get_cache_tensors(src):
        tensor.view(torch.int16).copy_(torch.randint(-2**15, 2**15, tensor.shape, dtype=torch.int16, generator=gen))
    return src


def _push_batch(cm: "CacheManager", src: "Cache", w: Workload, src_blocks: List[int],
                dst_blocks: List[int]) -> Callable[[], None]:
    """One batch to the decoder's cache: one push_blocks, or one per layer (``layerwise``)."""
    from datadist import BlocksCacheKey

    key = BlocksCacheKey(2, 0)
    layers = w.num_tensors // 2

    def one_batch() -> None:
        if w.layerwise:
            for layer in range(layers):
                r = range(layer, layer + 1)
                cm.push_blocks(key, src, src_blocks, dst_blocks, src_layer_range=r, dst_layer_range=r)
        else:
            cm.push_blocks(key, src, src_blocks, dst_blocks, tensor_num_per_layer=1)

    return one_batch


def _timed(one_batch: Callable[[], None], rounds: int) -> List[float]:
    """Seconds of each of ``rounds`` batches, after one warm-up batch (lookups, page faults)."""
    one_batch()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        one_batch()
        times.append(time.perf_counter() - t)
    return times


def _result(w: Workload, workload: str, transport: str, device: str, times: List[float], src_blocks: List[int],
            dst_blocks: List[int]) -> Row:
    """The row of a verified run: its timings next to a raw copy of the same blocks."""
    med = statistics.median(times)
    memcpy_s = _memcpy(w, src_blocks, dst_blocks, device)
    us = sorted(t * 1e6 for t in times)
    return record(system=f"datadist-{transport}" + ("-cuda" if device == "cuda" else ""), workload=workload,
                  gbps=w.batch_bytes / med / 1e9, batch_ms=med * 1e3, p50_us=us[len(us) // 2],
                  p99_us=us[min(len(us) - 1, int(len(us) * 0.99))], block_kib=w.block_bytes >> 10, blocks=w.blocks,
                  scatter=w.scatter, raw_copy_gbps=w.batch_bytes / memcpy_s / 1e9, verified=True,
                  executor=executor(), device=device, transport=transport)


def run(workload: str, transport: str, device: str = "cpu") -> Row:
    """Run one workload over one transport; returns the result row (raises on bad data)."""
    from datadist import LLMDataDist, LLMRole

    w = WORKLOADS[workload]
    src_blocks, dst_blocks = _blocks(w)
    local = transport == "local"
    engine = LLMDataDist(LLMRole.PROMPT if not local else LLMRole.MIX, 1)
    decoder: Optional[_Decoder] = None
    try:
        engine.init(_config(transport, _pool_bytes(w) * (2 if local else 1),
                            listen=None if local else "127.0.0.1:0", device=device))
        cm = engine.cache_manager
        src = _filled_source(cm, w, device)
        if local:
            dst = cm.allocate_blocks_cache(_desc(w, device))
            mapping = dict(zip(src_blocks, dst_blocks))

            def one_batch() -> None:
                cm.swap_blocks(src, dst, mapping)
        else:
            decoder = _Decoder(workload, transport, engine.listen_port, device)
            decoder.link()
            one_batch = _push_batch(cm, src, w, src_blocks, dst_blocks)
        times = _timed(one_batch, w.rounds)
        expected = _digest(cm.get_cache_tensors(src), src_blocks)
        got = _digest(cm.get_cache_tensors(dst), dst_blocks) if decoder is None else decoder.digest()
        if got != expected:
            raise RuntimeError(f"data check failed for {workload} over {transport}: digest {got} != {expected}")
    finally:
        engine.finalize()
        if decoder is not None:
            decoder.join()
    return _result(w, workload, transport, device, times, src_blocks, dst_blocks)


def plan_rows(rounds: int = 200) -> List[Row]:
    """Time ``push_blocks``-style validation and planning (no data moves): 4096 blocks over
    64 tensors with a layer range covering every layer, in-order and scattered lists."""
    from ._planning import Side, blocks_plan

    base = np.arange(PLAN_TENSORS, dtype=np.uint64) * np.uint64(1 << 30) + np.uint64(1 << 40)
    src = Side(base, PLAN_TENSORS, PLAN_BLOCKS * 4096, PLAN_BLOCKS)
    dst = Side(base + np.uint64(1 << 36), PLAN_TENSORS, PLAN_BLOCKS * 4096, PLAN_BLOCKS)
    layers = range(0, PLAN_TENSORS // 2)
    rows = []
    for name, dst_blocks in (("in order", list(range(PLAN_BLOCKS))),
                             ("scattered", np.random.default_rng(7).permutation(PLAN_BLOCKS).tolist())):
        src_blocks = list(range(PLAN_BLOCKS))
        times = []
        for _ in range(rounds + 1):
            t = time.perf_counter()
            plan = blocks_plan(src, dst, src_blocks, dst_blocks, 2, layers, layers)
            times.append(time.perf_counter() - t)
        us = sorted(t * 1e6 for t in times[1:])
        rows.append({"workload": "plan", "transport": name, "system": "datadist-plan", "runs": plan.nruns,
                     "p50_us": us[len(us) // 2], "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))],
                     "blocks": PLAN_BLOCKS, "tensors": PLAN_TENSORS, "scatter": name == "scattered"})
    return rows


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
    return ap


def _apply(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set the executor the arguments name and refuse combinations this machine cannot run."""
    if args.executor:
        os.environ["DATADIST_EXECUTOR"] = args.executor  # the spawned decoder reads it at import
        set_executor(args.executor)
    if args.device == "cuda":
        from .engine import cuda

        if not cuda.available():
            ap.error("--device cuda: torch sees no CUDA device here")
    elif "nccl" in (args.transport or ()):
        ap.error("--transport nccl needs --device cuda")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib: pip install 'datadist[plot]'")


def _print_plan_rows(as_json: bool) -> None:
    for row in plan_rows():
        print(json.dumps(row) if as_json else
              f"{'plan':14s} {row['transport']:9s} {'':>8s} {'':>9s} {row['p50_us']:9.1f} {row['p99_us']:9.1f}"
              f"   ({row['runs']} runs)", flush=True)


def _run_workload(wl: str, transports: Sequence[str], device: str, as_json: bool) -> List[Row]:
    """Run ``wl`` over each transport, printing each row as it comes."""
    rows = []
    for tr in transports:
        row = run(wl, tr, device)
        rows.append(row)
        if as_json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{wl:14s} {tr:9s} {row['gbps']:8.2f} {row['batch_ms']:9.3f} {row['p50_us']:9.1f} "
                  f"{row['p99_us']:9.1f} {row['raw_copy_gbps']:13.2f} {row['ratio']:6.2f}",
                  flush=True)
    return rows


def _plot(rows: List[Row], out: str, sweep: bool) -> None:
    from ._plot import plot_rows

    title = ("datadist: 32 MiB pushed between two processes" if sweep
             else "datadist: workloads between two processes")
    for path in plot_rows(rows, out, title):
        print(f"# plot written to {path}", file=sys.stderr)


def _selection(args: argparse.Namespace) -> Tuple[List[str], List[str]]:
    """The workloads and the transports to run (defaults: all that apply)."""
    standard = [w for w in WORKLOADS if not w.startswith("sweep-")] + ["plan"]
    sweep = [f"sweep-{k}k" for k in SWEEP_KIB]
    workloads: List[str] = sweep if args.sweep else (args.workload or standard)
    transports: List[str] = args.transport or [t for t in TRANSPORTS if t != "nccl" or args.device == "cuda"]
    return workloads, transports


def main(argv: Optional[List[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    _apply(ap, args)
    workloads, transports = _selection(args)
    rows: List[Row] = []
    if not args.json:
        print(f"{'workload':14s} {'transport':9s} {'GB/s':>8s} {'batch ms':>9s} {'p50 us':>9s} {'p99 us':>9s} "
              f"{'raw copy GB/s':>13s} {'x raw':>6s}", flush=True)
    for wl in workloads:
        if wl == "plan":
            _print_plan_rows(args.json)
        else:
            rows.extend(_run_workload(wl, transports, args.device, args.json))
    if args.plot:
        _plot(rows, args.plot, args.sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
