"""The head mapping of unequal tensor parallelism (datadist.integrations.vllm.heads), the
chunk pairs it pulls (blocks.split_pairs) and the bounds on a peer's count of readers:
pure logic, no vLLM."""
from __future__ import annotations

import json

import numpy as np
import pytest

from datadist.engine.layout import plan_units
from datadist.integrations.vllm.blocks import split_pairs
from datadist.integrations.vllm.heads import Read, readers, sources, tp_plan
from datadist.integrations.vllm.notes import MAX_READERS, parse_readers, pulled_note


def test_equal_tp_reads_its_own_rank_whole() -> None:
    plan = tp_plan(2, 2, 1, 4)
    assert plan.reads == (Read(1, 0, 0, 4),) and not plan.split
    assert readers(2, 2) == 1


@pytest.mark.parametrize("prefill, decode, rank, runs, want, src_runs", [
    (2, 1, 0, 8, [Read(0, 0, 0, 4), Read(1, 0, 4, 4)], 4),            # heads joined
    (4, 2, 1, 4, [Read(2, 0, 0, 2), Read(3, 0, 2, 2)], 2),
    (1, 2, 0, 4, [Read(0, 0, 0, 4)], 8),                              # heads split
    (1, 2, 1, 4, [Read(0, 4, 0, 4)], 8),
    (2, 4, 3, 2, [Read(1, 2, 0, 2)], 4),
])
def test_unequal_tp_maps_head_ranges(prefill: int, decode: int, rank: int, runs: int, want: list[Read],
                                     src_runs: int) -> None:
    plan = tp_plan(prefill, decode, rank, runs)
    assert list(plan.reads) == want and plan.src_runs == src_runs and plan.split
    assert [r.source for r in plan.reads] == sources(prefill, decode, rank)


def test_every_decode_run_is_filled_once() -> None:
    """Over the decode ranks, every run of every prefill rank is read once (P < D), and each
    decode rank's runs are each written once (P > D)."""
    read = [(r.source, r.src_first + o) for d in range(4) for r in tp_plan(2, 4, d, 2).reads for o in range(r.count)]
    assert sorted(read) == [(p, o) for p in range(2) for o in range(4)]
    written = [r.dst_first + o for r in tp_plan(4, 1, 0, 8).reads for o in range(r.count)]
    assert sorted(written) == list(range(8))


def test_readers_count_the_decode_ranks_of_one_prefill_rank() -> None:
    assert readers(1, 2) == 2 and readers(2, 8) == 4 and readers(2, 1) == 1 and readers(4, 4) == 1


def test_mla_reads_whole_blocks_of_one_rank_and_tells_the_rest() -> None:
    plan = tp_plan(4, 2, 1, 0, mla=True)
    assert plan.reads == (Read(2, 0, 0, 0),) and not plan.split and sources(4, 2, 1) == [2, 3]
    assert tp_plan(1, 2, 1, 0, mla=True).reads == (Read(0, 0, 0, 0),)


@pytest.mark.parametrize("args, kwargs, words", [
    ((2, 1, 0, 0), {"kind": "FLASH_ATTN:"}, "FLASH_ATTN:"),         # a layout that is not split
    ((3, 2, 0, 4), {}, "one divides the other"),
    ((4, 1, 0, 2), {}, "do not split over 4"),                       # 1 head on our side for 4 ranks
    ((1, 4, 0, 2), {"total_kv_heads": 2}, "replicated"),
])
def test_unmappable_heads_are_refused(args: tuple, kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        tp_plan(*args, **kwargs)


@pytest.mark.parametrize("remote, local, runs, src_runs, src_first, dst_first, count", [
    ([3, 4, 6], [1, 2, 3], 8, 4, 0, 4, 4),   # TP 2 -> 1, second rank
    ([5, 2], [0, 7], 4, 8, 4, 0, 4),         # TP 1 -> 2, second rank
])
def test_a_head_range_is_one_copy_per_block(remote: list[int], local: list[int], runs: int, src_runs: int,
                                            src_first: int, dst_first: int, count: int) -> None:
    """Blocks of the same size: each block's head range is neighbouring chunks on both
    sides, which the transports' plans merge into one copy per block."""
    src, dst = split_pairs(remote, local, 1, runs, src_runs, src_first, dst_first, count)
    np.testing.assert_array_equal(src.reshape(len(remote), count)[:, 0], np.asarray(remote) * src_runs + src_first)
    np.testing.assert_array_equal(dst.reshape(len(local), count)[:, 0], np.asarray(local) * runs + dst_first)
    chunk = 64
    plan = plan_units([0], src * chunk, [1 << 30], dst * chunk, chunk)
    assert plan.nruns == len(remote) and plan.nbytes == len(remote) * count * chunk


def test_head_range_with_smaller_prefill_blocks() -> None:
    """Decode blocks of 2 prefill blocks, TP 1 -> 2, second rank (2 heads of 4): prefill
    run ``4 + o`` of block ``j`` goes to part ``j % 2`` of run ``o`` of decode block ``j // 2``."""
    src, dst = split_pairs([1, 2, 3], [5, 6], 2, 4, 8, 4, 0, 4)
    assert src.tolist() == [12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]
    assert dst.tolist() == [40, 42, 44, 46, 41, 43, 45, 47, 48, 50, 52, 54]


def test_equal_split_pairs_are_unchanged() -> None:
    """With the defaults, every run of the same count per block (unequal block sizes only)."""
    src, dst = split_pairs([1, 2], [3], 2, 2)
    assert src.tolist() == [2, 3, 4, 5] and dst.tolist() == [12, 14, 13, 15]


@pytest.mark.parametrize("text, count", [
    (pulled_note(["a"], 2), 2),
    (json.dumps({"pulled": ["a"]}), 1),           # a notice without the count: one reader
    (json.dumps({"pulled": ["a"], "readers": MAX_READERS}), MAX_READERS),
    (json.dumps({"pulled": ["a"], "readers": MAX_READERS + 1}), 0),
    (json.dumps({"pulled": ["a"], "readers": 0}), 0),
    (json.dumps({"pulled": ["a"], "readers": -3}), 0),
    (json.dumps({"pulled": ["a"], "readers": True}), 0),
    (json.dumps({"pulled": ["a"], "readers": "2"}), 0),
    (json.dumps({"pulled": ["a"], "readers": 2.0}), 0),
    ("[1, 2]", 0),
    ("not json", 0),
])
def test_a_peers_count_of_readers_is_bounded(text: str, count: int) -> None:
    assert parse_readers(text) == count
