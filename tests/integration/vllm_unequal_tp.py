"""DatadistConnector's worker halves with unequal tensor parallelism, run with a Python that
has vLLM (see test_vllm_unequal_tp.py): ``python vllm_unequal_tp.py`` prints one JSON line.

Real prefill and decode workers (``vllm_worker_halves``), each in a process of its own
(forked, one datadist engine each, linked over tcp on 127.0.0.1), each told its
tensor-parallel rank and size.  The KV
caches have vLLM's flash-attention layout ``(2, num_blocks, block_size, heads, head_size)``
per layer, with the heads of that rank: 4 KV heads in all, 2 per rank at TP 2.

- ``tp2_to_tp1``: two prefill ranks hold a request's blocks; one decode rank is asked to
  pull them.
- ``tp1_to_tp2``: one prefill rank holds them; two decode ranks are asked to pull them.

For each: whether every decode rank reported the load failed with the block ids it was
given, its error message, whether the decode caches are still all zeros (nothing moved),
and how long until every prefill rank freed the blocks (told by the decode ranks).
"""
from __future__ import annotations

import json
import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch
from vllm_worker_halves import make_worker
from waiting import until

from datadist.integrations.vllm.worker import DatadistWorker, RecvJob

HEADS, HEAD_SIZE, BLOCK, BLOCKS, LAYERS = 4, 32, 16, 8, 2


def _worker(rank: int, size: int, producer: bool, fill: int) -> tuple[DatadistWorker, list[torch.Tensor]]:
    caches = [torch.full((2, BLOCKS, BLOCK, HEADS // size, HEAD_SIZE), fill, dtype=torch.float16)
              for _ in range(LAYERS)]
    return make_worker(caches, BLOCKS, producer, rank, size), caches


def _until(what: Callable[[], bool], timeout_s: float = 30.0) -> float:
    start = time.monotonic()
    until(what, timeout_s)
    return time.monotonic() - start


def _serve(conn: Connection, rank: int, size: int, producer: bool) -> None:
    """One worker in a process of its own (datadist runs one engine per process)."""
    worker, caches = _worker(rank, size, producer, 7 if producer else 0)
    try:
        conn.send(worker.endpoint)
        if producer:
            worker.start({}, {"p-req": 60.0})
            conn.send(_until(lambda: "p-req" in worker.finished(set())[0]))
            return
        peers = conn.recv()
        worker.start({"d-req": RecvJob(local_blocks=[1, 2], remote_blocks=[3, 4], remote_request_id="p-req",
                                       peers=peers, awaited=True, lease_s=60.0)}, {})
        seen: dict[str, set[str]] = {"received": set(), "failed": set()}

        def done() -> bool:
            _, received, failed = worker.finished(set())
            seen["received"] |= received
            seen["failed"] |= failed
            return "d-req" in seen["received"]

        _until(done)
        conn.send({"failed": "d-req" in seen["failed"], "load_errors": sorted(worker.take_load_errors()),
                   "zeros": all(bool((c == 0).all()) for c in caches)})
    finally:
        worker.close()


def scenario(prefill_tp: int, decode_tp: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")  # vLLM and torch are imported once, here
    children = []
    for producer, size in ((True, prefill_tp), (False, decode_tp)):
        for rank in range(size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, rank, size, producer))
            proc.start()
            children.append((producer, proc, ours))
    try:
        peers = [conn.recv() for producer, _, conn in children if producer]
        for producer, _, conn in children:
            if not producer:
                conn.recv()  # its endpoint: none
                conn.send(peers)
        decode = [conn.recv() for producer, _, conn in children if not producer]
        freed_s = [conn.recv() for producer, _, conn in children if producer]
        for _, proc, _ in children:
            proc.join(30)
        return {"decode": decode, "freed_s": freed_s, "exit_codes": [proc.exitcode for _, proc, _ in children]}
    finally:
        for _, proc, _ in children:
            if proc.is_alive():
                proc.kill()
                proc.join(10)


if __name__ == "__main__":
    print(json.dumps({"tp2_to_tp1": scenario(2, 1), "tp1_to_tp2": scenario(1, 2)}))
