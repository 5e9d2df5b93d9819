"""DatadistConnector's worker halves with unequal tensor parallelism, run with a Python that
has vLLM (see test_vllm_unequal_tp.py): ``python vllm_unequal_tp.py`` prints one JSON line.

Real prefill and decode workers (``vllm_worker_halves``), each in a process of its own
(forked, one datadist engine each, linked over tcp on 127.0.0.1), each told its
tensor-parallel rank and size and given the KV heads of that rank: 4 KV heads in all, 2 per
rank at TP 2.  Each process runs its worker as vLLM's engine loop does (``vllm_pulls.Loop``).

With vLLM's CPU layout ``(num_blocks, kv_heads, block_size, 2 * head_size)`` (the ``vec``
kernels), the prefill caches are the heads of one pattern (``full``) and the decode
caches start as zeros; every pulled block is compared, per head, key and value row by
row as the CPU kernels read a block, with the pattern's heads of that decode rank:

- ``tp2_to_tp1``: two prefill ranks hold a request's blocks; one decode rank joins their
  heads (blocks of the same size);
- ``tp1_to_tp2``: one prefill rank holds three requests; two decode ranks of blocks twice
  as large each take their heads of 2 prefill blocks per block: both pull ``c0`` at once,
  on fresh links; then the first decode rank
  pulls ``c1`` alone, then the second: the prefill rank must hold the blocks after the
  first notice and free them after the second.  Only the first pulls ``lone`` (the second
  "died"): its 2 s lease frees it.

With vLLM's flash-attention layout ``(2, num_blocks, block_size, heads, head_size)``
(``flash_tp2_to_tp1``, ``flash_tp1_to_tp2``), which is not split, the load is refused
on every decode rank, nothing is moved, and every prefill rank frees the blocks at once.
"""
from __future__ import annotations

import json
import multiprocessing
from multiprocessing.connection import Connection
from typing import Any

import torch
from vllm_pulls import Child, Loop, assembled, serve_commands
from vllm_worker_halves import make_worker

from datadist.integrations.vllm.worker import RecvJob

HEADS, HEAD_SIZE, BLOCK, BLOCKS, LAYERS = 4, 32, 32, 8, 2
HELD_S = 60.0   # a lease no scenario expects to run out
LONE_S = 2.0    # the lease of the request only one of two decode ranks pulls


def full(block: int) -> list[torch.Tensor]:
    """The prefill pattern of every head (CPU layout): integers below 251, exact in
    bfloat16, different in every layer, block, head and row."""
    shape = (BLOCKS, HEADS, block, 2 * HEAD_SIZE)
    count = BLOCKS * HEADS * block * 2 * HEAD_SIZE
    return [((torch.arange(count) * (2 * layer + 1) + 5) % 251).to(torch.bfloat16).view(shape)
            for layer in range(LAYERS)]


