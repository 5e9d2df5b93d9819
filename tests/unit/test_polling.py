"""The spin decisions of :mod:`datadist.engine.polling` (pure logic, and the load sampler on
a file of its own)."""
from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from datadist.engine.polling import MISSES, PROBE, Load, SpinPolicy, oversubscribed, runnable_of


@pytest.mark.parametrize("runnable, cores, busy", [
    (1, 2, False), (2, 2, False), (3, 2, True), (16, 16, False), (17, 16, True), (1, 1, True), (0, 1, True),
])
def test_a_machine_is_oversubscribed_with_more_runnable_threads_than_cores(runnable: int, cores: int,
                                                                           busy: bool) -> None:
    assert oversubscribed(runnable, cores) is busy


@pytest.mark.parametrize("text, runnable", [
    (b"0.50 0.40 0.30 3/512 1234\n", 3), (b"13.56 12.58 8.62 11/262 30026\n", 11),
    (b"", None), (b"0.5 0.4 0.3", None), (b"0.5 0.4 0.3 x/12 1", None), (b"0.5 0.4 0.3 7 1", None),
])
def test_the_runnable_count_is_read_from_loadavg_text(text: bytes, runnable: object) -> None:
    assert runnable_of(text) == runnable


def test_a_busy_machine_never_spins_an_idle_one_spins_the_budget() -> None:
    policy = SpinPolicy(200)
    assert [policy.spin_us(busy) for busy in (False, True, False)] == [200, 0, 200]
    assert SpinPolicy(0).spin_us(False) == 0


def test_after_misses_in_a_row_only_every_probe_th_wait_spins_until_one_catches() -> None:
    policy = SpinPolicy(100)
    for _ in range(MISSES):
        assert policy.spin_us(False) == 100
        policy.outcome(100, 250.0)  # the reply came after the spin
    spins: List[int] = [policy.spin_us(False) for _ in range(2 * PROBE)]
    assert spins.count(100) == 2 and spins.count(0) == 2 * PROBE - 2
    policy.outcome(100, 40.0)  # a probe caught it: spinning pays again
    assert [policy.spin_us(False) for _ in range(3)] == [100, 100, 100]


def test_a_wait_that_did_not_spin_teaches_nothing() -> None:
    policy = SpinPolicy(100)
    for _ in range(2 * MISSES):
        policy.outcome(0, 5000.0)
    assert policy.misses == 0 and policy.spin_us(False) == 100
    policy.missed()
    policy.caught()
    assert policy.misses == 0


def test_the_load_is_sampled_at_most_every_interval(tmp_path: Path) -> None:
    path = tmp_path / "loadavg"
    path.write_bytes(b"1.0 1.0 1.0 5/100 42\n")
    now = [10.0]
    load = Load(str(path), every_s=0.002, clock=lambda: now[0])
    load.cores = 4
    assert load.runnable() == 5 and load.busy()
    path.write_bytes(b"1.0 1.0 1.0 2/100 42\n")
    now[0] += 0.001
    assert load.runnable() == 5  # the sample is still fresh
    now[0] += 0.002
    assert load.runnable() == 2 and not load.busy()


def test_without_the_file_the_load_counts_nothing(tmp_path: Path) -> None:
    load = Load(str(tmp_path / "absent"))
    assert load.runnable() == 0
    load.cores = 2
    assert not load.busy()
    load.cores = 1
    assert load.busy()  # one core: never spin
