"""DatadistConnector with prefill and decode of unequal tensor parallelism (TP 2 -> TP 1,
TP 1 -> TP 2): the heads are not split or joined per rank yet, so the load is refused on
every decode rank, nothing is moved, and every prefill rank frees the blocks at once (well
within their lease).  Real workers in processes of their own, driven by
``vllm_unequal_tp.py`` with the Python of ``vllm_env`` (skipped without one)."""
from __future__ import annotations

from typing import Any, Dict

import pytest
from vllm_env import run_vllm_script

pytestmark = pytest.mark.vllm

LEASE_S = 60.0  # the prefill ranks' lease in the script: freeing at once means well under it


@pytest.fixture(scope="module")
def report() -> Dict[str, Any]:
    return run_vllm_script("vllm_unequal_tp.py", 240)


@pytest.mark.parametrize("case, prefill_ranks, decode_ranks", [("tp2_to_tp1", 2, 1), ("tp1_to_tp2", 1, 2)])
def test_unequal_tp_is_refused_and_frees_the_prefill_blocks(report: Dict[str, Any], case: str, prefill_ranks: int,
                                                            decode_ranks: int) -> None:
    result = report[case]
    assert result["exit_codes"] == [0] * (prefill_ranks + decode_ranks)
    assert len(result["decode"]) == decode_ranks
    for rank in result["decode"]:
        assert rank["failed"] is True, "the load must fail (vLLM then fails or recomputes the request)"
        assert rank["load_errors"] == [1, 2], "the blocks given for the load are reported as not loaded"
        assert rank["zeros"] is True, "no byte moved into a cache of another head count"
    assert len(result["freed_s"]) == prefill_ranks, "every prefill rank frees the blocks"
    assert max(result["freed_s"]) < LEASE_S / 4, "freed on the refusal notice, not by the lease running out"
