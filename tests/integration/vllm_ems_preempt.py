"""EmsConnector when vLLM preempts a request whose save is still running, run with a
Python that has vLLM (see test_vllm_ems_preempt.py): ``python vllm_ems_preempt.py``
prints one JSON line.

Both roles of the real connector over a private ``ems-server``, driven step by step as
vLLM's scheduler and model runner drive them (``SchedulerOutput`` of vLLM's own classes):

1. step 1 schedules request A (4 full blocks of ``BS`` tokens in blocks 0..3); its
   "forward" writes A's KV (the value 1) there, and ``wait_for_save`` sends the save of
   those blocks to the pool, which is stopped (SIGSTOP) meanwhile, so the save is
   still to copy them;
2. step 2 preempts A (vLLM frees its blocks at once) and schedules B in those blocks: the
   model runner calls ``handle_preemptions`` and then B's "forward" writes the blocks
   (the value -7), on a thread of its own, while the pool is still stopped for half a
   second; then the pool goes on;
3. a load of A's keys into blocks 8..11 (through the connector, as a later request's
   load) shows what the pool stored under A's prompt.

Reports whether the forward of step 2 waited for the pool, the values the pool gave for
A's keys, and the scheduler half's state of A after the preemption.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import vllm.distributed.parallel_state as parallel_state
from _launch import private_pool
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.request import Request
from waiting import PACED, until

from ems.integrations.vllm.connector import EmsConnector, EmsConnectorMetadata
from ems.integrations.vllm.worker import BlockJob
from ems.keys import token_chain_hashes

BLOCKS, HEADS, BS, HEAD_SIZE, LAYERS = 40, 2, 16, 32, 2  # BLOCKS unlike any other dimension
STOPPED_S = 0.5


def _daemon_pid() -> int:
    """The ems-server this process started (private_pool's)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"ems.server" in cmdline:
            return int(entry.name)
    raise RuntimeError("no ems-server child found")


def _step(new: list[tuple[str, list[int], list[int]]], preempted: set[str]) -> SchedulerOutput:
    """A scheduler output that schedules ``new`` (id, prompt, blocks) whole."""
    reqs = [NewRequestData(req_id=r, prompt_token_ids=p, mm_features=[], sampling_params=None, pooling_params=None,
                           block_ids=(b,), num_computed_tokens=0, lora_request=None) for r, p, b in new]
    scheduled = {r: len(p) for r, p, _ in new}
    return dataclasses.replace(SchedulerOutput.make_empty(), scheduled_new_reqs=reqs, num_scheduled_tokens=scheduled,
                               total_num_scheduled_tokens=sum(scheduled.values()), preempted_req_ids=preempted)


def run(pool: str) -> dict[str, Any]:
    parallel_state.get_tensor_model_parallel_rank = lambda: 0  # type: ignore[assignment]
    parallel_state.get_tensor_model_parallel_world_size = lambda: 1  # type: ignore[assignment]
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
        "server": pool, "model_id": "preempt-test", "timeout_ms": 20000}),
        cache_config=SimpleNamespace(block_size=BS), model_config=SimpleNamespace(model="m"))
    kv_cache_config = SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[None])
    worker = EmsConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
    own = [torch.zeros((BLOCKS, HEADS, BS, 2 * HEAD_SIZE), dtype=torch.bfloat16) for _ in range(LAYERS)]
    worker.register_kv_caches({f"model.layers.{i}.self_attn": c for i, c in enumerate(own)})
    scheduler = EmsConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)
    scheduler.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
    daemon = _daemon_pid()

    prompt_a = list(range(1000, 1000 + 4 * BS + 1))
    request_a = Request("A", prompt_a, SamplingParams(max_tokens=8), None)
    assert scheduler.get_num_new_matched_tokens(request_a, 0) == (0, False)  # the pool is empty

    # Step 1: A computed in blocks 0..3 and saved, the pool stopped.
    meta1 = scheduler.build_connector_meta(_step([("A", prompt_a, [0, 1, 2, 3, 4])], set()))
    worker.handle_preemptions(meta1)
    worker.bind_connector_metadata(meta1)
    for cache in own:
        cache[0:5] = 1.0
    os.kill(daemon, signal.SIGSTOP)
    try:
        worker.wait_for_save()
        worker.clear_connector_metadata()
        # Step 2: A preempted, B scheduled in its freed blocks.
        meta2 = scheduler.build_connector_meta(_step([("B", list(range(BS - 1)), [0])], {"A"}))
        a_state = scheduler._scheduler_half._reqs["A"]

        def forward() -> None:
            worker.handle_preemptions(meta2)
            worker.bind_connector_metadata(meta2)
            for cache in own:
                cache[0:4] = -7.0  # B's KV (its one block, and the rest of the step's writes)

        runner = threading.Thread(target=forward, daemon=True)
        runner.start()
        runner.join(STOPPED_S)
        waited = runner.is_alive()
    finally:
        os.kill(daemon, signal.SIGCONT)
    runner.join(60)
    worker.clear_connector_metadata()
    until(lambda: "A" in (worker.get_finished({"A"})[0] or set()), 60, "A's saves reported finished", every=PACED)

    # A later request loads A's keys into blocks 8..11.
    hashes = token_chain_hashes(prompt_a, BS)
    worker.bind_connector_metadata(EmsConnectorMetadata(loads={"check": BlockJob([8, 9, 10, 11], hashes)}))
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    until(lambda: "check" in (worker.get_finished(set())[1] or set()), 60, "the check load finished", every=PACED)
    loaded = worker.get_block_ids_with_load_errors()
    values = sorted({float(v) for cache in own for v in cache[8:12].unique()})
    worker.shutdown()
    return {"forward_waited": waited, "runner_done": not runner.is_alive(), "preempted": sorted(meta2.preempted)
            if isinstance(meta2, EmsConnectorMetadata) and hasattr(meta2, "preempted") else None,
            "a_blocks_after_preemption": list(a_state.blocks), "load_errors": sorted(loaded or ()),
            "loaded": loaded is not None, "values_under_a_keys": values}


if __name__ == "__main__":
    with private_pool(64 << 20) as address:
        print(json.dumps(run(address)))
