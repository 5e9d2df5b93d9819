"""The KV events of ``EmsConnector``'s scheduler half against a real pool, run with a Python
that has vLLM (see test_vllm_events.py): ``python vllm_ems_events.py POOL_ADDRESS`` prints
one JSON line.

A 14-token prompt (block size 4) is scheduled, its three full blocks saved to the pool
by ``ContextCaching.save`` (what the worker half does), and its saves confirmed; then a
prompt that opens with it, with vLLM's own prefix cache holding the first 12 tokens, saves
two more; then other keys fill the pool until the first prompt's blocks are evicted and a
lookup of it finds them gone.  Reports the events ``take_events`` gave at each stage, as
msgpack-decoded ``KVEventBatch`` contents (what a router receives).
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import msgspec
import torch
from vllm.distributed.kv_events import KVEventBatch

from ems.integrations.vllm.connector import _Scheduler
from ems.integrations.vllm.worker import PoolIdentity, Settings, init_pool
from ems.keys import token_chain_hashes

BLOCK = 4
BLOCK_BYTES = 64 << 10  # per tensor; two tensors a key


def _out(req_id: str, blocks: list[int], computed: int, scheduled: int) -> Any:
    new = SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req_id: scheduled})


def _published(sched: _Scheduler) -> list[dict[str, Any]]:
    wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=sched.events.take()))
    batch = msgspec.msgpack.decode(wire, type=KVEventBatch)
    return [{"kind": type(e).__name__, **{k: getattr(e, k) for k in e.__struct_fields__}} for e in batch.events]


def run(server: str) -> dict[str, Any]:
    settings = Settings(server=server, timeout_ms=5000, lookup_timeout_ms=5000, model_id="events-test")
    identity = PoolIdentity(model_id="events-test", kvcache_type="MHA", device_id=0, tp_world_size=1,
                            rank_in_tp_group=0)
    sched = _Scheduler(SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK)), settings)
    sched.connect(identity)
    cc = init_pool(identity, settings)
    cache = [torch.arange(64 * BLOCK_BYTES, dtype=torch.int64).to(torch.uint8).view(64, 1, 1, BLOCK_BYTES)
             for _ in range(2)]
    cc.register_kvcache([cache])

    def worker_saves(meta: Any) -> None:
        for jobs in meta.saves.values():
            for job in jobs:
                cc.save(slot_mapping=job.block_ids, hashes=job.hashes, offsets=[1] * len(job.block_ids))

    first = list(range(1000, 1014))
    a = SimpleNamespace(request_id="a", prompt_token_ids=first)
    report: dict[str, Any] = {"hashes": token_chain_hashes(first, BLOCK), "first": first}
    report["lookup_a"] = sched.matched_tokens(a, 0)
    worker_saves(sched.build_meta(_out("a", [0, 1, 2, 3], 0, len(first))))
    report["before_confirm"] = _published(sched)
    report["a_held"] = sched.finished(a)
    sched.confirm_saves({"a"})
    report["after_a"] = _published(sched)

    longer = first[:12] + list(range(2000, 2008))
    report["longer"] = longer
    report["longer_hashes"] = token_chain_hashes(longer, BLOCK)
    b = SimpleNamespace(request_id="b", prompt_token_ids=longer)
    report["lookup_b"] = sched.matched_tokens(b, 12)  # vLLM's own cache had 12 tokens
    worker_saves(sched.build_meta(_out("b", [4, 5, 6, 7, 8], 12, 8)))
    sched.finished(b)
    sched.confirm_saves({"b"})
    report["after_b"] = _published(sched)

    filler = list(range(10_000, 10_000 + 64 * BLOCK))  # 64 keys of 128 KiB into a 1 MiB pool
    fill_hashes = token_chain_hashes(filler, BLOCK)
    for i in range(0, 64, 8):
        cc.save(slot_mapping=list(range(i, i + 8)), hashes=fill_hashes[i:i + 8], offsets=[1] * 8)
    again = SimpleNamespace(request_id="c", prompt_token_ids=first)
    report["lookup_after_fill"] = sched.matched_tokens(again, 0)
    report["after_fill"] = _published(sched)
    return report


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
