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
  fan-in        --decoders processes (default 8) each linked to this one, all pulling at once
                16 random blocks of 4 tensors x 2 KiB (128 KiB) per call, 1000 times each; every
                byte they pulled checked after the rounds (datadist/bench/fanin.py).  gbps: the
                aggregate; batch_ms: wall time per round; p50_us / p99_us: one pull.
  plan          validation + plan building for 4096 blocks x 64 tensors (all 32 layers, in
                order and scattered), in one process; p50/p99 per plan; "cached": the same
                call repeated, finding its plan (keys of both lists, one lookup)
  --sweep       32 MiB in order at block sizes 4 KiB .. 1 MiB

``--checksum`` turns on end-to-end checksums of the transfers (``transfer_checksum``:
the pushes of this process, the pulls of fan-in's decoders; every row records
``checksum``): its cost is the difference to a run without it.

``--hog N`` runs N busy processes beside the measured ones for the whole run (every row
records ``hog``): the condition of a machine with more runnable threads than cores.
``--nice N`` runs the measured processes (this one and its decoders; the hogs stay at 0) at
scheduling niceness N, as ``nice -n N`` would (every row records ``nice``): below 0 needs
the right to raise priority (root, or CAP_SYS_NICE).  With every core busy, the kernel
holds a woken thread of equal weight until the running one's slice ends (milliseconds);
a weight above the hogs' lets the engine's threads run when woken (docs/performance.md).

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
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .. import __version__
from .fanin import TRANSPORTS as FANIN_TRANSPORTS, run_fanin
from .hog import Hog, set_nice
from .plan import print_plan_rows
from .record import record
from .shapes import (DEVICE_ONLY, DEVICES, SWEEP_KIB, TRANSPORTS, WORKLOADS, Workload, blocks, config, desc, filled_source,
                     pool_bytes, raw_copy_seconds, sized)
from ..engine.executor import EXECUTORS, executor, set_executor

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .._cache_manager import CacheManager
    from .._objects import Cache

__all__ = ["main", "WORKLOADS", "run", "sized"]

#: One result row (:func:`datadist.bench.record.record`).
Row = Dict[str, Any]


def _digest(tensors: Iterable["torch.Tensor"], blocks: Sequence[int]) -> str:
    """Digest of the listed blocks of every tensor, in list order."""
    h = hashlib.blake2b(digest_size=16)
    idx = np.asarray(blocks)
    for t in tensors:
        h.update(t.view(-1, t.shape[-1]).cpu().numpy()[idx].tobytes())
    return h.hexdigest()


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
        engine.init(config(transport, pool_bytes(w), device=device))
        cache = engine.cache_manager.allocate_blocks_cache(desc(w, device), BlocksCacheKey(2, 0))
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_remote_ip_info(prompt_ip, port)
        ret, _ = engine.link_clusters([info], timeout=10000)
        conn.send(("linked", int(ret)))
        if conn.poll(600) and conn.recv() == "digest":
            _, dst = blocks(w)
            conn.send(("digest", _digest(engine.cache_manager.get_cache_tensors(cache), dst)))
        conn.recv()
    except BaseException as exc:  # reported to the parent, which fails the run
        conn.send(("error", repr(exc)))
    finally:
        engine.finalize()


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
    memcpy_s = raw_copy_seconds(w, src_blocks, dst_blocks, device)
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
        hosts: Optional[Tuple[str, str]] = None, checksum: bool = False) -> Row:
    """Run one workload over one transport; returns the result row (raises on bad data).

    ``rounds``, ``requests`` and ``layers`` resize it (:func:`sized`).  Over ``local`` a
    batch is one ``swap_blocks`` of all its blocks (it takes no layer range).  ``hosts``
    (this process's address, the decoder's network namespace) puts the decoder on another
    host: this process listens on that address (see :mod:`.hosts`).  ``checksum``: this
    process's transfers (the pushes) carry end-to-end checksums (``transfer_checksum``)."""
    from datadist import LLMDataDist, LLMRole

    w = sized(workload, rounds, requests, layers)
    src_blocks, dst_blocks = blocks(w)
    local = transport == "local"
    engine = LLMDataDist(LLMRole.PROMPT if not local else LLMRole.MIX, 1)
    decoder: Optional[_Decoder] = None
    try:
        engine.init(config(transport, pool_bytes(w) * (2 if local else 1),
                           listen=None if local else f"{hosts[0] if hosts else '127.0.0.1'}:0", device=device,
                           checksum=checksum))
        cm = engine.cache_manager
        src = filled_source(cm, w, device)
        if local:
            dst = cm.allocate_blocks_cache(desc(w, device))
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
    row = _result(w, transport, device, batches, calls, src_blocks, dst_blocks)
    row["checksum"] = checksum
    return row


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
    ap.add_argument("--decoders", type=_positive, metavar="N",
                    help="fan-in: decoder processes pulling from the prompt at once (default 8)")
    ap.add_argument("--hog", type=_count, default=0, metavar="N",
                    help="N busy processes run beside the measured ones (a CPU hog; default 0)")
    ap.add_argument("--nice", type=int, default=0, metavar="N",
                    help="run the measured processes at niceness N (the hogs at 0; below 0 needs CAP_SYS_NICE)")
    ap.add_argument("--checksum", action="store_true",
                    help="end-to-end checksums of every socket transfer and shm copy (transfer_checksum; local "
                         "copies are not summed): compare with a run without it for the option's cost")
    return ap


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a count (0 or more): {text!r}")
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
    for transport, device in DEVICE_ONLY.items():
        if transport in (args.transport or ()) and args.device != device:
            ap.error(f"--transport {transport} needs --device {device}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib: pip install 'datadist[plot]'")
    if args.nice:
        try:
            set_nice(args.nice)
        except (PermissionError, ValueError) as exc:
            ap.error(f"--nice {args.nice}: {exc}")


