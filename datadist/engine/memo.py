"""Bounded memories of the small-call fast paths (handles per call shape, plans per block
list, admitted request frames): plain dicts in insertion order, the oldest entry dropped
when full.  Lookups are one ``dict.get`` and need no lock; entries are immutable, so a
race between threads at worst drops or adds one entry more."""
from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

__all__ = ["remember"]

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


def remember(memory: dict[_K, _V], key: _K, value: _V, limit: int) -> None:
    """``memory[key] = value``, first dropping the oldest entry if ``key`` is new and
    ``memory`` holds ``limit`` entries already (another thread may change it meanwhile: then nothing or a
    different entry is dropped, never an error)."""
    if len(memory) >= limit and key not in memory:
        try:
            del memory[next(iter(memory))]
        except (KeyError, RuntimeError, StopIteration):
            pass
    memory[key] = value
