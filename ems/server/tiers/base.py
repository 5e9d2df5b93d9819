"""The ``Tier`` interface: where values go when they leave (or bypass) the memory arena.

Calls, in the order the store makes them, all from daemon worker threads without the
store's lock held (a tier does its own locking):

1. ``store(ns, key, data, checksum)`` when a value is evicted to this tier (disk) or
   written through (remote); ``retire``/``retire_many`` when a new value of a key is
   being saved (its older copy must never be filled back, even if that save fails).
2. ``exists(ns, keys)`` for EXISTS requests that miss memory.
3. ``load(ns, key, sink)`` when a GET misses memory: the tier finds the value, asks
   ``sink(size)`` for a destination (arena memory) and fills it; the store checks the
   checksum returned and calls ``discard`` if it does not match.
4. ``close()`` at shutdown (idempotent).

``ns`` is the tenant's name ("" when the daemon runs open); ``key`` the wire key.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["Tier", "Sink", "tier_key"]

#: ``sink(size)`` -> a writable buffer of exactly ``size`` bytes, or None (no room).
Sink = Callable[[int], Optional[memoryview]]


def tier_key(ns: str, key: str) -> str:
    """A fixed-length name for (tenant, key), safe in file names and Redis keys."""
    return hashlib.blake2b(f"{ns}\x00{key}".encode(), digest_size=20).hexdigest()


class Tier(ABC):
    """A store of checksummed values below the memory arena."""

    name = "tier"

    @abstractmethod
    def store(self, ns: str, key: str, data: memoryview, checksum: int,
              current: Callable[[], bool] = lambda: True) -> bool:
        """Keep a copy of ``data``; False if the tier cannot take it, or if ``current()``
        says, right before the copy would replace the one kept, that this value is no longer
        the key's (a newer one was committed while it was written)."""

    @abstractmethod
    def exists(self, ns: str, keys: Sequence[str]) -> List[bool]:
        """Which of ``keys`` the tier holds (a fault reads as absent)."""

    @abstractmethod
    def load(self, ns: str, key: str, sink: Sink) -> Optional[int]:
        """Copy the value into ``sink(size)``; its stored checksum, or None on a miss."""

    @abstractmethod
    def discard(self, ns: str, key: str) -> None:
        """Forget a value (it was found corrupted)."""

    def retire(self, ns: str, key: str) -> None:
        """Forget the copy of ``key``, if any: a newer value of it was committed above this
        tier, and this copy must never be filled back.  The default forgets it as
        :meth:`discard` does; a tier with its own locking overrides it."""
        self.discard(ns, key)

    def retire_many(self, ns: str, keys: Sequence[str]) -> None:
        """:meth:`retire` each of ``keys`` (a tier that can batch them overrides this)."""
        for key in keys:
            self.retire(ns, key)

    def contains(self, ns: str, key: str) -> bool:
        """Cheap membership test (defaults to ``exists``)."""
        return self.exists(ns, [key])[0]

    def health(self) -> Optional[str]:
        """Why the tier cannot serve now (``/healthz``), or None when it can."""
        return None

    def stats(self) -> Dict[str, Any]:
        """Counters for ``ems-server stats``."""
        return {}

    def close(self) -> None:
        """Release connections and files (idempotent)."""
