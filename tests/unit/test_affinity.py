"""Threads a connector starts from a pinned model thread run on every CPU of the instance."""
from __future__ import annotations

import os
import threading

import pytest

from datadist.integrations.affinity import instance_cpus, on_instance_cpus

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                 reason="needs sched_setaffinity and two CPUs")]


def _affinity_of_a_new_thread() -> set[int]:
    seen: list[set[int]] = []
    thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    thread.start()
    thread.join(10)
    return seen[0]


def test_a_thread_started_from_a_pinned_thread_gets_the_instance_cpus_and_the_caller_stays_pinned() -> None:
    """As in a vLLM CPU worker: the main thread pinned to one core, an OpenMP thread to
    another; a thread started inside the block may run on both, one started outside only
    on the main thread's."""
    everything = os.sched_getaffinity(0)
    first, second = sorted(everything)[:2]
    release = threading.Event()
    pinned = threading.Event()

    def omp_thread() -> None:
        os.sched_setaffinity(0, {second})
        pinned.set()
        release.wait(20)

    helper = threading.Thread(target=omp_thread)
    helper.start()
    os.sched_setaffinity(0, {first})
    try:
        assert pinned.wait(10)
        assert _affinity_of_a_new_thread() == {first}  # what a pinned model thread passes on by itself
        assert instance_cpus() == {first, second}
        with on_instance_cpus() as cpus:
            assert cpus == {first, second}
            assert _affinity_of_a_new_thread() == {first, second}
        assert os.sched_getaffinity(0) == {first}
    finally:
        os.sched_setaffinity(0, everything)
        release.set()
        helper.join(10)


def test_the_callers_affinity_comes_back_when_the_block_raises() -> None:
    everything = os.sched_getaffinity(0)
    first = min(everything)
    os.sched_setaffinity(0, {first})
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with on_instance_cpus():
                raise RuntimeError("boom")
        assert os.sched_getaffinity(0) == {first}
    finally:
        os.sched_setaffinity(0, everything)


def test_nothing_changes_when_the_caller_already_has_every_cpu() -> None:
    everything = os.sched_getaffinity(0)
    with on_instance_cpus() as cpus:
        assert cpus == everything
        assert os.sched_getaffinity(0) == everything
