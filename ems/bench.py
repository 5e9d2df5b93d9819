"""``python -m ems.bench``: save / load / exists through a real daemon, two processes.

Workload (PERF.md ``kv-7b`` shape): ``--layers`` x (K, V) tensors of
``[blocks, 128, heads, 128]`` fp16; a hash covers one 128-token block of every tensor, so
one value is layers x 2 x 256 KiB = 16 MiB with the defaults.  The parent process saves
``--hashes`` new hashes per call; a second process (spawned) loads them into its own
cache and checks the bytes; ``exists`` asks for 256 hashes.  A raw copy of the same number
of bytes (numpy, one process) is timed once per round, right after that round's load, so it
sees the same machine conditions; like every row it is the median over the rounds (as
``peer_bench.py`` reports its memcpy).

``--clients N``: N client processes against one daemon, all starting at once, each doing
``--rounds`` rounds of: save ``--hashes`` blocks holding new random values, ``exists`` of
their hashes, load them into other blocks of its cache, and compare every byte (small
values by default: 2 layers, 2 heads, 16-token blocks, 4 hashes a call).  Any failed key or
wrong byte fails the run.  Rows over all calls of all clients add ``clients``, ``rounds``
and ``wall_s`` (first client's start to last one's end).

Rows (table, or ``--json`` lines) are :mod:`datadist.bench.record` records, the one schema of
both benches and the peers' bench: ``workload`` is the operation (save, load, exists),
``raw_copy_gbps`` the raw copy, plus ``bytes`` per call.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from multiprocessing.connection import Connection
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from datadist.bench.children import collect_reports
from datadist.bench.record import record
from datadist.engine.executor import executor

from . import __version__

if TYPE_CHECKING:

    import torch

    from .context_caching import ContextCaching

__all__ = ["main"]


def _kvcache(args: argparse.Namespace, seed: int) -> List[List[torch.Tensor]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (args.cache_blocks, args.block_size, args.heads, args.head_size)
    return [[torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int16).view(torch.float16)
             for _ in range(2)] for _ in range(args.layers)]


def _init(server: str, rank: int) -> ContextCaching:
    from ems import CcConfig_v1, Ems, EmsConfig

    Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=rank, device_id=0, model_id="bench-7b"),
                       server=server))
    cc = Ems.get_cc()
    assert cc is not None  # Ems.init succeeded
    return cc


def _slots(blocks: List[int], block_size: int) -> List[int]:
    return [b * block_size + i for b in blocks for i in range(block_size)]


def _loader(server: str, args: argparse.Namespace, conn: Connection) -> None:
    """Second process: loads what the parent saved, checks it, times it."""
    from ems import CcKvOption

    cc = _init(server, 0)
    kv = _kvcache(args, seed=99)
    cc.register_kvcache(kv)
    option = CcKvOption(timeout=60000)
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        if cmd[0] == "load":
            _, hashes, blocks, expect_seed = cmd
            t0 = time.perf_counter()
            res = cc.load(slot_mapping=_slots(blocks, args.block_size), hashes=hashes,
                          offsets=[args.block_size] * len(hashes), option=option)
            dt = time.perf_counter() - t0
            ok = res.success == len(hashes)
            if ok and expect_seed is not None:
                ref = _kvcache(args, seed=expect_seed)
                ok = all(bool((kv[l][k][blocks] .view(np.int16 if False else kv[l][k].dtype)
                               == ref[l][k][blocks]).all()) for l in (0, args.layers - 1) for k in (0, 1))
            conn.send((dt, ok, res.success))
        elif cmd[0] == "exists":
            _, hashes, reps = cmd
            times = []
            hits = 0
            for _ in range(reps):
                t0 = time.perf_counter()
                hits = cc.exists(hashes, CcKvOption(timeout=5000)).success
                times.append(time.perf_counter() - t0)
            conn.send((times, hits))


class _Memcpy:
    """The memcpy ceiling: one timed numpy copy of ``nbytes`` per call to ``sample``."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.random.randint(0, 255, nbytes, dtype=np.uint8)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # fault both in
        self.times: List[float] = []

    def sample(self) -> None:
        self.times.append(_timed(lambda: np.copyto(self.dst, self.src)))

    def gbps(self) -> float:
        return self.src.nbytes / float(np.median(self.times)) / 1e9


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _row(op: str, times: List[float], nbytes: int, memcpy: float, args: argparse.Namespace,
         exists_keys: int = 256) -> Dict[str, Any]:
    arr = np.array(times)
    gbps = nbytes / float(np.median(arr)) / 1e9 if nbytes else 0.0
    return record(system="ems", workload=op, gbps=gbps, batch_ms=float(np.median(arr)) * 1e3,
                  p50_us=float(np.percentile(arr, 50)) * 1e6, p99_us=float(np.percentile(arr, 99)) * 1e6,
                  block_kib=args.block_size * args.heads * args.head_size * 2 // 1024,
                  blocks=args.hashes if nbytes else exists_keys, scatter=False, raw_copy_gbps=memcpy,
                  verified=op != "exists", executor=executor(), bytes=nbytes)


