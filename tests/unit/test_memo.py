"""The bounded memories of the fast paths (datadist.engine.memo)."""
from __future__ import annotations

from typing import Any

from datadist.engine.memo import Weighed, remember


def test_remember_drops_the_oldest_entry_when_full() -> None:
    memory: dict[str, int] = {}
    for i, key in enumerate("abcd"):
        remember(memory, key, i, 3)
    assert memory == {"b": 1, "c": 2, "d": 3}
    remember(memory, "c", 9, 3)  # a known key replaces its value, dropping nothing
    assert memory == {"b": 1, "c": 9, "d": 3}


def test_weighed_keeps_within_its_count_and_its_budget() -> None:
    memo: Weighed[str, str] = Weighed(limit=3, budget=100)
    memo.put("a", "A", 40)
    memo.put("b", "B", 40)
    assert memo.get("a") == "A" and len(memo) == 2
    memo.put("c", "C", 40)  # 120 > 100: the oldest goes
    assert memo.get("a") is None and memo.get("b") == "B" and memo.get("c") == "C"
    memo.put("d", "D", 1)
    memo.put("e", "E", 1)  # 4 entries > limit 3: the oldest goes
    assert [k for k in "bcde" if memo.get(k)] == ["c", "d", "e"]
    memo.put("c", "C2", 90)  # replacing an entry counts its new weight only
    assert memo.get("c") == "C2" and memo.get("d") == "D" and memo.get("e") == "E"
    memo.put("huge", "H", 101)  # heavier than the whole budget: not kept, nothing dropped
    assert memo.get("huge") is None and len(memo) == 3
    memo.clear()
    assert len(memo) == 0 and memo.get("c") is None


def test_ref_keys_match_exactly_the_same_int_objects() -> None:
    from datadist.engine import native

    a, b = [1000 + i for i in range(300)], [5000 + i for i in range(300)]
    pinned = native.ref_key(a, b, 1 << 16).pinned()
    assert pinned is not None
    memory = {pinned: "plan"}
    assert memory.get(native.ref_key(list(a), tuple(b), 1 << 16)) == "plan"  # other lists, same ints
    assert memory.get(native.ref_key(b, a, 1 << 16)) is None  # the two lists swapped
    changed = list(b)
    changed[7] = 9999  # an entry the hash may not sample: equality still compares all
    assert memory.get(native.ref_key(a, changed, 1 << 16)) is None
    equal_values = [int(str(x)) for x in a]  # equal values, other int objects: not this key's
    assert memory.get(native.ref_key(equal_values, b, 1 << 16)) is None
    assert native.ref_key(a, b, 599) is None and native.ref_key(range(3), b, 1 << 16) is None
    assert native.ref_key([1.5], [1], 8).pinned() is None  # only exact ints are pinned
    assert native.ref_key([True], [1], 8).pinned() is None


def test_a_pinned_ref_key_keeps_its_entries_alive() -> None:
    import sys

    from datadist.engine import native

    entry = 10 ** 6 + 1
    before = sys.getrefcount(entry)
    pinned = native.ref_key([entry], [entry], 8).pinned()
    assert sys.getrefcount(entry) == before + 2
    del pinned
    assert sys.getrefcount(entry) == before


def test_plan_memory_finds_a_plan_by_the_lists_identity_or_their_values() -> None:
    from datadist.engine.prepared import PlanMemory

    memory = PlanMemory()
    src, dst = [1000 + i for i in range(64)], [3000 + i for i in range(64)]
    hit, keys = memory.find(src, dst)
    assert hit is None and keys is not None
    plan: Any = object()
    memory.keep(keys, plan, src, dst)
    assert memory.find(list(src), list(dst)) == (plan, None)  # the same int objects
    assert memory.find([int(str(x)) for x in src], [int(str(x)) for x in dst]) == (plan, None)  # equal values
    assert memory.find(src, dst[:-1])[0] is None
    assert memory.find(range(1000, 1064), dst)[0] is None  # a range is its own key
    memory.clear()
    assert memory.find(src, dst)[0] is None


def test_plan_memory_keeps_few_plans_of_lists_that_never_repeat_until_one_does() -> None:
    from datadist.engine.prepared import SPARSE_AFTER, SPARSE_KEEP, PlanMemory

    memory = PlanMemory()
    kept = []
    for i in range(SPARSE_AFTER + 4 * SPARSE_KEEP):  # every list new: each lookup misses
        src, dst = [i, i + 1], [7, 8]
        hit, keys = memory.find(src, dst)
        assert hit is None
        plan: Any = ("plan", i)
        memory.keep(keys, plan, src, dst)
        if memory.find([i, i + 1], [7, 8])[0] is plan:
            kept.append(i)
    # all of the first SPARSE_AFTER were kept (each found again at once, which resets the
    # count); then still all: every keep is followed by a hit here.
    assert len(kept) == SPARSE_AFTER + 4 * SPARSE_KEEP

    memory = PlanMemory()
    for i in range(SPARSE_AFTER + 4 * SPARSE_KEEP):  # misses only, no lookup finds anything
        hit, keys = memory.find([i, i + 1], [7, 8])
        memory.keep(keys, ("plan", i), [i, i + 1], [7, 8])
    found = [i for i in range(SPARSE_AFTER + 1, SPARSE_AFTER + 4 * SPARSE_KEEP)
             if memory.find([i, i + 1], [7, 8])[0] == ("plan", i)]
    assert found and len(found) <= 4  # past SPARSE_AFTER misses only every SPARSE_KEEP-th is kept
    repeated = found[-1]
    assert memory.find([repeated, repeated + 1], [7, 8])[0] == ("plan", repeated)
    src, dst = [10 ** 6, 1], [2, 3]  # after that hit every new plan is kept again
    memory.keep(memory.find(src, dst)[1], "again", src, dst)
    assert memory.find(src, dst)[0] == "again"


def test_coalesce_merges_exactly_the_runs_that_continue_each_other() -> None:
    import numpy as np

    from datadist.engine.layout import coalesce

    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(0, 40))
        lens = rng.integers(0, 3, n).astype(np.uint64) * 8
        src = np.cumsum(rng.integers(0, 2, n) * 8 + lens).astype(np.uint64) - lens
        dst = np.cumsum(rng.integers(0, 2, n) * 8 + lens).astype(np.uint64) - lens
        expect: list[list[int]] = []
        for s, d, length in zip(src.tolist(), dst.tolist(), lens.tolist()):
            if not length:
                continue
            if expect and expect[-1][0] + expect[-1][2] == s and expect[-1][1] + expect[-1][2] == d:
                expect[-1][2] += length
            else:
                expect.append([s, d, length])
        got = coalesce(src, dst, lens)
        assert [list(r) for r in zip(got.src_offs.tolist(), got.dst_offs.tolist(), got.lens.tolist())] == expect
