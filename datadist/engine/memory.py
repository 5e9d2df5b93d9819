"""Shared memory the engine owns: memfd arenas, the page allocator over them, and views
of a same-host peer's arenas.

Arenas are anonymous (``memfd_create``): they never appear in ``/dev/shm``, so a killed
process leaves nothing behind, and the kernel frees the memory when the last mapping and
descriptor are gone.  A same-host peer maps an arena by opening ``/proc/<pid>/fd/<fd>``
of the owner, which needs the same user (the ptrace read check), and keeps its mapping
alive even if the owner dies.  Every arena's size is sealed (``F_SEAL_SHRINK``,
``F_SEAL_GROW``) before anyone maps it, and a mapping of another process's descriptor is
refused unless it is so sealed: a process holding the descriptor (a peer, a pool client
it was passed to) could otherwise shrink the file under the others' mappings, and their
next copy into the lost pages would fault (``SIGBUS``) instead of failing.  So a one-sided
copy can never fault.  A process handed an arena's descriptor (over a unix socket, say)
maps it with :class:`SharedMapping`.
"""
from __future__ import annotations

import bisect
import ctypes
import fcntl
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol

__all__ = ["Arena", "InvalidFree", "check_fixed_size", "IpcRegion", "PeerArena", "PeerSpan", "PoolAllocator", "PoolExhausted", "PoolMemory",
           "SharedMapping", "bytes_view", "round_to_pages"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_PROT_RW = 0x1 | 0x2
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value
#: ``F_SEAL_FUTURE_WRITE`` of <linux/fcntl.h> (Linux 5.1), which Python's fcntl does not name.
_SEAL_FUTURE_WRITE = 0x0010
#: The seals of every arena: its size is fixed for good (a seal is never removed).
_SEALS_FIXED_SIZE = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_SEALS_OTHERS_READ_ONLY = _SEAL_FUTURE_WRITE | _SEALS_FIXED_SIZE | fcntl.F_SEAL_SEAL


def check_fixed_size(fd: int, size: int) -> None:
    """Raise ``OSError`` unless the file of ``fd`` holds at least ``size`` bytes and is
    sealed against shrinking (what makes a shared mapping of it safe from its other
    holders)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:  # EINVAL: a file that cannot be sealed (not a memfd)
        raise OSError(exc.errno, f"shared memory of {size} bytes that cannot be sealed: {exc.strerror}") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise OSError(f"shared memory of {size} bytes that its other holders may shrink (no F_SEAL_SHRINK)")
    held = os.fstat(fd).st_size
    if held < size:
        raise OSError(f"shared memory is smaller than announced ({held} < {size} bytes)")


def _map(fd: int, size: int) -> int:
    addr: Optional[int] = _libc.mmap(None, size, _PROT_RW, _MAP_SHARED, fd, 0)  # c_void_p: None for NULL
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    return addr


def bytes_view(addr: int, size: int) -> memoryview:
    """A writable memoryview over raw memory (no copy); valid while the memory is."""
    return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")


class SharedMapping:
    """``size`` bytes of a file descriptor mapped shared and writable into this process.

    ``base`` is the mapping's address here.  ``view()`` hands out the same memory as Python
    buffers (``memoryview``, ``numpy.frombuffer``).  The caller may close ``fd`` once it is
    mapped.  ``close()`` is idempotent and unmaps at once unless a view is still alive;
    then the memory stays mapped until the last view is gone, so a straggling reader of a
    view never faults.  Raw addresses are invalid after ``close()``.
    """

    def __init__(self, fd: int, size: int) -> None:
        """Map ``fd``; ``OSError`` unless it is at least ``size`` bytes and sealed against
        shrinking (:func:`check_fixed_size`)."""
        self.size = int(size)
        check_fixed_size(fd, self.size)
        self._mm: mmap.mmap | None = mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                                               mmap.PROT_READ | mmap.PROT_WRITE)
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(anchor)
        del anchor  # it is a buffer export: while it lived, close() could not unmap

    def contains(self, addr: int, nbytes: int = 0) -> bool:
        return self.base <= addr and addr + nbytes <= self.base + self.size

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """A writable view of bytes ``[offset, offset + nbytes)`` (to the end when ``nbytes``
        is None); raises ``ValueError`` outside the mapping or once it is closed."""
        end = self.size if nbytes is None else offset + nbytes
        if not 0 <= offset <= end <= self.size:
            raise ValueError(f"[{offset}, {end}) is outside the {self.size}-byte mapping")
        if self._mm is None:
            raise ValueError("the mapping is closed")
        return memoryview(self._mm)[offset:end]

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the last one


class Arena(SharedMapping):
    """A memfd-backed shared memory region mapped into this process.

    ``fd`` stays open for the arena's life so that same-host peers can open
    ``/proc/<pid>/fd/<fd>`` (or receive it over a socket).  ``close()`` is idempotent;
    memory handed out from the arena is invalid afterwards (views: see
    :class:`SharedMapping`).
    """

    #: What the pool's caches are (as :class:`~datadist.engine.cuda.DeviceArena` has them):
    #: host memory, which same-host peers map through the fd, not by CUDA IPC.
    device = "cpu"
    regions: tuple["IpcRegion", ...] = ()

    def __init__(self, name: str, size: int, *, others_read_only: bool = False) -> None:
        """``others_read_only``: only this mapping may write; every mapping or write made
        through ``fd`` later (a process it is passed to) is refused by the kernel
        (``F_SEAL_FUTURE_WRITE``), its size is fixed, and the seals are final."""
        if size <= 0:
            raise ValueError(f"arena size must be > 0, got {size}")
        self.name = name
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, int(size))
            # Final at once (F_SEAL_SEAL) unless the read-only seal is still to come: a holder
            # that added one (F_SEAL_FUTURE_WRITE) would make every later mapping fail.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS_FIXED_SIZE | (0 if others_read_only else fcntl.F_SEAL_SEAL))
            super().__init__(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self._closed = False
        if others_read_only:
            try:  # after this process's own writable mapping, which the seal leaves writable
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS_OTHERS_READ_ONLY)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        super().close()
        os.close(self.fd)


@dataclass(frozen=True)
class IpcRegion:
    """An exported device allocation: peers on this host map it with ``handle``
    (:mod:`.cuda` makes and opens them; here, with the other descriptions of memory a peer
    reaches, so that a module naming one needs no CUDA)."""

    handle: bytes
    base: int
    size: int

    def to_wire(self) -> dict[str, str | int]:
        return {"handle": self.handle.hex(), "base": self.base, "size": self.size}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "IpcRegion":
        return cls(bytes.fromhex(d["handle"]), int(d["base"]), int(d["size"]))


@dataclass
class PeerSpan:
    """Memory of a peer that this process reaches: ``size`` bytes at ``remote_base`` in
    the peer and at ``local_base`` here."""

    remote_base: int
    local_base: int
    size: int

    def translate(self, remote_addr: int, nbytes: int = 0) -> int | None:
        """The local address of ``remote_addr`` or None if the span is not all inside."""
        off = remote_addr - self.remote_base
        if 0 <= off and off + nbytes <= self.size:
            return self.local_base + off
        return None


@dataclass
class PeerArena(PeerSpan):
    """A peer's arena mapped here."""

    @classmethod
    def open(cls, pid: int, fd: int, size: int, remote_base: int) -> "PeerArena":
        """Map arena ``fd`` of process ``pid``; raises ``OSError`` if it cannot be reached."""
        if type(fd) is not int or fd < 0:  # a path of /proc is made of it
            raise OSError(f"peer arena descriptor {fd!r} is not a descriptor number")
        local_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            try:
                check_fixed_size(local_fd, size)
            except OSError as exc:
                raise OSError(f"peer arena /proc/{pid}/fd/{fd}: {exc}") from None
            local = _map(local_fd, size)
        finally:
            os.close(local_fd)
        return cls(remote_base, local, size)

    def close(self) -> None:
        if self.local_base:
            _libc.munmap(self.local_base, self.size)
            self.local_base = 0


class PoolExhausted(Exception):
    """No free extent is large enough for the request."""


class InvalidFree(RuntimeError):
    """A checked free of memory that is not one live allocation (a double free or a wrong
    size): a bug in the caller."""


def round_to_pages(nbytes: int, page: int) -> int:
    """``nbytes`` rounded up to whole pages of ``page`` bytes, at least one page."""
    return max(page, -(-int(nbytes) // page) * page)


class PoolMemory(Protocol):
    """What a :class:`PoolAllocator` hands out pages of: ``size`` bytes at ``base`` in
    this process, of kind ``device`` (``"cpu"``, ``"cuda:N"``, ``"npu:N"``), with the CUDA
    IPC regions same-host peers map (none for host or NPU memory).  :class:`Arena`,
    :class:`~datadist.engine.cuda.DeviceArena` and :class:`~datadist.engine.npu.NpuArena`."""

    @property
    def base(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def regions(self) -> tuple["IpcRegion", ...]: ...


class PoolAllocator:
    """First-fit page allocator over an arena, thread-safe.

    Requests are rounded up to ``2**page_shift`` bytes.  Free extents are kept sorted by
    offset and merged with their neighbours on free, so fragmentation stays bounded by the
    allocation pattern, not by history.  Freed memory is only marked free, never handed
    back to the kernel: pages already faulted in stay resident and are reused without a
    fault.

    Two interfaces share the extents.  By address, for memory used in place: ``alloc``
    raises :class:`PoolExhausted`, ``free`` ignores what it does not know.  By offset into
    the arena, for callers that treat a full pool as routine (evict, then retry) and share
    offsets with other processes: ``alloc_offset`` returns None, ``free_offset`` raises
    :class:`InvalidFree` on a double free.
    """

    def __init__(self, arena: PoolMemory, page_shift: int = 16) -> None:
        self.arena = arena
        self.page = 1 << page_shift
        usable = arena.size - arena.size % self.page
        self.size_bytes = usable  # what allocations may take (whole pages)
        self._starts: list[int] = [0] if usable else []
        self._sizes: list[int] = [usable] if usable else []
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes)

    def alloc(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (rounded up to a page); returns the address in this process."""
        need = round_to_pages(nbytes, self.page)
        with self._lock:
            start = self._take(need)
            if start is not None:
                return self.arena.base + start
            free, extents = sum(self._sizes), len(self._sizes)
        raise PoolExhausted(f"no free extent of {need} bytes (free {free} bytes in {extents} "
                            f"extents of a {self.arena.size}-byte pool)")

    def alloc_offset(self, nbytes: int) -> int | None:
        """Reserve ``nbytes`` (rounded up to a page); returns its offset in the arena, or
        None when no free extent is large enough."""
        need = round_to_pages(nbytes, self.page)
        with self._lock:
            return self._take(need)

    def free(self, addr: int) -> None:
        """Return an allocation; unknown addresses are ignored (double free is a no-op)."""
        start = addr - self.arena.base
        with self._lock:
            size = self._used.pop(start, None)
            if size is not None:
                self._give(start, size)

    def free_offset(self, offset: int, nbytes: int) -> None:
        """Return the allocation of ``nbytes`` (rounded up to a page) at ``offset``; raises
        :class:`InvalidFree`, changing nothing, unless exactly that allocation is live."""
        size = round_to_pages(nbytes, self.page)
        with self._lock:
            if self._used.get(offset) != size:
                raise InvalidFree(f"free of [{offset}, {offset + size}), which is not one live "
                                  f"allocation (a double free?)")
            del self._used[offset]
            self._give(offset, size)

    def _take(self, need: int) -> int | None:
        """First fit (lock held): the offset of ``need`` bytes, or None."""
        for i, size in enumerate(self._sizes):
            if size >= need:
                start = self._starts[i]
                if size == need:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += need
                    self._sizes[i] -= need
                self._used[start] = need
                return start
        return None

    def _give(self, start: int, size: int) -> None:
        """Insert a freed extent and merge it with its neighbours (lock held)."""
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and start + size == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:
            self._sizes[i - 1] += self._sizes.pop(i)
            self._starts.pop(i)
