"""Type stub of the C extension ``datadist.engine._native`` (its sources: ``csrc/``).

Every function is ``METH_FASTCALL`` without keywords: arguments are positional only.  A
plan is five uint64 arrays (C-contiguous; only their byte length is checked, a multiple
of 8): ``T`` base addresses per side and ``U`` runs (offsets per side, lengths); see
:class:`datadist.engine.layout.Plan`.  The calls release the GIL while they run.  Errors
of the system come back as ``OSError`` with the kernel's errno; ``ValueError`` for plan
arrays that are not uint64 or disagree in length.  :mod:`datadist.engine.native` wraps
these for the rest of the package.
"""
import sys
from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

_U64Array = NDArray[np.uint64]
#: Any object with the buffer protocol.  numpy declares ``ndarray.__buffer__`` for Python
#: 3.12 on only, and mypy checks for 3.11 (pyproject.toml), so arrays are named as well.
_Buffer = Buffer | NDArray[Any]

def peer_closed(fd: int, /) -> bool:
    """Whether the stream on ``fd`` has ended (peer closed or reset); never waits."""

def moves_now(fd: int, push: bool, need: int, /) -> bool:
    """Whether a push's ``need`` bytes have all arrived on ``fd``, or a pull's fit half of
    its free send buffer."""

def frame_arrived(fd: int, whole_max: int, /) -> int:
    """How far the next frame on ``fd`` has arrived: -1 nothing, 0 part, 1 whole (or the
    end of the stream, an error), 2 a frame over ``whole_max`` whose header is in."""

def spin_readable(fd: int, spin_us: int, /) -> bool:
    """Whether ``fd`` becomes readable within ``spin_us`` (polled without sleeping)."""

