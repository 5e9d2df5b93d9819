"""``python -m datadist.bench --hosts RATE``: a workload between two namespace hosts whose
links are shaped to RATE, next to one raw TCP stream, with the bytes verified; no transfer
beats the shaped link, and the run leaves no namespace behind."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from datadist.bench.netns import PREFIX, leftovers
from ems_helpers import ENV

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datadist.bench", *args], capture_output=True, text=True,
                          timeout=150, env=ENV)


def test_hosts_row_is_verified_and_within_the_link(netns_ok: None) -> None:
    before = set(leftovers())
    done = _bench("--hosts", "1gbit", "--workload", "scatter-32k", "--rounds", "2", "--json")
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["verified"] and row["transport"] == "tcp" and row["line_gbit"] == 1.0, row
    # tbf holds both to the rate (a short burst aside); a transfer faster than the link
    # would mean the hosts were not shaped, or not used
    assert 0.2 < row["line_share"] <= 1.05, f"scatter-32k through a 1 Gbit/s link: {row}"
    assert 0.2 < row["raw_tcp_share"] <= 1.05, f"one TCP stream through a 1 Gbit/s link: {row}"
    assert row["bound_ms"] <= row["batch_ms"] * 1.05, row
    assert set(leftovers()) <= before, f"the bench left {sorted(set(leftovers()) - before)} (prefix {PREFIX})"


def test_bad_rate_and_transport_are_refused() -> None:
    done = _bench("--hosts", "1gb", "--workload", "scatter-32k")
    assert done.returncode == 2 and "'1gb'" in done.stderr, done.stderr
    done = _bench("--hosts", "1gbit", "--transport", "shm", "--workload", "scatter-32k")
    assert done.returncode == 2 and "tcp only" in done.stderr, done.stderr
