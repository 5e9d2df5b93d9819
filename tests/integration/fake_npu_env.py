"""What the fake-NPU suites share: the environment of a child process with the fake NPU
of ``tests/fake_npu`` (on the path, so ``import torch`` autoloads it as it autoloads
torch_npu; the extension built once per run, or once for good where
``DATADIST_FAKE_NPU_BUILD`` names a directory), and running a snippet in such a child.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

FAKE_NPU = Path(__file__).resolve().parents[1] / "fake_npu"

__all__ = ["FAKE_NPU", "npu_env", "npu_peers", "run", "ok"]


@pytest.fixture(scope="session")
def npu_env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Environment of a child with the fake NPU; builds the extension once per run."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build the fake NPU")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_NPU), os.environ.get("PYTHONPATH", "")]),
           "DATADIST_FAKE_NPU_BUILD": os.environ.get("DATADIST_FAKE_NPU_BUILD") or
           str(tmp_path_factory.mktemp("fake-npu-build"))}
    built = subprocess.run([sys.executable, "-c", "import torch; torch.npu.device_count()"], env=env,
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"building the fake NPU failed:\n{built.stderr[-6000:]}"
    return env


@pytest.fixture
def npu_peers(npu_env: dict, peer_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``peer_factory`` whose children have the fake NPU (spawned children take this
    process's path and environment)."""
    monkeypatch.syspath_prepend(str(FAKE_NPU))
    monkeypatch.setenv("DATADIST_FAKE_NPU_BUILD", npu_env["DATADIST_FAKE_NPU_BUILD"])
    return peer_factory


def run(env: dict, code: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a child with environment ``env`` plus ``extra``."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**env, **extra}, capture_output=True,
                          text=True, timeout=timeout)


def ok(done: subprocess.CompletedProcess) -> str:
    """The child's stdout, asserting that it exited 0 (its output shown if not)."""
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-6000:]}"
    return done.stdout