class IntKey:
    """A list of exact ints as a hashable key (its values as int64 and their hash)."""
    def __hash__(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...

def int_key(seq: object, limit: int, /) -> IntKey | None:
    """A list or tuple of exact ints (at most ``limit``) as an :class:`IntKey`; None otherwise."""

def index_array(seq: object, /) -> tuple[bytearray, int, int] | None:
    """``(int64 bytes, min, max)`` of an exact ``list`` or ``tuple`` of ints (``min > max``
    when empty); None for any other type.  ``TypeError`` for an entry that is not an int
    (bools are not), ``OverflowError`` for one outside int64."""

def recv_exact(fd: int, buffer: _Buffer, timeout_ms: int, /) -> int:
    """Fill the whole writable, C-contiguous ``buffer`` from the non-blocking socket ``fd``;
    returns the bytes read.  ``OSError`` ETIMEDOUT, or ECONNRESET at the end of the stream."""

def wait_readable(fd: int, spin_us: int, timeout_ms: int, /) -> int:
    """0 once ``fd`` is readable (or hung up), polling ``spin_us`` before sleeping;
    ``OSError`` ETIMEDOUT after ``timeout_ms``."""

def copy_plan(sbase: _U64Array, dbase: _U64Array, soff: _U64Array, doff: _U64Array, len: _U64Array,
              threads: int, timeout_ms: int = 0, /) -> int:
    """Copy every run inside this process (plans of 8 MiB or more over up to ``threads``
    threads, at most 8); returns the bytes copied.  With ``timeout_ms`` > 0 no chunk (at
    most 64 MiB) starts after that time: ``TimeoutError`` (ETIMEDOUT), the destination
    then undefined."""

def sum_blocks(value: _Buffer, sums: _U64Array, /) -> None:
    """Add the two sums of each whole 4 KiB block of ``value`` (C-contiguous) to ``sums``
    (writable uint64, two per block; ``ValueError`` if too short)."""

def sum_stream(data: _Buffer, sums: _U64Array, pos: int, tail: _Buffer | None, tail_start: int, /) -> int:
    """Add ``data`` (C-contiguous), the bytes of a stream from offset ``pos`` on, to its
    block sums as :func:`sock_plan` does; returns ``len(data)``.  ``OSError`` ERANGE
    (nothing added) if it would go past the sums or the tail."""

def copy_plan_sum(sbase: _U64Array, dbase: _U64Array, soff: _U64Array, doff: _U64Array, len: _U64Array,
                  threads: int, sums: _U64Array, value_base: int, value_is_src: bool, /) -> int:
    """``copy_plan`` that also adds the copied bytes into the 4 KiB block sums of the value
    at ``value_base`` (on the source side if ``value_is_src``); ``sums``: writable uint64,
    two per block.  ``OSError`` ERANGE (nothing copied) if a run leaves the value."""

def copy_plan_stream(sbase: _U64Array, dbase: _U64Array, soff: _U64Array, doff: _U64Array, len: _U64Array,
                     threads: int, sums: _U64Array, pos: int, tail: _Buffer | None, tail_start: int, /) -> int:
    """``copy_plan`` that also adds the copied bytes, in plan order, to the block sums of a
    stream (as :func:`sock_plan` sums what it moves; ``pos`` must be 0) and keeps its last
    partial block in ``tail``; returns the bytes copied.  ``OSError`` ERANGE (nothing
    copied) if the plan's bytes do not fit the sums or the tail."""

def sum_plan(base: _U64Array, off: _U64Array, len: _U64Array, sums: _U64Array, pos: int, tail: _Buffer | None,
             tail_start: int, threads: int = 1, /) -> int:
    """Add the runs of a plan half, in plan order, to the block sums of a stream from
    offset ``pos`` on (as :func:`sum_stream` would each run), with up to ``threads``
    threads where it is large and ``pos`` is a multiple of 4096; returns their bytes.
    ``OSError`` ERANGE (nothing added) if they do not fit the sums or the tail."""

def call_plan(fn: int, stream: int, sbase: _U64Array, dbase: _U64Array, soff: _U64Array, doff: _U64Array,
              len: _U64Array, /) -> tuple[int, int]:
    """Call the C function at address ``fn``, ``int fn(dst, src, bytes, stream)``, once
    per run until one returns non-zero; returns ``(bytes issued, status)``.  ``ValueError``
    for a NULL ``fn``."""

def cma_plan(pid: int, write: bool, lbase: _U64Array, rbase: _U64Array, loff: _U64Array, roff: _U64Array,
             len: _U64Array, timeout_ms: int = 0, /) -> int:
    """Cross-memory attach with process ``pid``: local runs to remote ones (``write``) or
    back; returns the bytes moved.  ``OSError`` (ESRCH, EFAULT, EPERM...) on failure,
    ``TimeoutError`` when ``timeout_ms`` (> 0) passed between two batches of runs."""

def sock_plan(fd: int, send: bool, timeout_ms: int, base: _U64Array, off: _U64Array, len: _U64Array,
              head: _Buffer | None = None, sums: _U64Array = ..., pos: int = ..., tail: _Buffer | None = ...,
              tail_start: int = ..., /) -> int:
    """Send (``head`` first, if given) or receive the runs, in order, over the non-blocking
    socket ``fd`` within ``timeout_ms``; returns the payload bytes moved.  ``ValueError``
    for a ``head`` when receiving; ``OSError`` ETIMEDOUT, ECONNRESET... on failure.  With
    ``sums`` (writable uint64, two per 4 KiB block of a stream), the payload is added to
    the block sums as the stream's bytes from offset ``pos`` on, and its bytes from offset
    ``tail_start`` on are copied into ``tail`` (None: none kept); ``OSError`` ERANGE
    (nothing moved) if the payload would go past the sums or the tail."""

def serve_known(fd: int, known: dict[bytes, Any], epoch: int, header_size: int, limit: int, timeout_ms: int,
                answer: bytes, defer: bool, /) -> tuple[Any, ...]:
    """Serve the next frame on ``fd`` if it is a key of ``known`` of the current ``epoch``
    (a summed one of at most 4 MiB summed as it moves; with ``defer``, not a transfer
    whose bytes would wait for the peer)."""

FAST_SUMMED_MAX: int

def request(fd: int, head: Buffer, base: _U64Array | None, off: _U64Array | None, len: _U64Array | None,
            answer_len: int, spin_us: int, timeout_ms: int, summed: bool = ..., /) -> bytes:
    """Write ``head`` and the runs (``summed``: and their checksum, at most
    ``FAST_SUMMED_MAX`` bytes), wait for the answer, return its first ``answer_len`` bytes."""

class RefKey:
    """Two block lists as a hashable key by the identity of their entries."""
    def pinned(self) -> RefKey | None: ...
    def __hash__(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...

def ref_key(a: object, b: object, limit: int, /) -> RefKey | None:
    """A probe key of two lists or tuples (at most ``limit`` entries together); None otherwise."""

def half_extent(bases: _U64Array, offs: _U64Array, lens: _U64Array, /) -> Optional[tuple[int, int]]:
    """A peer's plan half: (sum of lens, largest off + len); None if out of bounds."""

def coalesce(src: _U64Array, dst: _U64Array, lens: _U64Array, /) -> tuple[bytearray, bytearray, bytearray]:
    """The runs with empty ones dropped and neighbours that continue each other merged."""

def meter_bounds(bounds: Buffer, /) -> None:
    """The latency histogram's bucket bounds (int64 nanoseconds, ascending, at most 64)."""

def meter_moved(cells: Buffer, nbytes: int, start: float, /) -> None:
    """Count a transfer of ``nbytes`` begun at ``start`` (``time.monotonic``) into the int64
    ``cells`` [bytes, nanoseconds, bucket 0 .. bucket B]; runs with the GIL held."""

def sock_summed(fd: int, send: bool, timeout_ms: int, base: _U64Array, off: _U64Array, len: _U64Array,
                head: Buffer | None = ..., /) -> Any:
    """A summed payload (1 to ``FAST_SUMMED_MAX`` bytes) and its checksum through ``fd``:
    sending returns the checksum sent, receiving ``(checksum of what arrived, the sender's)``."""
