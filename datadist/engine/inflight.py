"""Requests of peers that are still moving bytes of this engine's caches, so that memory
is given back only once nothing can write into it or read from it any more.

The agent serves a peer's transfer against the registry as it was when the request was
checked; the user may free that cache a moment later, and the pool may hand its memory to
the next cache while the payload of the first is still arriving.  So every request the
agent serves is a :class:`Serving`, begun before its epoch check and ended when its bytes
have moved (on whichever thread finishes it), and memory freed at epoch ``E`` goes back
once no serving begun before ``E`` is left (:meth:`InFlight.release_after`).

A serving costs its thread a dict store and a delete (no lock): the agent's path of a
small transfer is a few microseconds, and only a thread that frees memory waits.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, TypeVar

__all__ = ["InFlight", "Serving"]

log = logging.getLogger("datadist")

_T = TypeVar("_T")


class Serving:
    """One request being served; ``thread``: the thread serving it now (a request handed
    to another thread is :meth:`moved <InFlight.moved>` with it); ``handed``: handed off,
    it ends with the thread it went to (:meth:`InFlight.hand_off`)."""

    __slots__ = ("thread", "handed")

    def __init__(self, thread: int) -> None:
        self.thread = thread
        self.handed = False


class InFlight:
    """The servings under way, by the epoch each began at, and the releases waiting for
    them.  ``epoch()`` reads the registry's epoch."""

    def __init__(self, epoch: Callable[[], int]) -> None:
        self._epoch = epoch
        self._active: dict[Serving, int] = {}
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0          # threads in release_after
        self._later: list[tuple[int, Callable[[], None]]] = []

    def begin(self) -> Serving:
        """A serving of the calling thread; the request's epoch is to be checked after
        this (a cache freed before its check makes it stale, one freed after it waits)."""
        serving = Serving(threading.get_ident())
        self._active[serving] = self._epoch()
        return serving

    @staticmethod
    def moved(serving: Serving) -> None:
        """The calling thread carries ``serving`` on (a request handed off the agent)."""
        serving.thread = threading.get_ident()

    def hand_off(self, serving: Serving, rest: Callable[[], _T], scope: contextlib.ExitStack) -> Callable[[], _T]:
        """``rest`` of a request handed to another thread, which :meth:`moved` ``serving``
        there; it ends when ``scope`` (the request's, which goes along) closes."""
        def run() -> _T:
            self.moved(serving)
            return rest()
        serving.handed = True
        scope.callback(self.end, serving)
        return run

    def end(self, serving: Serving) -> None:
        """``serving`` moved its last byte; releases it held back go now."""
        self._active.pop(serving, None)
        if self._waiting or self._later:
            with self._cond:
                self._cond.notify_all()
                due = self._due_locked()
            for release in due:
                release()

    def _busy_locked(self, epoch: int, thread: int) -> bool:
        """Whether a serving begun before ``epoch`` is under way on another thread than
        ``thread`` (a thread freeing memory in a callback of its own serving waits for no
        one: that serving moves nothing while the callback runs)."""
        return any(began < epoch and serving.thread != thread for serving, began in list(self._active.items()))

    def _due_locked(self) -> list[Callable[[], None]]:
        due = [release for epoch, release in self._later if not self._busy_locked(epoch, 0)]
        if due:
            self._later = [(epoch, release) for epoch, release in self._later if self._busy_locked(epoch, 0)]
        return due

    def release_after(self, epoch: int, release: Callable[[], None], deadline: float) -> bool:
        """Run ``release`` once no serving begun before ``epoch`` is under way: now if
        none is, else when the last ends, waiting for that until ``deadline``; False if
        it was kept for later (the servings' own deadlines end them)."""
        me = threading.get_ident()
        with self._cond:
            self._waiting += 1
            try:
                while self._busy_locked(epoch, me):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        log.warning("memory freed while peers' transfers into it still run: given back when they end")
                        self._later.append((epoch, release))
                        return False
                    self._cond.wait(left)
            finally:
                self._waiting -= 1
        release()
        return True