def _run_workload(wl: str, transports: Sequence[str], args: argparse.Namespace) -> List[Row]:
    """Run ``wl`` over each transport, printing each row as it comes."""
    rows = []
    w = WORKLOADS[wl]
    shape = {"requests": args.requests, "layers": args.layers} if w.layerwise else {}
    for tr in transports:
        if w.decoders and tr not in FANIN_TRANSPORTS:
            continue  # a fan-in needs decoder processes
        if w.decoders:
            row = run_fanin(sized(wl, args.rounds, decoders=args.decoders), tr, args.device, checksum=args.checksum)
        else:
            row = run(wl, tr, args.device, rounds=args.rounds, checksum=args.checksum, **shape)
        row["hog"] = args.hog
        row["nice"] = args.nice
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        calls = _shape_note(row)
        print(f"{wl:14s} {tr:9s} {row['gbps']:8.2f} {row['batch_ms']:9.3f} {row['p50_us']:9.1f} "
              f"{row['p99_us']:9.1f} {row['raw_copy_gbps']:13.2f} {row['ratio']:6.2f}{calls}", flush=True)
    return rows


def _shape_note(row: Row) -> str:
    """What a row's batch and percentiles are, for the table (nothing for one call a batch)."""
    if "decoders" in row:
        return (f"   ({row['decoders']} decoders x {row['rounds']} pulls of {row['call_kib']} KiB; aggregate GB/s, "
                f"batch: one pull of each; p50/p99 of one pull)")
    return "" if "calls" not in row else (
            f"   ({row['requests']} requests x {row['layers']} layers: {row['calls']} calls of "
            f"{row['call_mib']:g} MiB a batch; p50/p99 of one call)" if row["calls"] > 1 else
            f"   (one call of {row['call_mib']:g} MiB a batch)")


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
    transports: List[str] = args.transport or [t for t in TRANSPORTS if DEVICE_ONLY.get(t, args.device) == args.device]
    _check_sizes(ap, args, workloads)
    return workloads, transports


def _check_sizes(ap: argparse.ArgumentParser, args: argparse.Namespace, workloads: Sequence[str]) -> None:
    """Refuse ``--requests`` / ``--layers`` without a layer-wise workload, or too large, and
    ``--decoders`` without the fan-in."""
    if args.decoders and not any(w in WORKLOADS and WORKLOADS[w].decoders for w in workloads):
        ap.error("--decoders applies to fan-in, which is not among the workloads")
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

        return main_hosts(ap, args, [w for w in workloads if w != "plan"], partial(run, checksum=args.checksum),
                          {w for w, spec in WORKLOADS.items() if spec.layerwise})
    rows: List[Row] = []
    if not args.json:
        print(f"{'workload':14s} {'transport':9s} {'GB/s':>8s} {'batch ms':>9s} {'p50 us':>9s} {'p99 us':>9s} "
              f"{'raw copy GB/s':>13s} {'x raw':>6s}", flush=True)
    with Hog(args.hog):
        for wl in workloads:
            if wl == "plan":
                print_plan_rows(args.json, args.rounds)
            else:
                rows.extend(_run_workload(wl, transports, args))
    if args.plot:
        _plot(rows, args.plot, args.sweep)
    return 0

