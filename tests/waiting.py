"""The one way tests wait for a state that has no event to wait on: a thread queued inside
a lock, a child process that stopped, a server's count that catches up.  Every wait has a
deadline, and fails naming what it waited for."""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, TypeVar, Union

__all__ = ["until", "PACED"]

_T = TypeVar("_T")

#: ``every`` for asking another process or a server, each ask costing it work (seconds).
PACED = 0.02


def until(predicate: Callable[[], _T], timeout: float = 10.0, what: Union[str, Callable[[], str]] = "condition",
          every: float = 0.0) -> _T:
    """Ask ``predicate`` until it returns something true, and return that; fail at
    ``timeout`` seconds with ``what`` (a callable: asked then, to say what was left).

    ``every`` paces the asks: 0 yields the CPU between them (for a thread of this
    process, which reaches its state within microseconds); more waits that many seconds
    (for another process or a server, which an ask costs work and which a busy asker
    would slow down on a shared machine)."""
    deadline = time.monotonic() + timeout
    pace = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g} s: {what() if callable(what) else what}")
        if every > 0:
            pace.wait(min(every, max(0.0, deadline - time.monotonic())))
        else:
            os.sched_yield()
