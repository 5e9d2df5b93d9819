"""The ``fan-in`` workload of ``python -m datadist.bench``: many decoders pulling from one
prompt at once.

This process is the PROMPT engine and owns the source cache (``w.cache_blocks`` blocks of
``w.num_tensors`` tensors, seeded values: :func:`~datadist.bench.shapes.source_base`).
``w.decoders`` spawned DECODER processes each link to it over one transport, pull a few
warm-up batches, and wait; then all start at once and each pulls ``w.rounds`` times
``w.blocks`` random blocks (drawn without repeats within a pull, each into the block of the
same index of its own cache), timing every call.  After the timed rounds each decoder checks
every byte of every block it pulled against the values it computes itself, and reports its
wrong bytes with its times.

The row: ``gbps`` is the aggregate (every byte every decoder pulled, over the wall time from
the first decoder's start to the last one's end), ``batch_ms`` that wall time per round (one
pull of every decoder), ``p50_us`` / ``p99_us`` one pull over all pulls of all decoders; it
adds ``decoders``, ``rounds``, ``calls`` (pulls in all) and ``call_kib`` (payload of one pull).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .children import collect_reports
from .record import record
from .shapes import Workload, config, desc, filled_source, pool_bytes, raw_copy_seconds, source_base
from ..engine.executor import executor

__all__ = ["run_fanin", "TRANSPORTS", "WARMUP"]

#: Transports a decoder process can link over (``local`` has no second process).
TRANSPORTS = ("shm", "tcp", "gloo")
#: Pulls each decoder makes before the timed rounds (link, plans, page faults).
WARMUP = 20
#: Longest wait for a decoder's report, in seconds (linked and warmed up; done).
_REPORT_S = 600.0

Row = Dict[str, Any]


def pulls(w: Workload, decoder: int) -> List[List[int]]:
    """The block lists decoder ``decoder`` pulls, warm-up first: ``w.blocks`` distinct random
    blocks each, seeded by the decoder's index."""
    rng = np.random.default_rng(1000 + decoder)
    return [rng.choice(w.cache_blocks, w.blocks, replace=False).tolist() for _ in range(WARMUP + w.rounds)]


def wrong_bytes(tensors: List[Any], touched: List[int]) -> int:
    """Bytes of the ``touched`` blocks of ``tensors`` (a decoder's cache) that differ from
    the source's values (tensor k holds ``source_base ^ k``)."""
    import torch

    idx = torch.tensor(touched, dtype=torch.long)
    base = source_base(tuple(tensors[0].shape))[idx]
    wrong = 0
    for k, tensor in enumerate(tensors):
        got = tensor.cpu().view(torch.int16)[idx]
        wrong += int(((got ^ (base ^ k)).view(torch.uint8) != 0).sum())
    return wrong


def _decoder(conn: Connection, w: Workload, transport: str, port: int, index: int, device: str,
             checksum: bool) -> None:
    """Child: link to the prompt, pull, report ``(start, end, call seconds, wrong bytes, blocks checked)``."""
    from datadist import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMRole

    engine = LLMDataDist(LLMRole.DECODER, 2 + index)
    try:
        engine.init(config(transport, pool_bytes(w), device=device, checksum=checksum))
        cm = engine.cache_manager
        dst = cm.allocate_blocks_cache(desc(w, device))
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_remote_ip_info("127.0.0.1", port)
        ret, _ = engine.link_clusters([info], timeout=10000)
        if int(ret) != 0:
            raise RuntimeError(f"link_clusters returned {ret}")
        lists, key = pulls(w, index), BlocksCacheKey(1, 0)
        for blocks in lists[:WARMUP]:
            cm.pull_blocks(key, dst, blocks, blocks)
        conn.send(("ready",))
        if not conn.poll(_REPORT_S) or conn.recv() != "go":
            raise RuntimeError("no start signal from the prompt")
        times = np.empty(w.rounds)
        start = time.monotonic()  # one clock for every process on the machine
        for i, blocks in enumerate(lists[WARMUP:]):
            t = time.perf_counter()
            cm.pull_blocks(key, dst, blocks, blocks)
            times[i] = time.perf_counter() - t
        end = time.monotonic()
        touched = sorted({b for blocks in lists for b in blocks})
        conn.send(("done", start, end, times.tobytes(), wrong_bytes(cm.get_cache_tensors(dst), touched),
                   len(touched)))
    except BaseException as exc:  # reported to the parent, which fails the run
        conn.send(("error", repr(exc)))
    finally:
        engine.finalize()


