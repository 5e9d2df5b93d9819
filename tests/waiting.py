"""Waiting in tests for another thread to reach a state that has no event to wait on
(a caller queued inside a lock, for instance): the CPU is yielded, never slept away, and
the wait fails at a deadline."""
from __future__ import annotations

import os
import time
from typing import Callable

__all__ = ["until"]


def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Yield the CPU until ``predicate`` holds (a thread reached its wait); fail at ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        os.sched_yield()
