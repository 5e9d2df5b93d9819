"""The key set the daemon publishes (``ems.pool.keyset``): writer and reader on one memfd."""
from __future__ import annotations

import multiprocessing as mp

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.pool import _keyset
from ems.pool.keyset import KeySet, KeySetView, slots_for

pytestmark = pytest.mark.timeout(60)

PREFIX, SUFFIX = b"t|m|vllm|MHA|h", b"\x00tp1.0|pp1.0"


def key_of(h: int) -> str:
    return (PREFIX + format(h, "x").encode() + SUFFIX).decode()


@pytest.fixture
def pair():
    ks = KeySet("test-keys", 200)
    view = KeySetView(ks.fd, ks.size)
    yield ks, view
    view.close()
    ks.close()


def add_all(ks: KeySet, keys) -> None:
    present = list(keys)
    for k in keys:
        ks.add(k, lambda: present)


def test_counts_leading_keys_and_int_form_matches_text(pair):
    ks, view = pair
    add_all(ks, [key_of(h) for h in (1, 2, 3, 2**64 - 1)])
    assert view.count([key_of(1), key_of(2), key_of(3)]) == 3
    assert view.count([key_of(1), key_of(9), key_of(3)]) == 1  # a missing middle key stops it
    assert view.count([]) == 0
    assert view.count_ints(PREFIX, [1, 2, 3, 2**64 - 1], SUFFIX) == 4
    assert view.count_ints(PREFIX, [1, 2, 4, 3], SUFFIX) == 2
    assert view.count_ints(b"other", [1], SUFFIX) == 0
    for bad in (-1, 2**64):
        with pytest.raises(OverflowError):
            view.count_ints(PREFIX, [bad], SUFFIX)
    with pytest.raises(TypeError):
        view.count([b"bytes"])


def test_discard_and_readd(pair):
    ks, view = pair
    add_all(ks, [key_of(h) for h in range(10)])
    ks.discard(key_of(4), 9, lambda: [])
    assert view.count_ints(PREFIX, list(range(10)), SUFFIX) == 4
    ks.add(key_of(4), lambda: [])
    assert view.count_ints(PREFIX, list(range(10)), SUFFIX) == 10
    assert ks.stats()["keys"] == 10


def test_tombstones_are_rebuilt_away(pair):
    ks, view = pair
    live = {key_of(h) for h in range(50)}
    add_all(ks, live)
    for r in range(40):  # churn far past the slots: add must rebuild from `present`
        gone = key_of(r)
        live.discard(gone)
        ks.discard(gone, len(live), lambda: sorted(live))
        new = key_of(1000 + r)
        live.add(new)
        ks.add(new, lambda: sorted(live))
    st_ = ks.stats()
    assert st_["keys"] == 50 and st_["published"]
    assert view.count(sorted(live)) == 50
    assert view.count([key_of(0)]) == 0


def test_overflow_makes_readers_ask_and_recovers():
    ks = KeySet("test-small", 10)  # 64 slots: 48 keys at most
    view = KeySetView(ks.fd, ks.size)
    try:
        keys = [key_of(h) for h in range(60)]
        for i, k in enumerate(keys):
            ks.add(k, lambda: keys[:i + 1])
        assert ks.overflowed and view.count(keys[:1]) is None
        for k in keys[20:]:
            ks.discard(k, 20, lambda: keys[:20])
        assert not ks.overflowed
        assert view.count(keys) == 20
    finally:
        view.close()
        ks.close()


def test_invalidated_and_foreign_tables():
    ks = KeySet("test-inv", 10)
    view = KeySetView(ks.fd, ks.size)
    ks.add(key_of(1), lambda: [])
    ks.invalidate()
    ks.discard(key_of(1), 0, lambda: [])  # nothing brings a withdrawn table back
    ks.add(key_of(2), lambda: [key_of(2)])
    ks.rebuild([key_of(2)])
    assert view.count([key_of(2)]) is None
    ks.close()
    assert view.count([key_of(1)]) is None  # a closing daemon: ask it instead
    view.close()
    with pytest.raises(ValueError):
        _keyset.count_keys(bytearray(64), ["x"])  # not a table
    with pytest.raises(ValueError):
        _keyset.count_keys(bytearray(8), ["x"])


@pytest.mark.parametrize("nslots", [1 << 61, 1 << 63, 1 << 10])
def test_a_table_announcing_more_slots_than_its_buffer_holds_is_refused(nslots):
    """The daemon writes the table a client maps: a slot count whose byte size wraps
    around 64 bits (2^61 slots of 8 bytes) or merely exceeds the buffer is not a table
    (before, 2^61 passed the size check and the probe read far outside the mapping)."""
    ks = KeySet("test-wrap", 10)
    view = KeySetView(ks.fd, ks.size)
    table = bytearray(view._mm[:ks.size])  # a real table's bytes, copied
    view.close()
    ks.close()
    assert _keyset.count_keys(table, ["x"]) == 0
    table[16:24] = nslots.to_bytes(8, "little")  # the slot count word
    with pytest.raises(ValueError, match="not an initialised key set"):
        _keyset.count_keys(table, ["x"])


def test_slots_for_keeps_load_under_three_quarters():
    for n in (0, 1, 47, 48, 49, 1000, 1 << 20):
        s = slots_for(n)
        assert s & (s - 1) == 0 and n <= s * 3 // 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=300))
def test_matches_a_python_set(ops):
    ks = KeySet("test-prop", 16)  # small: rebuilds and overflow both happen
    view = KeySetView(ks.fd, ks.size)
    try:
        model = set()
        for add, h in ops:
            k = key_of(h)
            if add:
                model.add(k)
                ks.add(k, lambda: sorted(model))
            else:
                model.discard(k)
                ks.discard(k, len(model), lambda: sorted(model))
        for h in range(41):
            got = view.count([key_of(h)])
            assert got is None or got == (key_of(h) in model)
        assert ks.overflowed or ks.stats()["keys"] == len(model)
    finally:
        view.close()
        ks.close()


def _race_reader(fd: int, size: int, stable, stop, out) -> None:
    view = KeySetView(fd, size)
    answered = unsure = 0
    wrong = []
    while not stop.is_set():
        n = view.count(stable)
        if n is None:
            unsure += 1
        else:
            answered += 1
            if n != len(stable):
                wrong.append(n)
    out.send((answered, unsure, wrong[:10]))


def test_readers_racing_rebuilds_never_miss_a_stable_key():
    """A reader in another process, on another core, while the writer churns and rebuilds."""
    ctx = mp.get_context("fork")
    ks = KeySet("test-race", 300)
    stable = [key_of(h) for h in range(100)]
    churn = [key_of(10**6 + h) for h in range(100)]
    add_all(ks, stable)
    stop = ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_race_reader, args=(ks.fd, ks.size, stable, stop, send))
    child.start()
    try:
        for _ in range(300):
            for k in churn:
                ks.add(k, lambda: stable + churn)
            for k in churn:
                ks.discard(k, len(stable), lambda: stable)
            ks.rebuild(stable)  # moves every key: readers must retry or give up, never miss
    finally:
        stop.set()
        got = recv.recv() if recv.poll(20) else None
        child.join(20)
        ks.close()
    assert child.exitcode == 0 and got is not None, f"reader exit {child.exitcode}"
    answered, unsure, wrong = got
    assert not wrong and answered > 0, (answered, unsure, wrong)
