"""``python -m datadist.bench --workload kv-7b``: the shape of the workload, its rows, and a
shortened run over both process-to-process transports (few requests and layers)."""
from __future__ import annotations

import json
from typing import List

import pytest
from bench_cli import run_bench

from datadist.bench import core as bench, shapes
from datadist.bench.record import FIELDS

pytestmark = pytest.mark.timeout(60)


def test_kv_7b_is_a_7b_models_cache_pushed_by_8_requests() -> None:
    w = bench.sized("kv-7b")
    assert (w.layers, w.num_tensors, w.requests, w.blocks, w.cache_blocks) == (32, 64, 8, 16, 128)
    assert w.block_bytes == 16 * 32 * 128 * 2  # 16 tokens x 32 heads x 128 dims x fp16
    assert w.block_bytes * w.blocks * 2 == 4 << 20  # one layer call: K and V, 16 blocks each
    assert w.batch_bytes == 1 << 30 and w.block_bytes * w.cache_blocks * w.num_tensors == 1 << 30
    src, dst = shapes.blocks(w)
    assert src == list(range(128)) and sorted(dst) == list(range(128)) and dst != src
    assert shapes.pool_bytes(w) >= 1 << 30


def test_sizes_are_checked() -> None:
    assert bench.sized("kv-7b", rounds=2, requests=3, layers=4).batch_bytes == 3 * 4 * (4 << 20)
    with pytest.raises(ValueError, match="do not fit"):
        bench.sized("kv-7b", requests=9)
    with pytest.raises(ValueError, match="layer-wise"):
        bench.sized("small-4k", requests=2)


def test_a_failing_request_fails_the_round_with_its_own_error() -> None:
    calls: List[range] = []

    def push(layer: range) -> None:
        calls.append(layer)

    def broken(layer: range) -> None:
        raise KeyError("lost")

    with pytest.raises(KeyError, match="lost"):
        bench._layerwise_round([push, broken, push], 3)
    wall, times = bench._layerwise_round([push, push], 3)
    assert wall > 0 and len(times) == 6 and calls[-6:].count(range(2, 3)) == 2


@pytest.mark.timeout(90)
def test_a_shortened_kv_7b_run_reports_verified_rows_of_the_one_schema() -> None:
    proc = run_bench("--workload", "kv-7b", "--transport", "shm", "--transport", "tcp", "--requests", "2", "--layers",
                "2", "--rounds", "2", "--json", timeout=80)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["system"] for r in rows] == ["datadist-shm", "datadist-tcp"]
    for row in rows:
        assert list(row)[:len(FIELDS)] == list(FIELDS)
        assert row["workload"] == "kv-7b" and row["verified"] is True and row["scatter"] is True
        assert (row["block_kib"], row["blocks"], row["requests"], row["layers"]) == (128, 16, 2, 2)
        assert (row["calls"], row["rounds"], row["call_mib"]) == (4, 2, 4.0)
        assert 0 < row["p50_us"] <= row["p99_us"]
        batch_bytes = 2 * 2 * (4 << 20)
        assert abs(row["gbps"] - batch_bytes / row["batch_ms"] / 1e6) <= 0.01 * row["gbps"] + 0.002


@pytest.mark.parametrize("flags, named", [
    (["--workload", "kv-7b", "--requests", "9"], "--requests 9"),
    (["--workload", "small-4k", "--layers", "2"], "--layers"),
    (["--workload", "kv-7b", "--rounds", "0"], "--rounds"),
])
def test_bad_sizes_are_one_line(flags: List[str], named: str) -> None:
    proc = run_bench(*flags, "--transport", "shm")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert named in proc.stderr.strip().splitlines()[-1], proc.stderr
