"""``python -m datadist.bench --workload fan-in``: its shape, the check of the bytes the
decoders pulled, and a shortened run (few decoders and rounds, with and without a hog)."""
from __future__ import annotations

import json
import subprocess
import sys
from typing import List

import pytest
import torch
from bench_cli import run_bench

from datadist.bench import fanin, shapes
from datadist.bench.hog import Hog
from datadist.bench.record import FIELDS

pytestmark = pytest.mark.timeout(60)


def test_fan_in_is_8_decoders_pulling_16_blocks_of_4_tensors_of_2_kib() -> None:
    w = shapes.sized("fan-in")
    assert (w.decoders, w.blocks, w.num_tensors, w.block_bytes) == (8, 16, 4, 2 << 10)
    assert w.blocks * w.num_tensors * w.block_bytes == 128 << 10
    lists = fanin.pulls(w, 3)
    assert len(lists) == fanin.WARMUP + w.rounds
    assert all(len(set(b)) == w.blocks and 0 <= min(b) and max(b) < w.cache_blocks for b in lists)
    assert lists == fanin.pulls(w, 3) and lists != fanin.pulls(w, 4)
    assert shapes.sized("fan-in", rounds=3, decoders=2).decoders == 2
    with pytest.raises(ValueError, match="fan-in"):
        shapes.sized("small-4k", decoders=2)


def test_the_check_counts_every_wrong_byte_of_the_pulled_blocks() -> None:
    shape = (32, 1024)
    base = shapes.source_base(shape)
    tensors = [(base ^ k).view(torch.float16).clone() for k in range(3)]
    assert fanin.wrong_bytes(tensors, [0, 5, 31]) == 0
    tensors[2].view(torch.int16)[5, 7] ^= 0x0101  # two bytes of one element
    tensors[1].view(torch.uint8)[31, 0] ^= 1
    tensors[0].view(torch.int16)[6, 0] ^= 1       # a block that was not pulled
    assert fanin.wrong_bytes(tensors, [0, 5, 31]) == 3


def test_a_hog_runs_busy_processes_only_inside_its_block() -> None:
    with Hog(2) as hog:
        procs = list(hog._processes)
        assert len(procs) == 2 and all(p.is_alive() for p in procs)
    assert all(not p.is_alive() for p in procs)
    with pytest.raises(ValueError, match="-1"):
        Hog(-1)


@pytest.mark.timeout(60)
def test_hogs_run_at_the_default_niceness_whatever_the_bench_runs_at() -> None:
    code = ("import os; from datadist.bench.hog import Hog, set_nice; set_nice(3)\n"
            "with Hog(1) as hog:\n"
            "    stat = open(f'/proc/{hog._processes[0].pid}/stat').read()\n"
            "    print(os.getpriority(os.PRIO_PROCESS, 0), stat.rsplit(')', 1)[1].split()[16])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "0"]


@pytest.mark.timeout(150)
def test_a_shortened_fan_in_reports_verified_rows_of_the_one_schema() -> None:
    proc = run_bench("--workload", "fan-in", "--transport", "shm", "--transport", "tcp", "--transport", "local",
                "--decoders", "2", "--rounds", "30", "--hog", "1", "--nice", "2", "--json", timeout=140)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["system"] for r in rows] == ["datadist-shm", "datadist-tcp"]  # no fan-in within one process
    for row in rows:
        assert list(row)[:len(FIELDS)] == list(FIELDS)
        assert row["workload"] == "fan-in" and row["verified"] is True and (row["hog"], row["nice"]) == (1, 2)
        assert (row["block_kib"], row["blocks"], row["decoders"], row["rounds"], row["calls"]) == (2, 16, 2, 30, 60)
        assert row["call_kib"] == 128 and row["checked_blocks"] > 16
        assert 0 < row["p50_us"] <= row["p99_us"]
        assert abs(row["gbps"] - 60 * (128 << 10) / (row["batch_ms"] * 30) / 1e6) <= 0.01 * row["gbps"] + 0.002


@pytest.mark.parametrize("flags, named", [
    (["--workload", "small-4k", "--decoders", "2"], "--decoders"),
    (["--workload", "fan-in", "--hog", "x"], "--hog"),
    (["--workload", "small-4k", "--nice", "20"], "--nice"),
])
def test_bad_flags_are_one_line(flags: List[str], named: str) -> None:
    proc = run_bench(*flags, "--transport", "shm")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert named in proc.stderr.strip().splitlines()[-1], proc.stderr
