"""The bounded memories of the fast paths (datadist.engine.memo)."""
from __future__ import annotations

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
