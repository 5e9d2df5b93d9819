"""Which Python runs vLLM for the vLLM tests.

vLLM pins its own versions of many packages, so it lives in a virtual environment of its
own over this one's site-packages (``.ci/vllm-env`` makes ``.venv-vllm``); the tests run
vLLM with that environment's Python (or ``$DATADIST_VLLM_PYTHON``) and skip when there is
none.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typing import Any, Dict

import pytest

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> str:
    """A Python that imports vllm and this tree's datadist; skips the test when there is none."""
    for candidate in (os.environ.get("DATADIST_VLLM_PYTHON"), str(ROOT / ".venv-vllm" / "bin" / "python"),
                      sys.executable):
        if candidate and Path(candidate).exists():
            probe = subprocess.run([candidate, "-c", "import vllm, datadist"], capture_output=True, timeout=120)
            if probe.returncode == 0:
                return candidate
    pytest.skip("no Python with vllm installed (run .ci/vllm-env, or set DATADIST_VLLM_PYTHON)")


def run_vllm_script(name: str, timeout: float) -> Dict[str, Any]:
    """Run ``tests/integration/<name>`` with :func:`vllm_python` (this tree and the tests on
    its path) and return the JSON object its last line prints, asserting it exited 0."""
    python = vllm_python()
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(here)])}
    done = subprocess.run([python, str(here / name)], env=env, capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    result: Dict[str, Any] = json.loads(lines[-1])
    return result
