"""Taking turns on one link: a lock handed out in arrival order, whose holder runs the
prepared transfers waiting behind it before it lets go.

A link carries one transfer at a time.  Several requests pushing layer after layer over
one link (8 requests of a batch, each a thread) queue for it, and how the queue is served
decides both the batch's time and each call's tail:

- a plain lock is not fair: the thread that just released it often takes it again, so
  most calls find it free and a few wait through dozens of others (p99 17-20 ms against
  a p50 of 0.24 ms, `kv-7b` over `shm`);
- handing the lock to the longest waiter is fair, but each hand-over wakes a sleeping
  thread (100 us and more on a virtual machine) while the link stands idle: 256 wake-ups
  made the 8-request batch 24 % slower over `tcp`.

So the holder serves the queue itself ("combining"): when its own transfer is done, it
runs the prepared transfers waiting then (one round; over a socket link as one pipelined
batch, one round trip), hands each caller its outcome and wakes it, and only then gives
the lock to the next waiter, if any arrived meanwhile.  The woken callers resume while the
link is busy with the next round, so wake-ups leave the critical path, and nobody waits for
more than the callers ahead of it.  Waiters that need the lock itself (a lookup, a first
plan, an unlink) get it in their turn; a round never runs past one of them.

Only work the holder may do for another thread is queued as a job: a transfer of a plan on
host memory, already prepared (device copies follow the calling thread's device and
stream).  The queue and its states live under one small mutex; the wait of each queued
caller is a lock of its own (cheaper to make than an Event), bounded by its deadline.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Generic, Optional, TypeVar

__all__ = ["Turns", "Unserved", "TurnEnds"]

_J = TypeVar("_J")

#: Most queued jobs one round runs (a socket batch's answers must fit its buffers).
ROUND = 64

_WAITING, _GRANTED, _TAKEN, _DONE, _CANCELLED = range(5)


class Unserved(Exception):
    """A job's caller gave up before its turn (its deadline passed in the queue)."""


class _Waiter(Generic[_J]):
    __slots__ = ("job", "wake", "state", "outcome")

    def __init__(self, job: Optional[_J]) -> None:
        self.job = job
        self.wake = threading.Lock()
        self.wake.acquire()
        self.state = _WAITING
        self.outcome: Any = None


