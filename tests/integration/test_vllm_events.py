"""``EmsConnector``'s KV events (``take_events``) as a KV-aware router receives them:
the scheduler half driven against a real ``ems-server`` by ``vllm_ems_events.py`` with
the Python of ``vllm_env`` (skipped without one), its events sent through vLLM's
``KVEventBatch`` msgpack encoding."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
from vllm_env import ROOT, vllm_python

sys.path.insert(0, str(ROOT / "samples"))
from _launch import private_pool  # noqa: E402  (a sample helper, not a package)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def report() -> Iterator[Dict[str, Any]]:
    python = vllm_python()
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(here)])}
    with private_pool(1 << 20) as pool:
        done = subprocess.run([python, str(here / "vllm_ems_events.py"), pool], env=env, capture_output=True,
                              text=True, timeout=240)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    yield json.loads(lines[-1])


def test_saved_blocks_are_announced_once_their_saves_are_confirmed(report: Dict[str, Any]) -> None:
    assert report["lookup_a"] == [0, False]
    assert report["before_confirm"] == [], "a save the workers have not confirmed is not announced"
    assert report["a_held"] is True
    [stored] = report["after_a"]
    assert stored["kind"] == "BlockStored"
    assert stored["block_hashes"] == report["hashes"]  # the pool's keys: three full blocks of 14 tokens
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == report["first"][:12]
    assert stored["block_size"] == 4 and stored["medium"] == "CPU"


def test_a_continuation_names_its_parent_block(report: Dict[str, Any]) -> None:
    assert report["longer_hashes"][:3] == report["hashes"]  # chained keys: same prefix, same keys
    [stored] = report["after_b"]
    assert stored["kind"] == "BlockStored"
    assert stored["block_hashes"] == report["longer_hashes"][3:]
    assert stored["parent_block_hash"] == report["hashes"][2]
    assert stored["token_ids"] == report["longer"][12:20]


def test_an_evicted_block_is_reported_removed(report: Dict[str, Any]) -> None:
    assert report["lookup_after_fill"] == [0, False]
    assert report["after_fill"] == [{"kind": "BlockRemoved", "block_hashes": [report["hashes"][0]], "medium": "CPU",
                                     "group_idx": None, "locality": None, "ownership": None}]
