"""Which CPUs the threads a connector starts inside a serving engine may run on.

A thread inherits the CPU affinity of the thread that starts it.  A CPU serving engine
pins its model thread to one core (vLLM binds its OpenMP threads, the main thread
included, one per core), so a connector that starts its threads from the model thread
(the datadist agent, which answers every peer's link and lookup, and the pull thread)
would keep them on that one core, beside the model's compute and whatever else is pinned
there.  Seen on a 2-core machine with two vLLM instances, both pinned to the same cores:
the spinning model thread of the decode instance kept the prefill instance's agent, on
the same core, from running for over a minute, and every link to it timed out while the
other core was free.

:func:`on_instance_cpus` starts such threads on every CPU the engine's threads use (the
union of their affinities), so the kernel may run them on any core the instance owns,
never on one it does not.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["instance_cpus", "on_instance_cpus"]


def instance_cpus() -> frozenset[int]:
    """The CPUs the threads of this process may run on: the union of their affinities
    (the calling thread's alone where threads cannot be listed)."""
    cpus: set[int] = set(os.sched_getaffinity(0))
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return frozenset(cpus)
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return frozenset(cpus)


@contextlib.contextmanager
def on_instance_cpus() -> Iterator[frozenset[int]]:
    """Within the block, the calling thread (and every thread it starts) may run on
    :func:`instance_cpus`; the calling thread's own affinity is restored on leaving.
    Yields the CPUs the started threads get.  Without ``sched_setaffinity`` (not Linux)
    nothing changes."""
    if not hasattr(os, "sched_setaffinity"):
        yield frozenset()
        return
    own = os.sched_getaffinity(0)
    wide = instance_cpus()
    if wide <= own:
        yield frozenset(own)
        return
    os.sched_setaffinity(0, wide)
    try:
        yield wide
    finally:
        os.sched_setaffinity(0, own)
