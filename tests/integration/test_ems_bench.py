"""``python -m ems.bench --clients N``: many client processes against one daemon, every
byte they loaded compared."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ems_helpers import ENV

from datadist.bench.record import FIELDS

pytestmark = pytest.mark.timeout(120)


def _run(*args: str, timeout: float = 110) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ems.bench", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def test_a_shortened_many_clients_run_reports_verified_rows() -> None:
    proc = _run("--clients", "3", "--rounds", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["workload"] for r in rows] == ["save", "exists", "load"]
    for row in rows:
        assert list(row)[:len(FIELDS)] == list(FIELDS)
        assert (row["clients"], row["rounds"], row["errors"], row["wrong_bytes"]) == (3, 5, 0, 0)
        assert row["blocks"] == 4 and row["wall_s"] > 0 and 0 < row["p50_us"] <= row["p99_us"]
    assert rows[0]["bytes"] == 4 * 2 * 2 * 16 * 2 * 128 * 2 and rows[0]["verified"] is True


def test_a_bad_client_count_is_one_line() -> None:
    proc = _run("--clients", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--clients" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_the_check_counts_every_byte_that_differs() -> None:
    import torch

    from ems.bench import _wrong_bytes

    kv = [[torch.arange(8 * 64, dtype=torch.int16).view(8, 64).view(torch.float16) for _ in range(2)]]
    for t in kv[0]:
        t[5] = t[1]
    assert _wrong_bytes(kv, [1], [5]) == 0
    kv[0][1].view(torch.int16)[5, 3] ^= 0x0101
    assert _wrong_bytes(kv, [1], [5]) == 2 and _wrong_bytes(kv, [1, 2], [5, 2]) == 2
