"""DatadistConnector against malformed or inconsistent ``kv_transfer_params`` (they come
from a client or a proxy): vLLM's scheduler never sees an exception, a request whose
parameters are unusable computes its prompt locally, a load that cannot fill every block
vLLM counted as loaded fails with load errors instead of leaving blocks unwritten, and a
pull that meets any exception is still reported.  Driven by ``vllm_connector_inputs.py``
with the Python of ``vllm_env`` (skipped without one); one run serves every test here."""
from __future__ import annotations

from typing import Any, Dict

import pytest
from vllm_env import run_vllm_script

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MALFORMED = ("string_block_ids", "scalar_block_ids", "bool_block_ids", "negative_block_id", "cluster_id_not_int",
             "no_clusters", "port_not_int", "port_too_large", "hosts_shorter_than_clusters", "request_id_not_str")


@pytest.fixture(scope="module")
def report() -> Dict[str, Any]:
    return run_vllm_script("vllm_connector_inputs.py", 280)


def test_sound_params_pull_the_prompt_and_a_longer_list_is_trimmed_at_the_front(report: Dict[str, Any]) -> None:
    params = report["params"]
    assert params["sound"] == {"matched": [64, True], "job": {"local": [10, 11, 12, 13], "remote": [0, 1, 2, 3],
                                                              "refused": "", "awaited": True}}
    # Both lists end with the prompt's last block: the extra leading remote blocks are skipped.
    assert params["longer_remote"]["job"]["remote"] == [0, 1, 2, 3], params
    assert params["half_size_blocks"]["job"]["remote"] == [2, 3, 4, 5, 6, 7, 8, 9], params
    assert params["half_size_blocks"]["job"]["refused"] == "", params


@pytest.mark.parametrize("case", ["short_remote", "empty_remote", "half_size_blocks_short"])
def test_too_few_remote_blocks_refuse_the_load(report: Dict[str, Any], case: str) -> None:
    """vLLM counted the whole prompt as external tokens: fewer remote blocks than local
    ones are refused with every local block kept (the worker reports them all as load
    errors), never mapped onto the first local blocks with the rest left unwritten."""
    got = report["params"][case]
    assert "raised" not in got, got
    job = got["job"]
    assert job["local"] == [10, 11, 12, 13] and job["awaited"] is True, got
    assert "prefill blocks" in job["refused"], got


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_params_compute_the_prompt_locally(report: Dict[str, Any], case: str) -> None:
    """No exception reaches vLLM's scheduler (it would end the engine), no external
    tokens are counted and no pull is planned."""
    assert report["params"][case] == {"matched": [0, False], "job": None}, report["params"][case]


def test_every_pull_is_reported_whatever_fails(report: Dict[str, Any]) -> None:
    """A refused pull and one whose pull thread meets an unexpected exception (TypeError)
    are reported failed with their blocks as load errors, leave no lease renewed, and
    free the prefill side's blocks; the sound pull beside them arrives exact."""
    r = report["pulls"]
    assert r["received"] == ["ok", "short", "str"], r
    assert r["failed"] == ["short", "str"], r
    assert r["load_errors"] == [1, 2, 3, 10, 11, 12, 13], r
    assert r["ok_exact"] is True, r
    assert r["pending"] == [], r
    assert r["freed"] == ["p-ok", "p-short", "p-str"], r
    assert any(t.startswith("request str: pulling 3 blocks") for t in r["tracebacks"]), r


def test_a_lease_no_longer_than_a_pull_is_warned_about_once(report: Dict[str, Any]) -> None:
    """A 2 s prefill lease against a 3 s pull timeout: one warning over two steps."""
    warnings = report["pulls"]["lease_warnings"]
    assert len(warnings) == 1, warnings
    assert "kv_lease_duration" in warnings[0] and "sync_kv_timeout_ms=3000" in warnings[0], warnings
