"""Which Python runs vLLM for the vLLM tests.

vLLM pins its own versions of many packages, so it lives in a virtual environment of its
own over this one's site-packages (``.ci/vllm-env`` makes ``.venv-vllm``); the tests run
vLLM with that environment's Python (or ``$DATADIST_VLLM_PYTHON``) and skip when there is
none.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