def run(args: argparse.Namespace) -> List[Dict[str, Any]]:
    from ems import CcKvOption, Ems

    value_bytes = args.layers * 2 * args.block_size * args.heads * args.head_size * 2
    call_bytes = value_bytes * args.hashes
    server, daemon, tmp = _serve(args.server, call_bytes * 3 + (64 << 20))  # small: rounds recycle pages
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_loader, args=(server, args, child_end))
    child.start()
    rows: List[Dict[str, Any]] = []
    try:
        cc = _init(server, 0)
        option = CcKvOption(timeout=60000)
        ceiling = _Memcpy(call_bytes)
        save_t, load_t = [], []
        rng = np.random.default_rng(1)
        for it in range(args.iters + args.warmup):
            kv = _kvcache(args, seed=it)
            cc.register_kvcache(kv)
            blocks = sorted(rng.choice(args.cache_blocks, args.hashes, replace=False).tolist())
            hashes = [int(h) for h in rng.integers(1, 2**62, args.hashes)]
            t0 = time.perf_counter()
            res = cc.save(slot_mapping=_slots(blocks, args.block_size), hashes=hashes,
                          offsets=[args.block_size] * args.hashes, option=option)
            dt = time.perf_counter() - t0
            if res.success != args.hashes:
                raise SystemExit(f"save stored {res.success} of {args.hashes}")
            dst_blocks = sorted(rng.choice(args.cache_blocks, args.hashes, replace=False).tolist())
            parent_end.send(("load", hashes, dst_blocks, None))
            ldt, ok, got = parent_end.recv()
            if not ok:
                raise SystemExit(f"load returned {got} of {args.hashes} or wrong bytes")
            if it >= args.warmup:  # warm-up rounds fault the arena's pages into both processes
                save_t.append(dt)
                load_t.append(ldt)
                ceiling.sample()
        memcpy = ceiling.gbps()
        del ceiling
        rows.append(_row("save", save_t, call_bytes, memcpy, args))
        rows.append(_row("load", load_t, call_bytes, memcpy, args))
        # exists of 256 hashes that are all present (1-token values)
        kv = _kvcache(args, seed=7)
        cc.register_kvcache(kv)
        hashes = [int(h) for h in rng.integers(1, 2**62, 256)]
        cc.save(slot_mapping=list(range(256)), hashes=hashes, offsets=[1] * 256, option=option)
        parent_end.send(("exists", hashes, args.exists_reps))
        times, hits = parent_end.recv()
        if hits != 256:
            raise SystemExit(f"exists found {hits} of 256")
        rows.append(_row("exists", times[5:], 0, memcpy, args))
        parent_end.send(("stop",))
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        Ems._shutdown()
        _stop(daemon, tmp)
    return rows


