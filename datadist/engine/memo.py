"""Bounded memories of the small-call fast paths (handles per call shape, plans per block
list, admitted request frames): plain dicts in insertion order, the oldest entry dropped
when full (:func:`remember`), or when the entries' weights would pass a budget
(:class:`Weighed`: plans of long block lists hold arrays as long as their lists).  Lookups
are one ``dict.get`` and need no lock; entries are immutable, so a race between threads at
worst drops or adds one entry more."""
from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, Optional, TypeVar

__all__ = ["remember", "Weighed"]

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


class Weighed(Generic[_K, _V]):
    """At most ``limit`` entries whose weights add up to at most ``budget``; the oldest go
    first.  An entry heavier than the whole budget is not kept."""

    __slots__ = ("values", "_weights", "_total", "limit", "budget")

    def __init__(self, limit: int, budget: int) -> None:
        self.values: dict[_K, _V] = {}
        self._weights: dict[_K, int] = {}
        self._total = 0  # the weights' sum, kept as they come and go (not summed per put)
        self.limit = limit
        self.budget = budget

    def get(self, key: _K) -> Optional[_V]:
        return self.values.get(key)

    def put(self, key: _K, value: _V, weight: int) -> None:
        if weight > self.budget:
            return
        try:
            self._total -= self._weights.pop(key, 0)
            while self._weights and (self._total + weight > self.budget or len(self._weights) >= self.limit):
                oldest = next(iter(self._weights))
                self._total -= self._weights.pop(oldest)
                self.values.pop(oldest, None)
        except (KeyError, RuntimeError, StopIteration):
            pass  # another thread changed it meanwhile: at worst one entry too many or too few
        if not self._weights:
            self._total = 0  # what a race between threads may have skewed starts afresh
        self._weights[key] = weight
        self._total += weight
        self.values[key] = value

    def clear(self) -> None:
        self.values.clear()
        self._weights.clear()
        self._total = 0

    def __len__(self) -> int:
        return len(self.values)
