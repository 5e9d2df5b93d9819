"""Shared-memory arenas: one anonymous memfd per tenant, and a first-fit allocator.

The memfd has no name in any filesystem, so a killed daemon leaves nothing behind: the
memory is freed when the last descriptor and mapping (the daemon's, its clients') go.
Clients receive the descriptor over the unix socket (SCM_RIGHTS) and map it, which is
what makes a save or load one copy between the KV cache and the pool.

Allocations are page-aligned.  Freed ranges keep their pages: every process that maps the
arena has already faulted them in, and a fresh page costs about a microsecond per 4 KiB in
each process (several times the copy itself), so reuse is what keeps saves at memory speed.
Resident memory is therefore the arena's high-water mark, at most ``size``.
"""
from __future__ import annotations

import bisect
import mmap
import os
from typing import List, Optional

import numpy as np

__all__ = ["Arena", "Allocator", "PAGE", "round_up"]

PAGE = 4096


def round_up(n: int, align: int = PAGE) -> int:
    """``n`` rounded up to a multiple of ``align`` (at least one page)."""
    return max(align, (n + align - 1) // align * align)


class Allocator:
    """First-fit allocator over ``[0, size)`` with coalescing free extents."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: List[int] = [0]
        self._lens: List[int] = [size]

    def alloc(self, n: int) -> Optional[int]:
        """Offset of ``n`` free bytes (``n`` page-aligned), or None."""
        for i, length in enumerate(self._lens):
            if length >= n:
                off = self._starts[i]
                if length == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += n
                    self._lens[i] -= n
                return off
        return None

    def free(self, off: int, n: int) -> None:
        """Give back ``[off, off + n)``; merges with neighbours."""
        i = bisect.bisect_left(self._starts, off)
        if i < len(self._starts) and self._starts[i] < off + n:
            raise AssertionError(f"double free of [{off}, {off + n})")
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] > off:
            raise AssertionError(f"double free of [{off}, {off + n})")
        merge_left = i > 0 and self._starts[i - 1] + self._lens[i - 1] == off
        merge_right = i < len(self._starts) and self._starts[i] == off + n
        if merge_left and merge_right:
            self._lens[i - 1] += n + self._lens[i]
            del self._starts[i], self._lens[i]
        elif merge_left:
            self._lens[i - 1] += n
        elif merge_right:
            self._starts[i] = off
            self._lens[i] += n
        else:
            self._starts.insert(i, off)
            self._lens.insert(i, n)

    @property
    def free_bytes(self) -> int:
        return sum(self._lens)

    @property
    def largest_free(self) -> int:
        return max(self._lens, default=0)


class Arena:
    """A tenant's memfd of ``size`` bytes, mapped in the daemon, with its allocator."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.fd = os.memfd_create(f"ems-{name or 'open'}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._mm)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.allocator = Allocator(size)
        self._closed = False

    def alloc(self, n: int) -> Optional[int]:
        return self.allocator.alloc(n)

    def free(self, off: int, n: int) -> None:
        self.allocator.free(off, n)

    def close(self) -> None:
        """Unmap and close the memfd (clients' own mappings stay valid until they unmap)."""
        if self._closed:
            return
        self._closed = True
        del self.array
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass  # a slice is still referenced somewhere; the mapping goes with it
        os.close(self.fd)