def heads_of(rank: int, size: int) -> slice:
    return slice(rank * HEADS // size, (rank + 1) * HEADS // size)


class Heads(Loop):
    """The engine loop of a worker that holds the heads ``heads`` of the pattern; a pull
    is exact when each pulled block, per head read as ``(2 * block_size, head_size)``
    rows, is the pattern's heads of the prefill blocks laid end to end."""

    def __init__(self, worker: Any, own: list[torch.Tensor], heads: slice) -> None:
        self.heads = heads
        super().__init__(worker, own)

    def _exact(self, seed: int, job: RecvJob) -> bool:
        rows = 2 * BLOCK * job.ratio
        for mine, theirs in zip(self.own, full(BLOCK)):
            want = assembled(theirs[:, self.heads].contiguous(), job.remote_blocks, job.ratio)
            got = mine[job.local_blocks]
            if not torch.equal(got.view(len(job.local_blocks), -1, rows, HEAD_SIZE),
                               want.view(len(job.local_blocks), -1, rows, HEAD_SIZE)):
                return False
        return True


def _serve(conn: Connection, producer: bool, rank: int, size: int, block: int, flash: bool, lease_s: float) -> None:
    """One worker in a process of its own (datadist runs one engine per process)."""
    heads = heads_of(rank, size)
    if flash:
        own = [torch.full((2, BLOCKS, block, HEADS // size, HEAD_SIZE), 7 if producer else 0, dtype=torch.float16)
               for _ in range(LAYERS)]
    elif producer:
        own = [t[:, heads].contiguous() for t in full(block)]
    else:
        own = [torch.zeros((BLOCKS, HEADS // size, block, 2 * HEAD_SIZE), dtype=torch.bfloat16)
               for _ in range(LAYERS)]
    worker = make_worker(own, BLOCKS, producer, rank, size, "FLASH_ATTN:" if flash else "CPU_ATTN:vec",
                         lease_s=lease_s)
    loop = Heads(worker, own, heads)
    serve_commands(conn, loop, {
        "done": lambda arg: dict(loop.state(lambda lp: set(arg) <= set(lp.done)),
                                 zeros=all(bool((c == 0).all()) for c in own),
                                 bytes=sum(worker.stats.data.get("bytes_transferred", []))),
        # the prefill worker has read a first notice of request ``arg``
        "counted": lambda arg: loop.state(lambda lp: arg in lp.worker._notices or arg in lp.freed)})


class Rank(Child):
    """A worker rank of a tensor-parallel instance of ``size`` ranks."""

    def __init__(self, ctx: Any, producer: bool, rank: int, size: int, block: int = BLOCK, flash: bool = False,
                 lease_s: float = HELD_S) -> None:
        super().__init__(ctx, _serve, (producer, rank, size, block, flash, lease_s))

    def ready(self) -> "Rank":
        self.endpoint = self._recv()
        return self

    def hold(self, leases: dict[str, float]) -> None:
        self.call("step", ({}, leases, {}))

    def pull(self, peers: list["Rank"], jobs: dict[str, tuple[str, list[int], list[int]]], ratio: int = 1) -> None:
        """Start decode requests: id -> (prefill request, local blocks, remote blocks)."""
        endpoints = [p.endpoint for p in peers]
        recv = {req: RecvJob(local_blocks=local, remote_blocks=remote, remote_request_id=remote_id, peers=endpoints,
                             awaited=True, lease_s=HELD_S, ratio=ratio)
                for req, (remote_id, local, remote) in jobs.items()}
        self.call("step", (recv, {}, {req: (0, job) for req, job in recv.items()}))


def _started(ranks: list[Rank]) -> list[Rank]:
    return [r.ready() for r in ranks]


def tp2_to_tp1(ctx: Any) -> dict[str, Any]:
    prefill = _started([Rank(ctx, True, 0, 2), Rank(ctx, True, 1, 2)])
    decode = _started([Rank(ctx, False, 0, 1)])[0]
    try:
        for p in prefill:
            p.hold({"j": HELD_S})
        decode.pull(prefill, {"d-j": ("j", [1, 2, 3], [3, 4, 6])})
        state = decode.call("done", ["d-j"])
        freed = [p.call("freed", ["j"]) for p in prefill]
        return {"pulled": state["done"]["d-j"], "bytes": state["bytes"], "load_errors": state["load_errors"],
                "expired": [f["expired"] for f in freed]}
    finally:
        codes = [r.close() for r in prefill + [decode]]
        assert codes == [0] * len(codes), codes


def tp1_to_tp2(ctx: Any) -> dict[str, Any]:
    prefill = _started([Rank(ctx, True, 0, 1, lease_s=LONE_S)])
    decode = _started([Rank(ctx, False, 0, 2, 2 * BLOCK), Rank(ctx, False, 1, 2, 2 * BLOCK)])
    try:
        prefill[0].hold({"c0": HELD_S, "c1": HELD_S, "lone": LONE_S})
        for d in decode:  # both at once, on fresh links
            d.pull(prefill, {"d-c0": ("c0", [3, 4], [0, 1, 5])}, ratio=2)
        both = [d.call("done", ["d-c0"])["done"]["d-c0"] for d in decode]
        decode[0].pull(prefill, {"d-c1": ("c1", [1, 2], [2, 3, 4]), "d-lone": ("lone", [5], [6, 7])}, ratio=2)
        first = decode[0].call("done", ["d-c1", "d-lone"])
        after_first = prefill[0].call("counted", "c1")
        decode[1].pull(prefill, {"d-c1": ("c1", [1, 2], [2, 3, 4])}, ratio=2)
        second = decode[1].call("done", ["d-c1"])
        freed = prefill[0].call("freed", ["c1", "lone"])
        return {"both": both, "first": first["done"], "second": second["done"], "bytes": [first["bytes"], second["bytes"]],
                "held_after_first": "c1" not in after_first["freed"], "freed": sorted(freed["freed"]),
                "expired": freed["expired"]}
    finally:
        codes = [r.close() for r in prefill + decode]
        assert codes == [0] * len(codes), codes


def flash(ctx: Any, prefill_tp: int, decode_tp: int) -> dict[str, Any]:
    prefill = _started([Rank(ctx, True, r, prefill_tp, flash=True) for r in range(prefill_tp)])
    decode = _started([Rank(ctx, False, r, decode_tp, flash=True) for r in range(decode_tp)])
    try:
        for p in prefill:
            p.hold({"p-req": HELD_S})
        for d in decode:
            d.pull(prefill, {"d-req": ("p-req", [1, 2], [3, 4])})
        states = [d.call("done", ["d-req"]) for d in decode]
        start = min(s["done"]["d-req"]["t"] for s in states)
        freed = [p.call("freed", ["p-req"]) for p in prefill]
        return {"decode": [{"failed": s["done"]["d-req"]["failed"], "load_errors": s["load_errors"],
                            "zeros": s["zeros"]} for s in states],
                "freed_s": [f["freed"]["p-req"] - start for f in freed], "expired": [f["expired"] for f in freed]}
    finally:
        codes = [r.close() for r in prefill + decode]
        assert codes == [0] * len(codes), codes


if __name__ == "__main__":
    context = multiprocessing.get_context("fork")  # vLLM and torch are imported once, here
    print(json.dumps({"tp2_to_tp1": tp2_to_tp1(context), "tp1_to_tp2": tp1_to_tp2(context),
                      "flash_tp2_to_tp1": flash(context, 2, 1), "flash_tp1_to_tp2": flash(context, 1, 2)}))
