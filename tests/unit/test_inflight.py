"""Freed memory waits for the transfers still moving it: the agent's servings
(:mod:`datadist.engine.inflight`) and the turn a peer's fence waits out
(:mod:`datadist.engine.fences`)."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, List

import pytest

from datadist.engine.inflight import InFlight
from datadist.engine.turns import TurnEnds, Turns

pytestmark = pytest.mark.timeout(30)


class _Epoch:
    def __init__(self) -> None:
        self.value = 1


def _inflight() -> tuple[InFlight, _Epoch]:
    epoch = _Epoch()
    return InFlight(lambda: epoch.value), epoch


def _on_thread(fn: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=fn)
    thread.start()
    return thread


def test_memory_nobody_moves_goes_back_at_once() -> None:
    inflight, epoch = _inflight()
    released: List[int] = []
    epoch.value += 1
    assert inflight.release_after(epoch.value, lambda: released.append(1), time.monotonic() + 5)
    assert released == [1]


def test_a_serving_begun_before_the_free_holds_the_memory_until_it_ends() -> None:
    inflight, epoch = _inflight()
    begun = threading.Event()
    finish = threading.Event()
    ended: List[float] = []

    def serve() -> None:
        serving = inflight.begin()
        begun.set()
        finish.wait(10)
        ended.append(time.monotonic())
        inflight.end(serving)

    server = _on_thread(serve)
    begun.wait(10)
    epoch.value += 1  # the cache is freed: the registry moved its epoch
    released: List[float] = []
    freeing = _on_thread(lambda: inflight.release_after(epoch.value, lambda: released.append(time.monotonic()),
                                                         time.monotonic() + 10))
    freeing.join(0.2)
    assert freeing.is_alive() and not released, "released while a transfer into the memory still ran"
    finish.set()
    freeing.join(10)
    server.join(10)
    assert len(released) == 1 and released[0] >= ended[0]


def test_servings_begun_after_the_free_do_not_hold_it() -> None:
    inflight, epoch = _inflight()
    epoch.value += 1
    later = inflight.begin()  # checks the new epoch: a stale request, refused
    released: List[int] = []
    assert inflight.release_after(epoch.value, lambda: released.append(1), time.monotonic() + 5)
    assert released == [1]
    inflight.end(later)


def test_a_callback_of_a_serving_frees_without_waiting_for_itself() -> None:
    """A user callback runs on the thread serving the request that called it: that
    serving moves nothing meanwhile, and waiting for it would wait forever."""
    inflight, epoch = _inflight()
    serving = inflight.begin()
    epoch.value += 1
    released: List[int] = []
    assert inflight.release_after(epoch.value, lambda: released.append(1), time.monotonic() + 5)
    assert released == [1]
    inflight.end(serving)


def test_a_serving_handed_to_another_thread_counts_for_that_thread() -> None:
    inflight, epoch = _inflight()
    serving = inflight.begin()  # begun on this thread (the agent's), carried on by a worker
    moved = threading.Event()
    freed: List[bool] = []
    epoch.value += 1

    def worker() -> None:
        inflight.moved(serving)
        moved.set()
        freed.append(inflight.release_after(epoch.value, lambda: None, time.monotonic() + 5))
        inflight.end(serving)

    thread = _on_thread(worker)
    thread.join(10)
    assert moved.is_set() and freed == [True]
    # and on the agent's thread it is another thread's now: a free there waits for it
    other = inflight.begin()
    inflight.moved(other)
    done = _on_thread(lambda: freed.append(inflight.release_after(epoch.value + 1, lambda: None,
                                                                  time.monotonic() + 0.1)))
    done.join(10)
    assert freed[-1] is False
    inflight.end(other)


def test_memory_still_moved_at_the_deadline_goes_back_when_the_transfer_ends() -> None:
    inflight, epoch = _inflight()
    began = threading.Event()
    finish = threading.Event()

    def serve() -> None:
        serving = inflight.begin()
        began.set()
        finish.wait(10)
        inflight.end(serving)

    server = _on_thread(serve)
    began.wait(10)
    epoch.value += 1
    released: List[int] = []
    assert not inflight.release_after(epoch.value, lambda: released.append(1), time.monotonic() + 0.05)
    assert released == []
    finish.set()
    server.join(10)
    assert released == [1]


class _Ends(TurnEnds):
    def __init__(self) -> None:
        self.turns: Turns[Any] = Turns(lambda jobs: [None] * len(jobs))
        TurnEnds.__init__(self)

    def let_go(self) -> None:
        self.turns.release()
        self.turn_over()


def test_a_fence_on_an_idle_link_is_answered_at_once() -> None:
    ends = _Ends()
    assert ends.after_turn(time.monotonic())


def test_a_fence_waits_for_the_transfer_holding_the_link() -> None:
    ends = _Ends()
    ends.turns.acquire()
    assert not ends.after_turn(time.monotonic() + 0.05)
    answered: List[bool] = []
    waiter = _on_thread(lambda: answered.append(ends.after_turn(time.monotonic() + 10)))
    waiter.join(0.1)
    assert waiter.is_alive()
    ends.let_go()
    waiter.join(10)
    assert answered == [True]


def test_a_fence_does_not_wait_for_this_ends_own_fence() -> None:
    """Two engines freeing at once fence each other: each holds its link for its own
    fence, which moves nothing, so neither waits for the other."""
    ends = _Ends()
    ends.turns.acquire()
    ends.fencing = True
    assert ends.after_turn(time.monotonic())
    ends.fencing = False
    ends.let_go()
