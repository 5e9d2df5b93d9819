"""How long a thread waiting for a peer polls (spins) before it sleeps.

A reply on a loopback or fast link often comes within tens of microseconds, and a thread
that sleeps in ``poll`` pays a wake-up that costs about as much: spinning first halves the
latency of small calls.  But a spin holds a CPU, and when more threads are runnable than
there are cores it takes that CPU from the threads that would make progress, often the
very peer or agent that is to answer (eight decoders pulling from one prompt on two cores
ran 25-30 % slower with spinning callers and agent).  So each wait decides from
measurement, not from a fixed budget:

* the machine (:class:`Load`): the runnable threads of the whole system (the fourth field
  of ``/proc/loadavg``, sampled at most every :data:`SAMPLE_S`) against the cores this
  process may run on.  More runnable threads than cores: no spin, the waiter sleeps at once
  (the count includes the waiter itself and any spinner);
* the waiter's own recent waits (:class:`SpinPolicy`): after :data:`MISSES` spins in a row
  that did not catch the reply (sparse traffic, or answers that take longer than the spin),
  only every :data:`PROBE`-th wait spins, until one catches it again.

The decisions are pure (:meth:`SpinPolicy.spin_us`, :func:`oversubscribed`); only
:class:`Load` reads the system.  Counters are plain ints touched by the thread that waits
(a link's requests take turns; the agent is one thread): a lost update costs one wrong
guess, never a wrong result.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

__all__ = ["SpinPolicy", "Load", "LOAD", "oversubscribed", "runnable_of", "MISSES", "PROBE", "SAMPLE_S"]

#: Spins in a row that caught nothing before a waiter spins only every ``PROBE``-th wait.
MISSES, PROBE = 4, 8
#: Longest age of the machine's runnable count a decision uses, in seconds.
SAMPLE_S = 0.002


def oversubscribed(runnable: int, cores: int) -> bool:
    """Whether ``runnable`` threads (the asking one among them) want more than ``cores``
    CPUs: a spin would then keep one of them from running.  One core is always
    oversubscribed for a spinner: the peer it waits for needs that core."""
    return cores < 2 or runnable > cores


def runnable_of(loadavg: bytes) -> Optional[int]:
    """The runnable scheduling entities of ``/proc/loadavg``'s text (``"0.5 0.4 0.3 3/512
    1234"`` -> 3); None for text not of that form."""
    fields = loadavg.split()
    if len(fields) < 4 or b"/" not in fields[3]:
        return None
    head = fields[3].split(b"/", 1)[0]
    return int(head) if head.isdigit() else None


class Load:
    """The machine's runnable threads and this process's cores, sampled at most every
    ``every_s`` seconds (one ``pread`` of ``/proc/loadavg``, a few microseconds).  Without
    that file (not Linux, or no procfs) the count is 0: spinning is then decided by the
    waits' outcomes alone, as before this measure existed."""

    def __init__(self, path: str = "/proc/loadavg", every_s: float = SAMPLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._clock = clock
        self._next = 0.0
        self._runnable = 0
        try:
            self._fd: Optional[int] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def runnable(self) -> int:
        """Runnable threads of the machine, at most ``every_s`` old."""
        now = self._clock()
        if self._fd is not None and now >= self._next:
            self._next = now + self.every_s
            try:
                got = runnable_of(os.pread(self._fd, 128, 0))
            except OSError:
                got = None
            self._runnable = 0 if got is None else got
        return self._runnable

    def busy(self) -> bool:
        """Whether the machine is :func:`oversubscribed` now."""
        return oversubscribed(self.runnable(), self.cores)


#: The process's one view of the machine (shared by every link and the agent).
LOAD = Load()


class SpinPolicy:
    """One waiter's spin decisions: how long its next wait spins (:meth:`spin_us`), learning
    from whether its spins caught what they waited for (:meth:`caught`, :meth:`missed`)."""

    __slots__ = ("budget_us", "misses", "turn")

    def __init__(self, budget_us: int) -> None:
        self.budget_us = budget_us
        self.misses = 0   # spins in a row that caught nothing
        self.turn = 0     # waits decided

    def spin_us(self, busy: bool) -> int:
        """Microseconds the next wait spins: 0 on a ``busy`` (oversubscribed) machine, 0
        on all but every :data:`PROBE`-th wait after :data:`MISSES` misses in a row, else
        the budget."""
        self.turn += 1
        if busy or self.budget_us <= 0:
            return 0
        if self.misses >= MISSES and self.turn % PROBE:
            return 0
        return self.budget_us

    def caught(self) -> None:
        """A spin caught what it waited for."""
        self.misses = 0

    def missed(self) -> None:
        """A spin ended with nothing to read."""
        self.misses += 1

    def spun(self, caught: bool) -> bool:
        """Learn whether a spin ``caught`` what it waited for; returns ``caught``."""
        if caught:
            self.caught()
        else:
            self.missed()
        return caught

    def outcome(self, spun_us: int, waited_us: float) -> None:
        """Learn from a wait that spun ``spun_us`` and took ``waited_us`` in all: a wait no
        longer than its spin was caught by it; one that spun nothing teaches nothing."""
        if spun_us > 0:
            self.spun(waited_us <= spun_us)
