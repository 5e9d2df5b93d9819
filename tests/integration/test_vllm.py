"""The vLLM connectors in real vLLM (CPU build) through the offline ``LLM`` API, each
instance in processes of its own, with the Python of ``vllm_env`` (skipped without one).
Each test reads the JSON line its script prints.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import List

import pytest
from vllm_env import ROOT, vllm_python

SAMPLES = ROOT / "samples"


pytestmark = pytest.mark.vllm


def _run(args: List[str], timeout_s: int) -> dict:
    """Run a script with vLLM's Python; its last output line is JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SAMPLES), str(Path(__file__).parent)]),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([vllm_python(), *args], cwd=SAMPLES, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, \
        f"{args[0]} exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-8000:]}"
    return json.loads(next(line for line in reversed(lines) if line.startswith("{")))


@pytest.mark.timeout(900)
def test_pd_tokens_match_a_plain_instance() -> None:
    """Prefill and decode instances with DatadistConnector produce the plain instance's
    greedy tokens for prompts from 5 to 417 tokens; vLLM counts the decode instance's
    prompt tokens as loaded by KV transfer (all of them: the prefill instance computed
    each prompt whole); the prefill instance holds the prompts' blocks until the decode
    instance has pulled them, and frees them then."""
    report = _run(["vllm_pd.py", "--json", "--ttft-tokens", "1024"], 880)
    assert report["match"] == [True] * len(report["prompts"]), report
    assert report["external_kv_transfer_tokens"] == report["prompt_tokens"], report
    assert report["prefill_kv_usage_held"] > 0 and report["prefill_kv_usage_after_pull"] == 0, report
    assert min(report["prompts"]) < 32 < max(report["prompts"]) // 8, report  # a partial block and many blocks


@pytest.mark.timeout(600)
def test_dead_prefill_fails_only_its_request() -> None:
    """The prefill instance is killed after it answered: the decode instance fails that
    request (vLLM's finish reason ``error``) within its link timeout and serves the
    request batched with it, and the next one, with the same tokens as before; later
    requests (the failed prompt among them, the decode instance's prefix cache on) get the
    tokens the prefill instance computed for them."""
    report = _run([str(Path(__file__).parent / "vllm_scenarios.py"), "prefill_dies"], 580)
    assert report["failed_finish_reason"] == "error", report
    assert report["other_finish_reason"] == "length", report
    assert report["other_tokens"] == report["before"] == report["after"], report
    assert report["seconds"] < 30, report
    assert report["later_match"] == [True] * 4, report


@pytest.mark.timeout(600)
def test_smaller_prefill_blocks_fill_larger_decode_blocks() -> None:
    """A prefill instance of block size 32 hands prompts of 5 to 417 tokens to a decode
    instance of block size 64 (two prefill blocks fill one decode block): vLLM counts
    every prompt token as loaded by KV transfer, and the decode instance's tokens are the
    ones it computed for the same prompts itself."""
    probe = subprocess.run([vllm_python(), "-c", "import torch; from vllm.v1.attention.backends.cpu_attn import "
                            "_get_attn_isa; print(_get_attn_isa(torch.bfloat16, 64, 32))"],
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-4000:]
    isa = probe.stdout.strip().splitlines()[-1]
    if isa != "vec":
        pytest.skip(f"vLLM's CPU attention uses its {isa!r} kernels here; DatadistConnector splits blocks only "
                    "for the kernels in datadist.integrations.vllm.blocks.SPLITTABLE")
    report = _run([str(Path(__file__).parent / "vllm_scenarios.py"), "block_sizes"], 580)
    count = len(report["prompts"])
    assert report["finish_reasons"] == ["length"] * count, report
    assert report["match"] == [True] * count, report
    assert report["transferred_tokens"] == sum(report["prompts"]), report


@pytest.mark.timeout(900)
def test_prefix_cache_is_shared_through_the_pool() -> None:
    """Instance A saves its prompts' blocks into a private ems pool; instance B, a fresh
    process, loads the 3 shared prefix blocks of its new prompts from the pool (vLLM
    counts them as external tokens; a prompt scheduled after another one loaded them may
    find them in B's own prefix cache instead) and produces the plain instance's tokens."""
    report = _run(["vllm_prefix_cache.py", "--json"], 880)
    assert report["match"] == [True] * len(report["wave_b"]), report
    one_prefix = report["prefix_tokens"] // len(report["wave_b"])
    assert report["external_kv_transfer_tokens"] >= one_prefix > 0, report
    assert report["external_kv_transfer_tokens"] + report["local_cache_hit_tokens"] >= report["prefix_tokens"], report
    assert report["wave_a_external_tokens"] == 0, report  # the pool started empty
