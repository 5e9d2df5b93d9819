"""DatadistConnector with prefill and decode of unequal tensor parallelism (TP 2 -> TP 1,
TP 1 -> TP 2): in vLLM's CPU layout the heads are joined or split per rank, each decode
rank's blocks holding, head by head, the keys and values of the prefill blocks; a prefill
rank read by two decode ranks frees a request's blocks after both said so (or when its
lease runs out).  In a layout that is not split (flash attention) the load is refused.
Real workers in processes of their own, driven by ``vllm_unequal_tp.py`` with the Python
of ``vllm_env`` (skipped without one); one run serves every test here."""
from __future__ import annotations

from typing import Any, Dict

import pytest
from vllm_env import run_vllm_script

pytestmark = pytest.mark.vllm

LEASE_S = 60.0  # the leases of the script's held blocks: freeing at once means well under it
#: Bytes of one prefill block of one rank's 2 heads in one layer (the script's 32 tokens,
#: head size 32, keys and values, bfloat16), and its layers.
HEADS_BLOCK_BYTES, LAYERS = 2 * 32 * 2 * 32 * 2, 2


@pytest.fixture(scope="module")
def report() -> Dict[str, Any]:
    return run_vllm_script("vllm_unequal_tp.py", 240)


def test_tp2_prefill_heads_are_joined_on_a_tp1_decode_rank(report: Dict[str, Any]) -> None:
    """Two prefill ranks of 2 KV heads each, one decode rank of 4: every pulled block holds
    the first rank's heads then the second's, each key and value row as the CPU kernels
    read it; the decode rank counts the bytes of both; neither prefill rank's lease ran out."""
    r = report["tp2_to_tp1"]
    assert r["pulled"] == {**r["pulled"], "failed": False, "exact": True}, r
    assert r["load_errors"] == [], r
    assert r["bytes"] == 3 * LAYERS * 2 * HEADS_BLOCK_BYTES, r  # 3 blocks, both ranks' heads
    assert r["expired"] == [0, 0], r


def test_tp1_prefill_heads_are_split_over_tp2_decode_ranks(report: Dict[str, Any]) -> None:
    """One prefill rank of 4 KV heads, two decode ranks of 2, blocks twice the prefill's,
    pulling one request at once on fresh links, then others one after the other: each
    decode rank's blocks hold its own 2 heads of 2 prefill blocks end to end (the
    second half of a block no prefill block fills stays zero), each counting its heads' bytes."""
    r = report["tp1_to_tp2"]
    for pulled in (*r["both"], r["first"]["d-c1"], r["first"]["d-lone"], r["second"]["d-c1"]):
        assert pulled["failed"] is False and pulled["exact"] is True, r
    assert r["bytes"] == [(3 + 3 + 2) * LAYERS * HEADS_BLOCK_BYTES, (3 + 3) * LAYERS * HEADS_BLOCK_BYTES], r


def test_a_prefill_rank_read_by_two_decode_ranks_frees_after_both(report: Dict[str, Any]) -> None:
    """The prefill rank has read the first decode rank's notice for ``c1`` and still holds
    its blocks; it frees them after the second's, not by its lease.  ``lone``, pulled by the
    first decode rank only (the second never comes), is freed when its 2 s lease runs out."""
    r = report["tp1_to_tp2"]
    assert r["held_after_first"] is True, r
    assert r["freed"] == ["c0", "c1", "lone"], r  # c0: both decode ranks pulled it at once
    assert r["expired"] == 1, r  # lone only


@pytest.mark.parametrize("case, prefill_ranks, decode_ranks", [("flash_tp2_to_tp1", 2, 1), ("flash_tp1_to_tp2", 1, 2)])
def test_unequal_tp_in_a_layout_not_split_is_refused(report: Dict[str, Any], case: str, prefill_ranks: int,
                                                     decode_ranks: int) -> None:
    """vLLM's flash-attention layout: every decode rank refuses the load, reports the
    blocks it was given as not loaded and moves no byte; every prefill rank frees the
    blocks on the decode ranks' notices (both of them, at TP 1 -> TP 2)."""
    result = report[case]
    assert len(result["decode"]) == decode_ranks
    for rank in result["decode"]:
        assert rank["failed"] is True, "the load must fail (vLLM then fails or recomputes the request)"
        assert rank["load_errors"] == [1, 2], "the blocks given for the load are reported as not loaded"
        assert rank["zeros"] is True, "no byte moved into a cache of another head count"
    assert len(result["freed_s"]) == prefill_ranks, "every prefill rank frees the blocks"
    assert max(result["freed_s"]) < LEASE_S / 4, "freed on the refusal notices, not by the lease running out"
    assert result["expired"] == [0] * prefill_ranks
