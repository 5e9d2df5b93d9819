"""Every runnable sample, run as a user runs it: ``python samples/<name>.py``, small sizes.

Each sample starts its own engine processes, checks its data and exits 0 printing its
success line; a non-zero exit or a missing line fails the test with the sample's output.
A sample leaves nothing behind in its temporary directory (where the samples that use an
``ems`` pool run their own daemon) and no process that names it.  The launcher's failure
reporting (a child's traceback, a dead child, a barrier a child never reaches) is checked
in-process with children defined here.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

import pytest
from _launch import Peer, run_sample  # samples/_launch.py: samples/ is on pytest's pythonpath

SAMPLES = Path(__file__).resolve().parents[2] / "samples"

pytestmark = pytest.mark.timeout(60)

#: Seconds one sample may run: each starts two to four processes that import torch.
SAMPLE_TIMEOUT_S = 45
SMALL_MODEL = ["--layers", "2", "--hidden", "64", "--requests", "3", "--prompt-len", "40", "--gen-tokens", "6",
               "--timeout", "40"]

CASES = [
    pytest.param("pd_disaggregation.py", SMALL_MODEL + ["--progress"], "tokens match", id="pd-auto"),
    pytest.param("pd_disaggregation.py", SMALL_MODEL + ["--transport", "tcp"], "tokens match", id="pd-tcp"),
    pytest.param("push_blocks.py", [], "push_blocks: bytes match", id="push_blocks"),
    pytest.param("pull_blocks.py", [], "pull_blocks: bytes match", id="pull_blocks"),
    pytest.param("push_cache.py", [], "push_cache: bytes match", id="push_cache"),
    pytest.param("pull_cache.py", [], "pull_cache: bytes match", id="pull_cache"),
    pytest.param("pull_from_cache_to_blocks.py", [], "pull_from_cache_to_blocks: bytes match",
                 id="pull_from_cache_to_blocks"),
    pytest.param("xpyd.py", [], "xpyd: bytes match", id="xpyd"),
    pytest.param("push_by_layer.py", [], "push_by_layer: bytes match", id="push_by_layer"),
    pytest.param("pull_by_layer.py", [], "pull_by_layer: bytes match", id="pull_by_layer"),
    pytest.param("ems_quickstart.py", [], "ems_quickstart: bytes match", id="ems_quickstart"),
]


def _processes_naming(text: str) -> List[str]:
    """Command lines of the running processes that contain ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # not a process, or it exited meanwhile
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.mark.parametrize("script,args,success", CASES)
def test_sample(script: str, args: List[str], success: str) -> None:
    """The sample exits 0, prints its success line and leaves nothing behind."""
    # A short private TMPDIR: a pool daemon's unix socket path must stay under 108 bytes.
    with tempfile.TemporaryDirectory(prefix="s-") as tmp:
        proc = subprocess.run([sys.executable, str(SAMPLES / script), *args], capture_output=True, text=True,
                              timeout=SAMPLE_TIMEOUT_S, cwd=SAMPLES.parent, env={**os.environ, "TMPDIR": tmp})
        output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        assert proc.returncode == 0, f"{script} exited with {proc.returncode}\n{output}"
        assert success in proc.stdout, f"{script} did not print {success!r}\n{output}"
        assert not os.listdir(tmp), f"{script} left {os.listdir(tmp)} in its TMPDIR\n{output}"
        assert not _processes_naming(tmp), f"{script} left processes behind: {_processes_naming(tmp)}"


def test_pd_rejects_bad_flags() -> None:
    """Bad flags are refused before any process starts (exit code 2, no success line)."""
    proc = subprocess.run([sys.executable, str(SAMPLES / "pd_disaggregation.py"), "--hidden", "72"],
                          capture_output=True, text=True, timeout=SAMPLE_TIMEOUT_S)
    assert proc.returncode == 2 and "tokens match" not in proc.stdout, proc.stderr


# ---------------------------------------------------------------- launcher failures


def _raises(peer: Peer, transport: str) -> None:
    raise ValueError(f"{peer.name} fails on purpose")


def _dies(peer: Peer, transport: str) -> None:
    os._exit(7)


def _returns(peer: Peer, transport: str) -> None:
    return None


def _waits(peer: Peer, transport: str) -> None:
    peer.barrier("rendezvous")


@pytest.mark.parametrize("first,expected", [
    (_raises, "ValueError: a fails on purpose"),
    (_dies, "a died (exit code 7)"),
    (_returns, "a returned without reaching barrier 'rendezvous'"),
], ids=["raises", "dies", "skips-barrier"])
def test_child_failure_fails_the_sample(first, expected: str, capsys: pytest.CaptureFixture) -> None:
    """A child that raises, dies or skips a barrier makes the sample return 1 and say why,
    with the child's traceback when it had one; the waiting child is killed, not awaited."""
    assert run_sample("failing", "", {"a": first, "b": _waits}, argv=[]) == 1
    err = capsys.readouterr().err
    assert "failing: FAILED" in err and expected in err, err
    if first is _raises:
        assert "Traceback (most recent call last)" in err and "in _raises" in err, err