class _Decoders:
    """The spawned decoder processes of a run and the pipes to them."""

    def __init__(self, w: Workload, transport: str, port: int, device: str, checksum: bool) -> None:
        ctx = mp.get_context("spawn")
        self.conns: List[Connection] = []
        self.processes = []
        for i in range(w.decoders):
            conn, child = ctx.Pipe()
            self.conns.append(conn)
            self.processes.append(ctx.Process(target=_decoder, args=(child, w, transport, port, i, device, checksum),
                                              daemon=True))

    def reports(self, what: str) -> List[Tuple[Any, ...]]:
        """Every decoder's next report, which must be ``what``; raises naming the first that
        failed or stayed silent."""
        return collect_reports(self.conns, what, "decoder", _REPORT_S)

    def run(self) -> List[Tuple[Any, ...]]:
        """Start them, wait until all are linked and warm, start their rounds at once and
        return their ``done`` reports."""
        for p in self.processes:
            p.start()
        self.reports("ready")
        for conn in self.conns:
            conn.send("go")
        return self.reports("done")

    def join(self) -> None:
        """Wait for every started process; the pipes close first, so one still waiting
        for a start signal (a sibling failed) sees the end of its pipe and ends."""
        for conn in self.conns:
            conn.close()
        for p in self.processes:
            if p.pid is not None:
                p.join(30)
                if p.is_alive():
                    p.kill()
        bad = [(i, p.exitcode) for i, p in enumerate(self.processes) if p.exitcode not in (0, None)]
        if bad:
            raise RuntimeError(f"decoder processes exited badly (index, exit code): {bad}")


def run_fanin(w: Workload, transport: str, device: str = "cpu", checksum: bool = False) -> Row:
    """Run the fan-in workload ``w`` over ``transport``; returns the verified row (raises
    if any decoder failed or any byte it pulled is wrong).  ``checksum``: the decoders'
    pulls carry end-to-end checksums (``transfer_checksum``)."""
    from datadist import LLMDataDist, LLMRole

    if transport not in TRANSPORTS:
        raise ValueError(f"fan-in runs over {', '.join(TRANSPORTS)}, not over {transport}")
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    decoders: Optional[_Decoders] = None
    try:
        engine.init(config(transport, pool_bytes(w), listen="127.0.0.1:0", device=device))
        filled_source(engine.cache_manager, w, device)
        port = engine.listen_port
        assert port is not None  # a prompt engine initialized with a listen address listens
        decoders = _Decoders(w, transport, port, device, checksum)
        done = decoders.run()
    finally:
        if decoders is not None:
            decoders.join()
        engine.finalize()
    wrong = sum(d[4] for d in done)
    if wrong:
        raise RuntimeError(f"fan-in over {transport}: {wrong} wrong bytes among the pulled blocks")
    wall = max(d[2] for d in done) - min(d[1] for d in done)
    us = np.sort(np.concatenate([np.frombuffer(d[3]) for d in done])) * 1e6
    calls = len(us)
    call_bytes = w.blocks * w.num_tensors * w.block_bytes
    sample = pulls(w, 0)[WARMUP]
    return record(system=f"datadist-{transport}" + ("-cuda" if device == "cuda" else ""), workload=w.name,
                  gbps=calls * call_bytes / wall / 1e9, batch_ms=wall / w.rounds * 1e3,
                  p50_us=float(us[calls // 2]), p99_us=float(us[min(calls - 1, int(calls * 0.99))]),
                  block_kib=w.block_bytes >> 10, blocks=w.blocks, scatter=True,
                  raw_copy_gbps=call_bytes / raw_copy_seconds(w, sample, sample, device) / 1e9, verified=True,
                  executor=executor(), device=device, transport=transport, decoders=w.decoders, rounds=w.rounds,
                  calls=calls, call_kib=call_bytes >> 10, checked_blocks=min(d[5] for d in done), checksum=checksum)
