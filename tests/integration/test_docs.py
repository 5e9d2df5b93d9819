"""The docs show what the code does: every fenced block of README.md and docs/ says what it
is, and the ones a CPU machine runs within a minute are run here.

A fence's info string is ``LANG MARK``: ``run`` (a bash or python block this test runs: it
must exit 0), ``output`` (the text a ``run`` block just above prints: each non-empty line
must appear in that output, ``...`` standing for any text), ``fragment`` (a signature, an
excerpt or a file format: not a program) or ``not-run: WHY`` (installs packages, needs a
GPU, other hosts or vLLM, takes minutes, or acts on this node's shared daemon).  Python
blocks run in a fresh directory; bash blocks in the repository's root.  ``EMS_SERVER``
points at a daemon of this test's own, so nothing touches the node's ``/dev/shm/ems``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKS = ("run", "output", "fragment", "not-run")
RUN_TIMEOUT_S = 120


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    mark: str
    reason: str
    body: str
    output: Optional["Block"] = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> List[Block]:
    lines = path.read_text().split("\n")
    found: List[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        mark, _, reason = m.group(2).partition(":")
        found.append(Block(path, i + 1, m.group(1), mark.strip(), reason.strip(), "\n".join(lines[i + 1:end])))
        i = end + 1
    for prev, block in zip(found, found[1:]):
        if block.mark == "output" and prev.mark == "run":
            prev.output = block
    return found


ALL = [b for path in DOCS for b in _blocks(path)]
RUNNABLE = [pytest.param(b, id=b.where) for b in ALL if b.mark == "run"]


def test_every_block_says_what_it_is() -> None:
    bad = [f"{b.where}: ```{b.lang} {b.mark}" for b in ALL
           if b.mark not in MARKS or (b.mark == "not-run" and not b.reason) or not b.lang]
    assert not bad, "fences need 'LANG run|output|fragment|not-run: why':\n" + "\n".join(bad)
    orphans = [b.where for b in ALL if b.mark == "output" and not any(r.output is b for r in ALL)]
    assert not orphans, f"output blocks without a run block right above: {orphans}"
    assert not [b.where for b in ALL if b.mark == "run" and b.lang not in ("bash", "python")]


def _matches(expected: str, actual: str) -> List[str]:
    """Lines of ``expected`` that do not appear in ``actual`` (``...``: any text)."""
    missing = []
    for line in (x.strip() for x in expected.split("\n")):
        if line and not re.search(".*".join(map(re.escape, line.split("..."))), actual):
            missing.append(line)
    return missing


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("block", RUNNABLE)
def test_runnable_block(block: Block, tmp_path: Path, ems_pool_dir: str) -> None:
    env = {**os.environ, "EMS_SERVER": ems_pool_dir,
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.body)
        cmd, cwd = [sys.executable, str(script)], tmp_path
    else:
        cmd, cwd = ["bash", "-e", "-c", block.body], ROOT
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    shown = done.stdout + done.stderr
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{shown[-4000:]}"
    if block.output is not None:
        missing = _matches(block.output.body, shown)
        assert not missing, f"{block.output.where}: not printed by {block.where}: {missing}\n--- output\n{shown[-4000:]}"