def _serve(server: Optional[str], capacity: int) -> Tuple[str, Optional[subprocess.Popen[bytes]], Optional[str]]:
    """``server``, or a private daemon of ``capacity`` bytes started in a new directory:
    (its address, the daemon, the directory) for :func:`_stop`."""
    if server is not None:
        return server, None, None
    tmp = tempfile.mkdtemp(prefix="ems-bench-")
    r, w = os.pipe()
    daemon = subprocess.Popen([sys.executable, "-m", "ems.server", "serve", "--dir", tmp,
                               "--capacity", str(capacity), "--ready-fd", str(w), "--log-level", "WARNING"],
                              pass_fds=(w,))
    os.close(w)
    with os.fdopen(r) as f:
        line = f.readline()
    if not line.startswith("READY"):
        _stop(daemon, tmp)
        raise SystemExit(f"ems-server did not start: {line!r}")
    return tmp, daemon, tmp


def _stop(daemon: Optional[subprocess.Popen[bytes]], tmp: Optional[str]) -> None:
    if daemon is not None:
        daemon.terminate()
        daemon.wait(30)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


# -- --clients N: many client processes against one daemon at once ----------------------------

def _refill(kv: List[List[torch.Tensor]], blocks: List[int], gen: torch.Generator) -> None:
    """New random values in ``blocks`` of every tensor (each round saves bytes no earlier
    round saved, so a load of a stale value cannot pass the check)."""
    import torch

    for layer in kv:
        for t in layer:
            shape = (len(blocks),) + tuple(t.shape[1:])
            t[blocks] = torch.randint(-1000, 1000, shape, generator=gen, dtype=torch.int16).view(t.dtype)


def _wrong_bytes(kv: List[List[torch.Tensor]], src: List[int], dst: List[int]) -> int:
    """Bytes of blocks ``dst`` that differ from blocks ``src`` (pairwise), over every tensor."""
    import torch

    return sum(int((t[dst].view(torch.uint8) != t[src].view(torch.uint8)).sum()) for layer in kv for t in layer)


def _client(server: str, args: argparse.Namespace, index: int, conn: Connection) -> None:
    """Client process ``index``: wait for the start, then ``args.rounds`` rounds of save
    ``args.hashes`` blocks, ``exists`` of their hashes, load them into other blocks, every
    byte compared; reports ``(start, end, {op: seconds of each call}, errors, wrong bytes)``."""
    import torch
    from ems import CcKvOption, Ems

    try:
        cc = _init(server, 0)
        kv = _kvcache(args, seed=1000 + index)
        cc.register_kvcache(kv)
        option, rng, gen = CcKvOption(timeout=60000), np.random.default_rng(index), torch.Generator()
        gen.manual_seed(index)
        half, n = args.cache_blocks // 2, args.hashes
        times: Dict[str, List[float]] = {"save": [], "exists": [], "load": []}
        errors = wrong = 0
        conn.send(("ready",))
        if not conn.poll(600) or conn.recv() != "go":
            raise RuntimeError("no start signal")
        start = time.monotonic()
        for _ in range(args.rounds):
            src = sorted(rng.choice(half, n, replace=False).tolist())
            dst = sorted((half + rng.choice(args.cache_blocks - half, n, replace=False)).tolist())
            _refill(kv, src, gen)
            keys = [int(h) for h in rng.integers(1, 2**62, n)]
            offsets = [args.block_size] * n
            t0 = time.perf_counter()
            errors += n - cc.save(slot_mapping=_slots(src, args.block_size), hashes=keys, offsets=offsets,
                                  option=option).success
            t1 = time.perf_counter()
            errors += n - cc.exists(keys, option).success
            t2 = time.perf_counter()
            errors += n - cc.load(slot_mapping=_slots(dst, args.block_size), hashes=keys, offsets=offsets,
                                  option=option).success
            t3 = time.perf_counter()
            for op, dt in (("save", t1 - t0), ("exists", t2 - t1), ("load", t3 - t2)):
                times[op].append(dt)
            wrong += _wrong_bytes(kv, src, dst)
        conn.send(("done", start, time.monotonic(), times, errors, wrong))
    except BaseException as exc:  # reported to the parent, which fails the run
        conn.send(("error", repr(exc)))
    finally:
        Ems._shutdown()


def _reports(conns: List[Connection], what: str) -> List[Tuple[Any, ...]]:
    return collect_reports(conns, what, "client", 600, SystemExit)


