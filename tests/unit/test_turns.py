"""The link's turn-taking lock (datadist.engine.turns): arrival order, jobs served by the
holder in its thread, outcomes and errors handed to their callers, deadlines in the queue."""
from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from datadist.engine.turns import ROUND, Turns, Unserved
from waiting import until

pytestmark = pytest.mark.timeout(30)


class _Recorder:
    """A ``serve`` that records which thread ran which jobs, and answers each job
    ``("done", job)``; a job that is an exception is answered with it."""

    def __init__(self) -> None:
        self.rounds: list[tuple[str, list[Any]]] = []

    def __call__(self, jobs: list[Any]) -> list[Any]:
        self.rounds.append((threading.current_thread().name, list(jobs)))
        return [job if isinstance(job, BaseException) else ("done", job) for job in jobs]


def _submitter(turns: Turns[Any], job: Any, results: dict[Any, Any], timeout: float = 10.0) -> threading.Thread:
    def run() -> None:
        try:
            served, outcome = turns.submit(job, timeout)
            if not served:  # granted the lock: run it here
                outcome = ("self", job)
                turns.release()
            results[job] = outcome
        except Unserved as exc:
            results[job] = exc

    thread = threading.Thread(target=run, name=f"caller-{job}", daemon=True)
    thread.start()
    return thread


def _queue_jobs(turns: Turns[Any], jobs: list[Any], results: dict[Any, Any]) -> list[threading.Thread]:
    """A submitter per job, each started once the one before it is queued (arrival order)."""
    threads = []
    for job in jobs:
        queued = len(turns._queue) + 1
        threads.append(_submitter(turns, job, results))
        until(lambda: len(turns._queue) == queued)
    return threads


def test_a_free_lock_is_taken_at_once_and_a_held_one_not_without_blocking() -> None:
    turns: Turns[Any] = Turns(_Recorder())
    assert turns.acquire(blocking=False)
    assert turns.locked()
    assert not turns.acquire(blocking=False)
    t0 = time.monotonic()
    assert not turns.acquire(timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    turns.release()
    assert not turns.locked()
    with turns:
        assert turns.locked()
    assert not turns.locked()


def test_the_lock_is_handed_out_in_arrival_order() -> None:
    turns: Turns[Any] = Turns(_Recorder())
    turns.acquire()
    order: list[int] = []

    def waiter(i: int) -> None:
        with turns:
            order.append(i)

    threads = []
    for i in range(6):
        threads.append(threading.Thread(target=waiter, args=(i,), daemon=True))
        threads[-1].start()
        until(lambda: len(turns._queue) == i + 1)
    turns.release()
    for t in threads:
        t.join(10)
    assert order == list(range(6))
    assert not turns.locked()


def test_the_holder_runs_the_queued_jobs_in_its_thread_and_hands_out_the_outcomes() -> None:
    serve = _Recorder()
    turns: Turns[Any] = Turns(serve)
    assert turns.submit("mine", 1.0) == (False, None)  # free: the caller runs its own job
    results: dict[Any, Any] = {}
    boom = RuntimeError("this job's own error")
    threads = _queue_jobs(turns, ["a", "b", boom], results)
    turns.release()
    for t in threads:
        t.join(10)
    assert serve.rounds == [(threading.current_thread().name, ["a", "b", boom])]
    assert results == {"a": ("done", "a"), "b": ("done", "b"), boom: boom}
    assert not turns.locked()


def test_a_round_stops_at_a_waiter_that_needs_the_lock_itself() -> None:
    serve = _Recorder()
    turns: Turns[Any] = Turns(serve)
    turns.acquire()
    results: dict[Any, Any] = {}
    first = _submitter(turns, "before", results)
    until(lambda: len(turns._queue) == 1)
    got_lock = threading.Event()
    leave = threading.Event()

    def plain() -> None:
        with turns:
            got_lock.set()
            leave.wait(10)

    plain_thread = threading.Thread(target=plain, name="plain", daemon=True)
    plain_thread.start()
    until(lambda: len(turns._queue) == 2)
    after = _submitter(turns, "after", results)
    until(lambda: len(turns._queue) == 3)
    turns.release()  # serves "before", then hands the lock to the plain waiter
    assert got_lock.wait(10)
    first.join(10)
    assert results == {"before": ("done", "before")}
    assert "after" not in results  # behind the plain waiter, which still holds the lock
    leave.set()
    plain_thread.join(10)
    after.join(10)
    assert results["after"] == ("done", "after")
    assert [names for _, names in serve.rounds] == [["before"], ["after"]]
    assert serve.rounds[1][0] == "plain"  # served by the thread that held the lock then


def test_waiters_arriving_during_a_round_get_the_lock_afterwards() -> None:
    gate = threading.Event()
    entered = threading.Event()
    rounds: list[list[Any]] = []

    def serve(jobs: list[Any]) -> list[Any]:
        rounds.append(list(jobs))
        entered.set()
        assert gate.wait(10)
        return [("done", j) for j in jobs]

    turns: Turns[Any] = Turns(serve)
    turns.acquire()
    results: dict[Any, Any] = {}
    t1 = _submitter(turns, 1, results)
    until(lambda: len(turns._queue) == 1)
    releaser = threading.Thread(target=turns.release, daemon=True)
    releaser.start()
    assert entered.wait(10)
    t2 = _submitter(turns, 2, results)  # queued while round [1] runs
    until(lambda: len(turns._queue) == 1)
    gate.set()
    for t in (releaser, t1, t2):
        t.join(10)
    # 2 was not served in the first round: it got the lock and ran its job itself.
    assert rounds == [[1]]
    assert results == {1: ("done", 1), 2: ("self", 2)}
    assert not turns.locked()


def test_a_round_takes_at_most_ROUND_jobs() -> None:
    serve = _Recorder()
    turns: Turns[Any] = Turns(serve)
    turns.acquire()
    results: dict[Any, Any] = {}
    threads = _queue_jobs(turns, list(range(ROUND + 2)), results)
    turns.release()
    for t in threads:
        t.join(10)
    assert len(serve.rounds[0][1]) == ROUND
    assert sum(len(jobs) for _, jobs in serve.rounds) + sum(1 for v in results.values() if v[0] == "self") \
        == ROUND + 2
    assert all(results[i] == ("done", i) for i in range(ROUND))


def test_a_job_whose_deadline_passes_in_the_queue_is_unserved_and_never_run() -> None:
    serve = _Recorder()
    turns: Turns[Any] = Turns(serve)
    turns.acquire()
    results: dict[Any, Any] = {}
    late = _submitter(turns, "late", results, timeout=0.05)
    late.join(10)
    assert isinstance(results["late"], Unserved)
    assert len(turns._queue) == 0
    turns.release()
    assert serve.rounds == []
    assert not turns.locked()


def test_callers_are_woken_even_when_serve_breaks() -> None:
    def serve(jobs: list[Any]) -> list[Any]:
        raise KeyboardInterrupt

    turns: Turns[Any] = Turns(serve)
    turns.acquire()
    results: dict[Any, Any] = {}
    t = _submitter(turns, "x", results)
    until(lambda: len(turns._queue) == 1)
    with pytest.raises(KeyboardInterrupt):
        turns.release()
    t.join(10)
    assert isinstance(results["x"], Unserved)
    assert not turns.locked()
