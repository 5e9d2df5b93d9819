"""The key set a daemon publishes per tenant, so clients answer ``exists`` from memory.

The daemon keeps, next to each tenant's arena, a table of the fingerprints of every key
its memory holds (values being spilled included) in a memfd of its own; the HELLO reply
passes it with the arena and clients map it read-only.  ``exists`` then costs a few
cache misses instead of a round trip through the daemon.  The table is advisory in the
same way a round trip is: a value may be evicted right after either answer.  Clients
still ask the daemon when the table is not usable (a rebuild in progress, or more keys
than it was sized for) and for keys memory lacks when the daemon has lower tiers.

The C side (``_keyset``) defines the layout, the fingerprint and the seqlock; this module
sizes and owns the memory.  One writer (the daemon's store, under its lock).
"""
from __future__ import annotations

import mmap
from typing import Any, Callable, Dict, List, Optional, Sequence

from datadist.engine.memory import Arena, check_fixed_size

from . import _keyset

__all__ = ["KeySet", "KeySetView", "slots_for"]

_HEADER_WORDS = 8


def slots_for(max_keys: int) -> int:
    """Slots (a power of two) that hold ``max_keys`` within the 3/4 load the table allows."""
    want = max(64, max_keys + max_keys // 3 + 1)
    return 1 << (want - 1).bit_length()


class KeySet:
    """The writer: a table in a fresh memfd that ``fd`` names (pass it to clients)."""

    def __init__(self, name: str, max_keys: int) -> None:
        self.nslots = slots_for(max_keys)
        self.size = (_HEADER_WORDS + self.nslots) * 8
        # Clients map it read-only; the kernel refuses them any write (a scribbled table would
        # fail the store's key-set calls for the tenant).
        self._arena = Arena(name, self.size, others_read_only=True)
        self._table: Optional[memoryview] = self._arena.view()
        _keyset.init(self._table)
        self.overflowed = False  # more keys than fit: readers ask the daemon until they do
        self.withdrawn = False  # invalidated for good (the daemon is closing)

    @property
    def fd(self) -> int:
        return self._arena.fd

    @property
    def _live(self) -> memoryview:
        """The table; TypeError once closed (as the C side raises for a released table)."""
        if self._table is None:
            raise TypeError("the key set is closed")
        return self._table

    def add(self, key: str, present: Callable[[], List[str]]) -> None:
        """Publish ``key``; ``present()`` lists every present key in case the table must
        be rebuilt (tombstones piled up) -- called rarely, never per key."""
        if self.withdrawn or self.overflowed or _keyset.add(self._live, key) >= 0:
            return
        self.rebuild(present())

    def discard(self, key: str, present_count: int, present: Callable[[], List[str]]) -> None:
        """Withdraw ``key``; an overflowed table comes back once the keys fit again."""
        if self.withdrawn:
            return
        if not self.overflowed:
            _keyset.discard(self._live, key)
        elif present_count <= self.nslots // 2:
            self.rebuild(present())

    def rebuild(self, keys: Sequence[str]) -> None:
        """Hold exactly ``keys``; past the table's load readers are told to ask the daemon."""
        if self.withdrawn:
            return
        _keyset.rebuild(self._live, keys)
        self.overflowed = _keyset.stats(self._live)[3] != 1

    def stats(self) -> Dict[str, Any]:
        nslots, live, used, valid = _keyset.stats(self._live)
        return {"slots": nslots, "keys": live, "tombstones": used - live, "published": bool(valid)}

    def invalidate(self) -> None:
        """Tell readers to stop trusting the table for good (they ask the daemon instead)."""
        _keyset.invalidate(self._live)
        self.withdrawn = True

    def close(self) -> None:
        """Invalidate, then free the table."""
        if self._table is None:
            return
        self.invalidate()
        self._table.release()
        self._table = None
        self._arena.close()


class KeySetView:
    """A client's read-only mapping of a daemon's key set."""

    def __init__(self, fd: int, size: int) -> None:
        check_fixed_size(fd, size)  # the daemon's own seal: nobody can shrink it under us
        self._mm: Optional[mmap.mmap] = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        _keyset.stats(self._mm)  # raises ValueError unless it is an initialised table

    @property
    def _live(self) -> mmap.mmap:
        """The mapping; TypeError once closed (as the C side raises for ``None``)."""
        if self._mm is None:
            raise TypeError("the key set view is closed")
        return self._mm

    def count(self, keys: Sequence[str]) -> Optional[int]:
        """Leading ``keys`` present, or None when the table cannot answer now."""
        n = _keyset.count_keys(self._live, keys)
        return None if n < 0 else n

    def count_ints(self, prefix: bytes, hashes: Sequence[int], suffix: bytes) -> Optional[int]:
        """``count`` of the keys ``prefix + format(h, "x") + suffix`` without building them;
        raises OverflowError for a hash outside [0, 2**64)."""
        n = _keyset.count_ints(self._live, prefix, hashes, suffix)
        return None if n < 0 else n

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            mm.close()

