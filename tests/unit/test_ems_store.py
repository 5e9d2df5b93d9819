"""The daemon's store with a fake tier: two-phase puts, leases, LRU, checksums."""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest

from datadist.engine.memory import Arena, InvalidFree, PoolAllocator
from ems.pool.checksum import checksum
from ems.pool.wire import NO_SPACE, SKIPPED
from ems.server.store import PAGE, PAGE_SHIFT, Store
from ems.server.tiers.base import Sink, Tier
from ems.server.tiers.disk import DiskTier


class FakeTier(Tier):
    """A dict of values; ``corrupt`` flips a byte of what it returns."""

    name = "fake"

    def __init__(self) -> None:
        self.data: Dict[Tuple[str, str], Tuple[bytes, int]] = {}
        self.corrupt = False
        self.full = False  # refuses what it is given to store
        self.discarded: List[str] = []

    def store(self, ns: str, key: str, data: memoryview, crc: int, current=lambda: True) -> bool:
        if self.full or not current():
            return False
        self.data[(ns, key)] = (bytes(data), crc)
        return True

    def retire(self, ns: str, key: str) -> None:
        self.data.pop((ns, key), None)

    def exists(self, ns: str, keys: Sequence[str]) -> List[bool]:
        return [(ns, k) in self.data for k in keys]

    def load(self, ns: str, key: str, sink: Sink) -> Optional[int]:
        if (ns, key) not in self.data:
            return None
        raw, crc = self.data[(ns, key)]
        dest = sink(len(raw))
        if dest is None:
            return None
        dest[:] = raw
        if self.corrupt:
            dest[0] ^= 0xFF
        return crc

    def discard(self, ns: str, key: str) -> None:
        self.discarded.append(key)
        self.data.pop((ns, key), None)


def arena_bytes(ts, off, size=PAGE):
    return np.frombuffer(ts.arena.view(off, size), dtype=np.uint8)


def put(store, owner, ts, key, fill, size=PAGE):
    (off,) = store.reserve(owner, ts, [key], [size], False)
    if off < 0:
        return off
    arena_bytes(ts, off, size)[:] = fill
    assert store.commit(owner, ts, [key], [off], [checksum(ts.arena.view(off, size))]) == [True]
    return off


@pytest.fixture
def store():
    s = Store(4 * PAGE, arena_size=8 * PAGE)
    yield s
    s.close(spill=False)


def test_reserved_is_invisible_until_commit(store):
    ts, owner = store.space(""), store.new_owner()
    (off,) = store.reserve(owner, ts, ["k"], [PAGE], False)
    assert store.exists(ts, ["k"], False) == 0
    _lease, got = store.get(owner, ts, ["k"], False)
    assert got == []
    store.commit(owner, ts, ["k"], [off], [1])
    assert store.exists(ts, ["k"], False) == 1
    # commits only what this owner reserved, once
    assert store.commit(store.new_owner(), ts, ["k"], [off], [1]) == [False]


def test_skip_existing_and_leading_counts(store):
    ts, owner = store.space(""), store.new_owner()
    put(store, owner, ts, "a", 1)
    assert store.reserve(owner, ts, ["a"], [PAGE], True) == [SKIPPED]
    assert store.exists(ts, ["a", "b", "a"], False) == 1


def test_lru_eviction_skips_pinned(store):
    ts, owner = store.space(""), store.new_owner()
    for i in range(4):
        put(store, owner, ts, f"k{i}", i)
    lease, got = store.get(owner, ts, ["k0"], False)  # k0 is oldest but pinned
    assert len(got) == 1
    put(store, owner, ts, "k4", 4)
    assert store.exists(ts, ["k0"], False) == 1 and store.exists(ts, ["k1"], False) == 0
    store.release(owner, lease)
    put(store, owner, ts, "k5", 5)  # now the LRU is k2 (k0 was touched by the get)
    assert store.exists(ts, ["k2"], False) == 0 and store.exists(ts, ["k0"], False) == 1
    assert store.used <= store.capacity


def test_overwrite_while_leased_keeps_old_bytes(store):
    ts, owner = store.space(""), store.new_owner()
    off_old = put(store, owner, ts, "k", 7)
    lease, (entry,) = store.get(owner, ts, ["k"], False)
    off_new = put(store, owner, ts, "k", 9)
    assert off_new != off_old and (arena_bytes(ts, off_old) == 7).all()
    used = store.used
    store.release(owner, lease)
    assert store.used == used - PAGE  # the old value is freed when its last pin goes