def run_clients(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """``args.clients`` client processes against one daemon, all starting at once; rows for
    save, exists and load (each call over all clients), with the wall time of the whole run."""
    value_bytes = args.layers * 2 * args.block_size * args.heads * args.head_size * 2
    call_bytes = value_bytes * args.hashes
    server, daemon, tmp = _serve(args.server, call_bytes * args.clients * 4 + (64 << 20))
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    try:
        for i in range(args.clients):
            parent_end, child_end = ctx.Pipe()
            conns.append(parent_end)
            procs.append(ctx.Process(target=_client, args=(server, args, i, child_end), daemon=True))
            procs[-1].start()
        _reports(conns, "ready")
        for conn in conns:
            conn.send("go")
        done = _reports(conns, "done")
    finally:
        for conn in conns:
            conn.close()  # a client still waiting for the start sees the end of its pipe
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        _stop(daemon, tmp)
    return _client_rows(args, done, call_bytes)


def _client_rows(args: argparse.Namespace, done: List[Tuple[Any, ...]], call_bytes: int) -> List[Dict[str, Any]]:
    """The rows of the clients' ``done`` reports; raises for any failed key or wrong byte."""
    errors, wrong = sum(d[4] for d in done), sum(d[5] for d in done)
    if errors or wrong:
        raise SystemExit(f"{args.clients} clients: {errors} failed keys, {wrong} wrong bytes")
    ceiling = _Memcpy(call_bytes)
    for _ in range(20):
        ceiling.sample()
    wall = max(d[2] for d in done) - min(d[1] for d in done)
    extra = {"clients": args.clients, "rounds": args.rounds, "wall_s": round(wall, 3), "errors": 0, "wrong_bytes": 0}
    return [dict(_row(op, [t for d in done for t in d[3][op]], 0 if op == "exists" else call_bytes,
                      ceiling.gbps(), args, exists_keys=args.hashes), **extra) for op in ("save", "exists", "load")]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ems.bench", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    p.add_argument("--server", default=None, help="use this daemon (default: start a private one)")
    p.add_argument("--layers", type=int, help="layers of the cache (default 32; with --clients 2)")
    p.add_argument("--heads", type=int, help="default 8; with --clients 2")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, help="tokens of a block (default 128; with --clients 16)")
    p.add_argument("--hashes", type=int, help="hashes (blocks) per save/load call (default 8; with --clients 4)")
    p.add_argument("--cache-blocks", type=int, help="blocks in each process's KV cache (default 24; with --clients 16)")
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--warmup", type=int, default=4, help="untimed rounds first (arena pages fault in)")
    p.add_argument("--exists-reps", type=int, default=200)
    p.add_argument("--clients", type=_positive, help="N client processes at once, each doing --rounds rounds of "
                   "save, exists and load into other blocks, every byte compared (rows over all their calls)")
    p.add_argument("--rounds", type=_positive, default=100, help="rounds of each client with --clients (default 100)")
    args = p.parse_args(argv)
    many = args.clients is not None
    for name, alone, with_clients in (("layers", 32, 2), ("heads", 8, 2), ("block_size", 128, 16),
                                      ("hashes", 8, 4), ("cache_blocks", 24, 16)):
        if getattr(args, name) is None:
            setattr(args, name, with_clients if many else alone)
    if many and args.cache_blocks < 2 * args.hashes:
        p.error(f"--cache-blocks {args.cache_blocks}: --clients needs at least twice --hashes ({args.hashes})")
    rows = run_clients(args) if many else run(args)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"{'op':<8}{'GB/s':>9}{'p50 us':>12}{'p99 us':>12}{'raw copy':>10}{'ratio':>8}")
        for r in rows:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
            gbps = "-" if r["workload"] == "exists" else f"{r['gbps']:.2f}"
            print(f"{r['workload']:<8}{gbps:>9}{r['p50_us']:>12.1f}{r['p99_us']:>12.1f}{r['raw_copy_gbps']:>10.2f}"
                  f"{ratio:>8}")
        if many:
            print(f"# {args.clients} clients x {args.rounds} rounds: {rows[0]['wall_s']:.3f} s, 0 failed keys, "
                  "0 wrong bytes")
    return 0


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
