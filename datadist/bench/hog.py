"""``--hog N`` of the benches: N busy processes beside the measured ones, each spinning in a
loop of its own, so that more threads want the CPU than a small machine has cores (what a
prompt serving many decoders, or an engine sharing its cores with model work, looks like)."""
from __future__ import annotations

import multiprocessing as mp
import os
from types import TracebackType
from typing import Any, List, Optional, Type

__all__ = ["Hog", "set_nice"]

#: Longest wait for a hog process to start spinning, in seconds.
_START_S = 60.0


def set_nice(n: int) -> None:
    """Run this process's calling thread, and every thread and process it starts after,
    at niceness ``n`` (-20..19; Linux keeps one per thread, inherited by what the thread
    starts).  PermissionError where ``n`` raises priority without the right to."""
    if not -20 <= n <= 19:
        raise ValueError(f"niceness must be in [-20, 19], not {n}")
    os.setpriority(os.PRIO_PROCESS, 0, n)


def _spin(started: Any) -> None:
    """Child: at the default niceness (whatever the bench's), say so, then burn CPU until
    killed."""
    os.setpriority(os.PRIO_PROCESS, 0, 0)
    started.set()
    while True:
        pass


class Hog:
    """Context manager: ``n`` busy processes run while the block runs (none for 0)."""

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"hog must be at least 0, not {n}")
        self.n = n
        self._processes: List[Any] = []

    def __enter__(self) -> "Hog":
        ctx = mp.get_context("spawn")
        for _ in range(self.n):
            started = ctx.Event()
            p = ctx.Process(target=_spin, args=(started,), daemon=True)
            p.start()
            self._processes.append(p)
            if not started.wait(_START_S):
                self.__exit__(None, None, None)
                raise RuntimeError(f"a hog process did not start within {_START_S:.0f} s")
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        for p in self._processes:
            p.kill()
        for p in self._processes:
            p.join(10)
        self._processes = []