def test_all_pinned_means_no_space(store):
    ts, owner = store.space(""), store.new_owner()
    for i in range(4):
        put(store, owner, ts, f"k{i}", i)
    store.get(owner, ts, [f"k{i}" for i in range(4)], False)
    assert store.reserve(owner, ts, ["x"], [PAGE], False) == [NO_SPACE]
    store.close_owner(owner)  # a closed connection releases its leases
    assert store.reserve(store.new_owner(), ts, ["x"], [PAGE], False)[0] >= 0


@pytest.fixture
def spilled():
    """A store of two pages over a disk tier after values a, b, c were put: a was spilled
    to the disk tier.  Yields ``(store, disk, tenant space, owner)``."""
    disk = FakeTier()
    s = Store(2 * PAGE, arena_size=4 * PAGE, disk=disk)
    try:
        ts, owner = s.space("t"), s.new_owner()
        put(s, owner, ts, "a", 1)
        put(s, owner, ts, "b", 2)
        put(s, owner, ts, "c", 3)  # evicts a -> disk
        yield s, disk, ts, owner
    finally:
        s.close(spill=False)


def test_spill_to_tier_and_fill_back_and_corruption(spilled):
    s, disk, ts, owner = spilled
    assert ("t", "a") in disk.data and s.counters["spills"] == 1
    assert s.exists(ts, ["a", "b", "c"], False) == 3
    lease, got = s.get(owner, ts, ["a"], False)
    assert len(got) == 1 and (arena_bytes(ts, got[0].off) == 1).all()
    s.release(owner, lease)
    disk.data[("t", "z")] = (bytes(PAGE), checksum(np.zeros(PAGE, np.uint8)))
    disk.corrupt = True
    _lease, got = s.get(owner, ts, ["z"], False)
    assert got == [] and disk.discarded == ["z"] and s.counters["corrupt"] == 1


def test_an_overwritten_value_never_comes_back_from_the_tier(spilled):
    """a (value 1) is on the tier; a new value of a is committed; when the new one is
    evicted and the tier cannot take it, a is gone: a miss, never the old value."""
    s, disk, ts, owner = spilled
    put(s, owner, ts, "a", 7)
    assert ("t", "a") not in disk.data  # the old copy is forgotten at the commit
    disk.full = True
    put(s, owner, ts, "d", 4)
    put(s, owner, ts, "e", 5)  # evicts the new a (and whatever else), none reaches the tier
    _lease, got = s.get(owner, ts, ["a"], False)
    assert got == []


def test_an_old_value_still_being_spilled_never_lands_after_a_newer_commit(tmp_path):
    """a (value 1) is being written to the disk tier (slowly) when a new value of a is
    committed, evicted and written first; the old write, ending last, must not replace it."""
    entered, release = threading.Event(), threading.Event()

    class SlowDisk(DiskTier):
        def store(self, ns, key, data, crc, current=lambda: True):
            if key == "a" and data[0] == 1:  # the old value's write: held until released
                entered.set()
                assert release.wait(10)
            return super().store(ns, key, data, crc, current)

    s = Store(2 * PAGE, arena_size=4 * PAGE, disk=SlowDisk(str(tmp_path), 64 * PAGE))
    ts, owner = s.space("t"), s.new_owner()
    put(s, owner, ts, "a", 1)
    put(s, owner, ts, "b", 2)
    spill = threading.Thread(target=put, args=(s, owner, ts, "c", 3))  # evicts a: its spill waits
    spill.start()
    try:
        assert entered.wait(5)
        put(s, owner, ts, "a", 7)  # the newer a (evicts b)
        put(s, owner, ts, "d", 4)  # evicts the newer a: written at once
    finally:
        release.set()
        spill.join(10)
    assert not spill.is_alive()
    _lease, got = s.get(owner, ts, ["a"], False)
    assert [int(arena_bytes(ts, e.off)[0]) for e in got] == [7]
    s.close(spill=False)


def test_tenants_have_separate_arenas(store):
    a, b = store.space("a"), store.space("b")
    owner = store.new_owner()
    put(store, owner, a, "k", 1)
    assert store.exists(b, ["k"], False) == 0 and a.arena.fd != b.arena.fd


