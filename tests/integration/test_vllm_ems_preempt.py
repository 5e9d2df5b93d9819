"""EmsConnector and vLLM's preemption: vLLM frees a preempted request's blocks at once and
the next forward may write them for another request, so a save of them still running
must not copy them afterwards (the pool would hold another request's bytes under this
prompt's keys, for every instance that shares the pool).  Driven by
``vllm_ems_preempt.py`` with the Python of ``vllm_env`` (skipped without one) over a
private pool."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict

import pytest
from vllm_env import ROOT, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def report() -> Dict[str, Any]:
    python = vllm_python()
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(here),
                                                        str(ROOT / "samples")])}
    done = subprocess.run([python, str(here / "vllm_ems_preempt.py")], env=env, capture_output=True, text=True,
                          timeout=280)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    result: Dict[str, Any] = json.loads(lines[-1])
    return result


def test_the_pool_keeps_the_preempted_requests_own_bytes(report: Dict[str, Any]) -> None:
    """The forward after the preemption waits (handle_preemptions) until the save of the
    preempted request's blocks has copied them; a later load of its keys gets its KV,
    not the bytes written into its freed blocks for the next request."""
    assert report["forward_waited"] is True, report
    assert report["runner_done"] is True, report
    assert report["loaded"] is True and report["load_errors"] == [], report
    assert report["values_under_a_keys"] == [1.0], report


def test_the_scheduler_half_forgets_a_preempted_requests_blocks(report: Dict[str, Any]) -> None:
    """The metadata names the preempted request for the workers, and the scheduler half
    drops its freed block ids (the request gets blocks anew when it resumes)."""
    assert report["preempted"] == ["A"], report
    assert report["a_blocks_after_preemption"] == [], report