class Turns(Generic[_J]):
    """A first-come-first-served lock (``acquire`` / ``release`` / ``with``, as
    ``threading.Lock``) whose holder serves queued jobs (:meth:`submit`) through
    ``serve`` before handing over.

    ``serve(jobs)`` runs with the lock held, in the releasing thread, and returns one
    outcome per job (a value, or the exception for that job's caller); it must not raise.

    Uncontended, taking and giving back cost what a ``threading.Lock`` costs (a small
    call's whole budget is a few microseconds): the lock itself is a ``threading.Lock``,
    and only callers that find it held touch the queue and its mutex.  Whoever queues
    tries the lock once more after queueing, and whoever lets go looks at the queue once
    more after letting go, so nobody sleeps in the queue while the lock is free.
    """

    def __init__(self, serve: Callable[[list[_J]], list[Any]]) -> None:
        self._serve = serve
        self._lock = threading.Lock()
        self._mutex = threading.Lock()
        self._queue: deque[_Waiter[_J]] = deque()

    def locked(self) -> bool:
        return self._lock.locked()

    # -- the lock --------------------------------------------------------------------------
    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock, in arrival order; False if not ``blocking`` and it is held, or
        at ``timeout`` (seconds; -1: no limit)."""
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        waiter: _Waiter[_J] = _Waiter(None)
        return self._enqueue(waiter) or self._await(waiter, timeout)

    def release(self) -> None:
        """Serve one round of the jobs waiting at the head of the queue, then hand the lock
        to the next waiter or free it."""
        if not self._queue:
            self._lock.release()
            # A waiter that queued meanwhile tried the lock after queueing, or finds it
            # taken here and is handed it below.
            if not self._queue or not self._lock.acquire(False):
                return
        with self._mutex:
            batch: list[_Waiter[_J]] = []
            while self._queue and self._queue[0].job is not None and len(batch) < ROUND:
                waiter = self._queue.popleft()
                waiter.state = _TAKEN
                batch.append(waiter)
            if not batch:
                self._hand_over()
                return
        try:
            self._run(batch)
        finally:
            with self._mutex:
                self._hand_over()

    def __enter__(self) -> "Turns[_J]":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- jobs ------------------------------------------------------------------------------
    def submit(self, job: _J, timeout: float) -> tuple[bool, Any]:
        """For a caller that found the lock held (``acquire(blocking=False)`` said no):
        ``(True, outcome)`` once the holder ran ``job`` for it, or ``(False, None)`` when
        the caller got the lock instead (it came free, or a waiter that needs the lock came
        first in a round) and runs ``job`` itself, then releases.  Raises
        :class:`Unserved` if ``timeout`` (seconds) passes while the job is still queued."""
        waiter = _Waiter(job)
        if self._enqueue(waiter):
            return False, None
        if not self._await(waiter, timeout):
            raise Unserved()
        if waiter.state == _GRANTED:
            return False, None
        return True, waiter.outcome

    # -- internals -------------------------------------------------------------------------
    def _enqueue(self, waiter: _Waiter[_J]) -> bool:
        """Queue ``waiter``; True (and not queued) if the lock came free meanwhile and is
        now the caller's."""
        with self._mutex:
            self._queue.append(waiter)
            if self._lock.acquire(False):
                self._queue.pop()  # the one just appended: appends happen under the mutex
                return True
        return False

    def _await(self, waiter: _Waiter[_J], timeout: float) -> bool:
        """Sleep until ``waiter`` is granted the lock or its job is done: True; False if
        ``timeout`` passed while it was still queued (it is then taken out of the queue).
        A job the holder took is waited for to its end: the holder's transfer has its own
        deadline."""
        if waiter.wake.acquire(timeout=timeout if timeout >= 0 else -1):
            return True
        with self._mutex:
            if waiter.state == _WAITING:
                self._queue.remove(waiter)
                waiter.state = _CANCELLED
                return False
        waiter.wake.acquire()  # granted or taken meanwhile: it is set soon
        return True

    def _run(self, batch: list[_Waiter[_J]]) -> None:
        """Run the jobs of ``batch`` and hand each caller its outcome; a caller is never
        left waiting, whatever happens here."""
        outcomes: list[Any] = []
        try:
            outcomes = self._serve([w.job for w in batch])  # type: ignore[misc]
        finally:
            for i, waiter in enumerate(batch):
                waiter.outcome = outcomes[i] if i < len(outcomes) else \
                    Unserved("the thread serving this transfer was interrupted")
                waiter.state = _DONE
                waiter.wake.release()

    def _hand_over(self) -> None:
        """(mutex held, lock held) Give the lock to the longest waiter, or free it."""
        if self._queue:
            waiter = self._queue.popleft()
            waiter.state = _GRANTED
            waiter.wake.release()
        else:
            self._lock.release()


class TurnEnds:
    """The link's count of turns let go, which a peer's fence waits on (a mixin of
    :class:`~.link.Link`, whose ``turns`` it reads).  Letting go costs the holder an
    increment; only a waiting fence adds a notify."""

    turns: Turns[Any]

    def __init__(self) -> None:
        self.turns_ended = 0
        self.fencing = False   # this end's own fence holds the turn (moving nothing)
        self._turn_watchers = 0
        self._turn_ended = threading.Condition(threading.Lock())

    def turn_over(self) -> None:
        """The holder let go of the link (after its last copy)."""
        self.turns_ended += 1
        if self._turn_watchers:
            with self._turn_ended:
                self._turn_ended.notify_all()

    def after_turn(self, deadline: float) -> bool:
        """Wait until the transfer holding the link now (if any) has let go of it: every
        copy after that checks the peer's epoch anew.  False at ``deadline``."""
        seen = self.turns_ended  # first: a turn that ends in between counts as over
        if not self.turns.locked() or self.fencing:
            return True
        with self._turn_ended:
            self._turn_watchers += 1
            try:
                while self.turns_ended == seen:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._turn_ended.wait(left)
            finally:
                self._turn_watchers -= 1
        return True