def test_allocator_first_fit_and_coalescing():
    """The arena allocator as the store uses it: 4 KiB pages, offsets, None when full."""
    arena = Arena("ems-test", 10 * PAGE)
    try:
        al = PoolAllocator(arena, PAGE_SHIFT)
        offs = [al.alloc_offset(PAGE) for _ in range(10)]
        assert offs == [i * PAGE for i in range(10)] and al.alloc_offset(PAGE) is None
        for o in offs[2:5]:
            al.free_offset(o, PAGE)
        # three one-page extents merged: the only place three pages fit
        assert al.free_bytes == 3 * PAGE and al.alloc_offset(3 * PAGE) == 2 * PAGE
        al.free_offset(0, PAGE)
        with pytest.raises(InvalidFree):
            al.free_offset(0, PAGE)
        with pytest.raises(InvalidFree):  # not the size that was allocated there
            al.free_offset(2 * PAGE, PAGE)
    finally:
        arena.close()


def test_gets_are_counted_by_tier_and_pending_puts_by_reservation(spilled):
    """A get counts a hit or a miss in each tier it looks in (memory first, then the disk
    tier, named by the tier); reservations count as pending puts until committed."""
    s, _disk, ts, owner = spilled
    lease, _ = s.get(owner, ts, ["b", "a", "x"], False)  # memory hit, disk hit, miss everywhere
    s.release(owner, lease)
    counts = {k: v for k, v in s.stats().items() if k.startswith(("memory_", "fake_"))}
    assert s.tiers == ["memory", "fake"]
    assert counts == {"memory_hits": 1, "memory_hit_bytes": PAGE, "memory_misses": 2,
                      "fake_hits": 1, "fake_hit_bytes": PAGE, "fake_misses": 1}
    assert s.pending_puts() == 0
    (off,) = s.reserve(owner, ts, ["d"], [PAGE], False)
    assert off >= 0 and s.pending_puts() == 1
    s.abort(owner, ts, [off])
    assert s.pending_puts() == 0


def test_a_reservation_being_written_is_not_taken_back_as_stale():
    """When memory is short, reservations older than reserve_timeout are freed; one whose
    WRITE is still arriving is not (its bytes would land in pages reserved again for
    another key), and once its bytes are in it is like any other."""
    s = Store(2 * PAGE, arena_size=4 * PAGE, reserve_timeout=0.0)
    try:
        ts, owner = s.space(""), s.new_owner()
        a, b = s.reserve(owner, ts, ["a", "b"], [PAGE, PAGE], False)
        assert not s.writing(owner, ts, a, PAGE + 1)  # another size: not a WRITE of it
        assert s.writing(owner, ts, a, PAGE)
        (c,) = s.reserve(s.new_owner(), ts, ["c"], [PAGE], False)
        assert c == b  # b was taken back for c; a, being written, was not
        assert set(owner.reservations) == {("", a)}
        s.received(owner, ts, a, 0)
        s._swept = -float("inf")  # the next sweep may run at once
        (d,) = s.reserve(s.new_owner(), ts, ["d"], [PAGE], False)
        assert d == a and not owner.reservations
    finally:
        s.close(spill=False)


def test_a_save_that_fails_leaves_a_miss_not_the_older_value(spilled):
    """Vendor: a key that fails to save is not read later.  b (in memory) saved again and
    aborted, a (on the disk tier) saved again with nothing vouching for its bytes: both
    miss, their older values gone from every tier."""
    s, disk, ts, owner = spilled
    (off,) = s.reserve(owner, ts, ["b"], [PAGE], False)
    s.abort(owner, ts, [off])
    assert s.exists(ts, ["b"], False) == 0 and s.get(owner, ts, ["b"], False)[1] == []
    (off,) = s.reserve(owner, ts, ["a"], [PAGE], False)
    assert s.commit(owner, ts, ["a"], [off], [None], mapped=False) == [False]
    assert ("t", "a") not in disk.data and s.exists(ts, ["a"], False) == 0
    assert s.exists(ts, ["c"], False) == 1  # other keys stay
    assert s.reserve(owner, ts, ["c"], [64 * PAGE], False) == [NO_SPACE]  # too large: refused
    assert s.exists(ts, ["c"], False) == 0


def test_a_key_saved_again_retires_its_remote_copy():
    remote = FakeTier()
    s = Store(4 * PAGE, arena_size=8 * PAGE, remote=remote)
    try:
        ts, owner = s.space("t"), s.new_owner()
        put(s, owner, ts, "k", 1)
        assert ("t", "k") in remote.data
        s.close_owner(owner)
        owner = s.new_owner()
        (off,) = s.reserve(owner, ts, ["k"], [PAGE], False)
        assert off >= 0 and ("t", "k") not in remote.data
        s.close_owner(owner)  # the connection ends before its commit: the save failed
        assert s.exists(ts, ["k"], False) == 0
    finally:
        s.close(spill=False)
