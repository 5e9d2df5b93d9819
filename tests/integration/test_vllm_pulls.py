"""DatadistConnector's decode worker against prefill peers that hang, die mid-pull, or
make it queue: real workers in processes of their own, driven by ``vllm_pulls.py``
with the Python of ``vllm_env`` (skipped without one); one run serves every test here."""
from __future__ import annotations

from typing import Any, Dict

import pytest
from vllm_env import run_vllm_script

pytestmark = pytest.mark.vllm

LEASE_S = 1.5     # the live prefill worker's lease, as in the script
TIMEOUT_S = 4.0   # the decode worker's link and transfer timeout, as in the script


@pytest.fixture(scope="module")
def report() -> Dict[str, Any]:
    result = run_vllm_script("vllm_pulls.py", 300)
    assert result["exit_codes"] == [0, 0, 0, 0], result  # live and hung prefill workers, decode workers
    return result


def test_a_hung_peer_does_not_hold_back_pulls_from_another(report: Dict[str, Any]) -> None:
    """A request from a prefill worker that stopped before the decode worker linked to it,
    and one from a live worker, at once: the live one's blocks arrive exact while the
    other still waits for its link, which fails at the link timeout (its blocks reported
    as not loaded)."""
    r = report["hung_peer"]
    assert r["live"]["failed"] is False and r["live"]["exact"] is True, r
    assert r["hung"]["failed"] is True, r
    assert r["live_s"] < r["hung_s"] and r["live_s"] < TIMEOUT_S, r
    assert r["hung_s"] >= 0.9 * TIMEOUT_S, r  # it waited for the link, as long as the link may take
    assert {1, 2} <= set(r["load_errors"]), r


def test_a_queued_pull_keeps_its_blocks_through_renewals(report: Dict[str, Any]) -> None:
    """Two requests from the hung worker take both pull threads until the link times out;
    a request from the live worker (a 1.5 s lease) waits behind them for more than two
    leases.  The decode worker renews its lease meanwhile: the live worker never expires
    it, holds its blocks until the pull, and they arrive exact."""
    r = report["queued"]
    assert all(h["failed"] for h in r["hung"]), r
    assert r["waited_s"] > 2 * LEASE_S, r
    assert r["live"]["failed"] is False and r["live"]["exact"] is True, r
    assert r["expired"] == 0, r
    assert r["held_s"] > 2 * LEASE_S, r
    assert r["renewals"] >= 2, r


def test_a_prefill_killed_mid_pull_fails_that_request_only(report: Dict[str, Any]) -> None:
    """A pull is on its way to a prefill worker, which stops before it answers (a request
    from the live worker meanwhile arrives exact), then is killed: the pull fails at once
    (the connection is reset; no timeout), its blocks are reported as not loaded (vLLM
    then fails or recomputes the request, per ``kv_load_failure_policy``), and a later
    request pulled into those same blocks arrives exact."""
    r = report["killed"]
    assert r["warm"]["exact"] is True, r
    assert r["victim_pending_then"] is True, r
    assert r["other"]["failed"] is False and r["other"]["exact"] is True, r
    assert r["victim_exit"] == -9, r
    assert r["victim"]["failed"] is True, r
    assert r["failed_after_kill_s"] < TIMEOUT_S / 2, r
    assert {12, 13, 14} <= set(r["load_errors"]), r
    assert r["later"]["failed"] is False and r["later"]["exact"] is True, r


def test_smaller_prefill_blocks_fill_a_larger_decode_block(report: Dict[str, Any]) -> None:
    """A decode worker of blocks twice the prefill worker's pulls 4 prefill blocks into 2
    of its own and 5 into 3: read as vLLM's CPU kernels read a block, each holds the keys
    and values of the prefill blocks' tokens in order (the last one's second half
    untouched)."""
    r = report["split"]
    for pulled in (r["whole"], r["part"]):
        assert pulled["failed"] is False and pulled["exact"] is True, r
