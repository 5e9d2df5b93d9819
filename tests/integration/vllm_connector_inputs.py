"""DatadistConnector against what a client or a proxy may send, run with a Python that has
vLLM (see test_vllm_connector_inputs.py): ``python vllm_connector_inputs.py`` prints one
JSON line.

- ``params``: the scheduler half, given vLLM's own ``Request`` (its ``kv_transfer_params``
  from the sampling parameters, as vLLM takes them) and ``KVCacheBlocks`` of 4 fresh
  blocks for a 64-token prompt (block size 16), for sound and malformed parameters:
  whether ``get_num_new_matched_tokens`` counted external tokens, whether
  ``update_state_after_alloc`` raised, and the pull it planned.
- ``pulls``: a decode worker (``vllm_worker_halves``) and a live prefill worker in a
  process of its own (``vllm_pulls.Half``): a pull the scheduler refused (too few
  prefill blocks), one whose prefill block ids are strings (a job the scheduler half
  would not make: the pull thread meets an unexpected exception), and a sound one, each
  reported to vLLM (received; failed with load errors, or exact), none left pending; the
  warning about a lease no longer than a pull may take, logged once.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
from types import SimpleNamespace
from typing import Any

from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request
from vllm_pulls import BLOCKS, Half, caches
from vllm_worker_halves import make_worker
from waiting import PACED, until

from datadist.integrations.vllm.connector import DatadistConnectorMetadata, _Scheduler, _settings
from datadist.integrations.vllm.worker import RecvJob

SOUND = dict(do_remote_prefill=True, remote_block_ids=[0, 1, 2, 3], remote_engine_id="p", remote_request_id="r",
             remote_host="127.0.0.1", remote_port=5000, remote_cluster_ids=[7], tp_size=1, kv_lease_duration=30.0,
             remote_block_size=16)

#: name -> what replaces SOUND's keys
CASES: dict[str, dict[str, Any]] = {
    "sound": {},
    "longer_remote": {"remote_block_ids": [8, 9, 0, 1, 2, 3]},
    "short_remote": {"remote_block_ids": [0, 1]},
    "empty_remote": {"remote_block_ids": []},
    "half_size_blocks": {"remote_block_size": 8, "remote_block_ids": list(range(10))},
    "half_size_blocks_short": {"remote_block_size": 8, "remote_block_ids": list(range(6))},
    "string_block_ids": {"remote_block_ids": "0123"},
    "scalar_block_ids": {"remote_block_ids": 5},
    "bool_block_ids": {"remote_block_ids": [True, 1, 2, 3]},
    "negative_block_id": {"remote_block_ids": [0, 1, -2, 3]},
    "cluster_id_not_int": {"remote_cluster_ids": ["abc"]},
    "no_clusters": {"remote_cluster_ids": []},
    "port_not_int": {"remote_port": "http"},
    "port_too_large": {"remote_port": 70000},
    "hosts_shorter_than_clusters": {"remote_cluster_ids": [7, 8], "remote_hosts": ["h"], "remote_ports": [1, 2]},
    "request_id_not_str": {"remote_request_id": ["r"]},
}


def _scheduler() -> _Scheduler:
    kv = SimpleNamespace(kv_connector_extra_config={}, is_kv_producer=False, is_kv_consumer=True, engine_id="d")
    cfg = SimpleNamespace(kv_transfer_config=kv, parallel_config=SimpleNamespace(tensor_parallel_size=1),
                          cache_config=SimpleNamespace(block_size=16))
    return _Scheduler(cfg, _settings(cfg))


def params_case(sched: _Scheduler, name: str, over: dict[str, Any]) -> dict[str, Any]:
    params = {**SOUND, **over}
    request = Request(name, list(range(64)), SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params}),
                      None)
    out: dict[str, Any] = {}
    try:
        count, load_async = sched.matched_tokens(request, 0)
        out["matched"] = [count, load_async]
        sched.after_alloc(request, KVCacheBlocks(([KVCacheBlock(b) for b in (10, 11, 12, 13)],)), count)
        job = sched.build_meta().reqs_to_recv.get(name)
    except Exception as exc:  # what would end vLLM's engine
        out["raised"] = f"{type(exc).__name__}: {exc}"
        return out
    out["job"] = None if job is None else {"local": job.local_blocks, "remote": job.remote_blocks,
                                           "refused": job.refused, "awaited": job.awaited}
    return out


def pulls() -> dict[str, Any]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("datadist.vllm")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    prefill = Half(multiprocessing.get_context("fork"), True, seed=3)
    prefill.ready()
    own = caches(None)
    decode = make_worker(own, BLOCKS, False, timeout_ms=3000)
    try:
        ep = prefill.endpoint
        prefill.hold("p-short", "p-str", "p-ok", lease_s=60.0)
        base = dict(SOUND, remote_host=ep.host, remote_port=ep.port, remote_cluster_ids=[ep.cluster_id],
                    kv_lease_duration=2.0)  # no longer than the decode worker's 3 s timeout: one warning
        sched = _scheduler()
        jobs: dict[str, RecvJob] = {}
        for name, blocks, local in (("short", [0, 1], [10, 11, 12, 13]), ("ok", [4, 5], [6, 7])):
            request = Request(name, list(range(16 * len(local))), SamplingParams(
                max_tokens=8, extra_args={"kv_transfer_params": {**base, "remote_request_id": f"p-{name}",
                                                                  "remote_block_ids": blocks}}), None)
            count, _ = sched.matched_tokens(request, 0)
            sched.after_alloc(request, KVCacheBlocks(([KVCacheBlock(b) for b in local],)), count)
        meta: DatadistConnectorMetadata = sched.build_meta()
        jobs.update(meta.reqs_to_recv)
        decode.start(meta.reqs_to_recv, {})
        jobs["str"] = RecvJob(local_blocks=[1, 2, 3], remote_blocks=["0", "1", "2"], remote_request_id="p-str",
                              peers=list(jobs["ok"].peers), awaited=True, lease_s=2.0)  # type: ignore[list-item]
        decode.start({"str": jobs["str"]}, {})  # a second step of short leases: no second warning
        done: set[str] = set()
        failed: set[str] = set()
        errors: set[int] = set()

        def all_reported() -> bool:
            _, received, bad = decode.finished(set())
            done.update(received)
            failed.update(bad)
            errors.update(decode.take_load_errors())
            return done == set(jobs)

        until(all_reported, 30, lambda: f"pulls reported: {sorted(done)} of {sorted(jobs)}", every=PACED)
        want = caches(3)
        exact = all(bool((mine[[6, 7]] == theirs[[4, 5]]).all()) for mine, theirs in zip(own, want))
        freed = sorted(prefill.call("freed", ["p-short", "p-str", "p-ok"])["freed"])
        with decode._lock:
            pending = sorted(decode._pending)
    finally:
        decode.close()
        prefill.close()
    lease_warnings = [r.getMessage() for r in records if "kv_lease_duration" in r.getMessage()]
    tracebacks = [r.getMessage() for r in records if r.exc_info]
    return {"received": sorted(done), "failed": sorted(failed), "load_errors": sorted(errors), "ok_exact": exact,
            "short_refused": jobs["short"].refused, "pending": pending, "freed": freed,
            "lease_warnings": lease_warnings, "tracebacks": tracebacks}


def main() -> dict[str, Any]:
    sched = _scheduler()
    try:
        pulled = pulls()
    except Exception as exc:  # reported, so that the other checks still are
        pulled = {"error": f"{type(exc).__name__}: {exc}"}
    return {"params": {name: params_case(sched, name, over) for name, over in CASES.items()}, "pulls": pulled}


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    print(json.dumps(main()))
