"""Executors for :class:`~datadist.engine.layout.Plan`, implemented in C (``_native``).

Each call drops the GIL while it runs, so a copy on one thread does not stall the agent
thread, and a deadline-bound socket transfer can run while other links work.  Errors come
back as ``OSError`` with the errno the kernel gave; callers turn them into the contract's
exceptions (they know which peer and which call it was).
"""
from __future__ import annotations

import errno
import functools
import os
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Tuple, cast

import numpy as np
from numpy.typing import NDArray

from .layout import Plan, U64Array

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12 on

    #: Any object with the buffer protocol (numpy declares ``ndarray.__buffer__`` for
    #: Python 3.12 on only, so arrays are named as well).
    _Buffer = Buffer | NDArray[Any]

try:
    from . import _native
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "datadist's C helper (datadist.engine._native) is not built; install the package with "
        "`pip install -e .` (or `pip install .`), which compiles it"
    ) from exc

__all__ = ["ms_until", "peer_closed", "int_key", "ref_key", "request", "serve_known", "half_extent", "index_array", "bind_copy", "copy_plan", "copy_plan_sum", "copy_plan_stream", "sum_plan", "sum_blocks", "sum_stream", "StreamSums", "cma_plan", "sock_send", "sock_recv", "recv_exact", "wait_readable", "moves_now", "frame_arrived", "FRAME_NONE", "FRAME_PART", "FRAME_WHOLE", "FRAME_LARGE", "spin_readable", "COPY_THREADS",
           "SPIN_US", "FAST_SUMMED_MAX", "send_summed", "recv_summed"]

#: Threads a large local copy may use (the C side only splits plans of >= 8 MiB).
COPY_THREADS = max(1, min(4, int(os.environ.get("DATADIST_COPY_THREADS", os.cpu_count() or 1))))

#: How long a caller waiting for a reply polls before sleeping (microseconds).  Spinning
#: only pays when another core can run the peer meanwhile, so it is off on one core.
SPIN_US = int(os.environ.get("DATADIST_SPIN_US", 200 if (os.cpu_count() or 1) > 1 else 0))


def ms_until(deadline: float) -> int:
    """Milliseconds from now to ``deadline`` (``time.monotonic`` seconds) as the calls
    here take them: at least 1, since 0 means "no deadline" to some of them."""
    return max(1, int((deadline - time.monotonic()) * 1000))


def peer_closed(fd: int) -> bool:
    """Whether the stream on ``fd`` has ended (the peer closed it or died); never waits."""
    return _native.peer_closed(fd)


def index_array(seq: object) -> Optional[Tuple[NDArray[np.int64], int, int]]:
    """A list or tuple of ints as an int64 array with its min and max, in one C pass;
    None for any other type (use numpy then).  Raises ``TypeError`` naming the first entry
    that is not an int (bools are not), ``OverflowError`` for one outside int64."""
    got = _native.index_array(seq)
    if got is None:
        return None
    raw, lo, hi = got
    return np.frombuffer(raw, dtype=np.int64), lo, hi


def int_key(seq: object, limit: int) -> Optional[Hashable]:
    """``seq`` as a hashable key: a list or tuple of at most ``limit`` exact ints as an
    ``IntKey`` (the values as int64 and their hash, made in one C pass; equal keys compare
    with one memcmp); None for anything else (floats and bools compare equal to ints but
    are not indices, so they never share an int list's key)."""
    return _native.int_key(seq, limit)


def ref_key(src: object, dst: object, limit: int) -> Optional[Any]:
    """Two lists or tuples (at most ``limit`` entries together) as a hashable ``RefKey`` by
    the identity of their entries, never visiting one (None for anything else): equal to
    the ``pinned()`` key of lists holding the very same int objects.  ``pinned()`` holds a
    reference to every entry (None unless all are exact ints), which is what a memory keeps."""
    return _native.ref_key(src, dst, limit)


#: The largest payload a summed request or a summed answer of the agent's fast path moves
#: in C (:func:`request`, :func:`serve_known`); larger ones take the Python path.
FAST_SUMMED_MAX: int = _native.FAST_SUMMED_MAX


def request(fd: int, head: bytes, plan: Optional[Plan], answer_len: int, timeout_ms: int,
            spin_us: int = SPIN_US, summed: bool = False) -> bytes:
    """One request on a non-blocking socket ``fd`` in one call: ``head`` (a frame) and the
    plan's source runs written (``summed``: summed as they go, their stream checksum behind
    them; 1 to :data:`FAST_SUMMED_MAX` bytes), the answer awaited (polling ``spin_us``
    before sleeping) and its first ``answer_len`` bytes returned.  ``TimeoutError`` after
    ``timeout_ms``, ``ConnectionResetError`` if the stream ends."""
    if plan is None:
        got: bytes = _native.request(fd, head, None, None, None, answer_len, spin_us, int(timeout_ms))
    else:
        got = _native.request(fd, head, plan.src_bases, plan.src_offs, plan.lens, answer_len, spin_us,
                              int(timeout_ms), summed)
    return got


def serve_known(fd: int, known: dict[bytes, Any], epoch: int, header_size: int, limit: int, timeout_ms: int,
                answer: bytes, defer: bool = False) -> tuple[Any, ...]:
    """The agent's fast path for a request frame admitted before, in one C call (see
    ``csrc/serve.c``): reads the next frame from ``fd`` and, if its bytes are a key of
    ``known`` whose value ``(epoch, kind, admitted, bases, offs, lens, summed)`` is of
    the current ``epoch``, serves it (kind 1, a push: its payload in, ``answer`` out; kind
    0, a pull: ``answer`` and the payload out; a summed one of at most 4 MiB with the stream
    checksum of :mod:`.checksum`: behind a pull's payload, checked behind a push's before
    ``answer``).  Kind 2, a ``SUM`` of at most 4 MiB, is ``(epoch, 2, admitted, bases, offs,
    lens, summed_answer, at)``: the runs summed as they are now, and ``summed_answer`` (at
    most 64 bytes) sent with the checksum written at byte ``at``.  With ``defer``, a transfer
    whose bytes would wait for the peer (:func:`moves_now`) is not served.
    Returns ``(0, admitted)`` when served, ``(1, header)`` for a frame longer than
    ``limit`` (only its header read), ``(2, frame)`` for one read whole but not served,
    ``(3, admitted, got, sent)`` for a summed push whose bytes sum to ``got``, not to the
    sender's ``sent`` (nothing answered)."""
    got: tuple[Any, ...] = _native.serve_known(fd, known, epoch, header_size, limit, int(timeout_ms), answer, defer)
    return got


def half_extent(bases: U64Array, offs: U64Array, lens: U64Array) -> Optional[tuple[int, int]]:
    """A peer's plan half in one C pass: ``(sum of lens, largest off + len)``, or None when
    ``offs`` and ``lens`` differ in length, any value (the bases too) is 2^62 or more (sums
    of such values could wrap around 64 bits and pass a bounds check they fail), or it has
    bases and no run (the C loops need one), runs and no base, or an empty run (a plan
    drops those); a half of nothing at all is ``(0, 0)``."""
    got: Optional[tuple[int, int]] = _native.half_extent(bases, offs, lens)
    return got


def bind_copy(plan: Plan, threads: int = COPY_THREADS) -> Callable[[int], int]:
    """:func:`copy_plan` of ``plan`` as a call of the timeout alone (ms, 0: none), with the
    plan's arrays bound once: a repeated small copy then costs one C call."""
    return functools.partial(_native.copy_plan, plan.src_bases, plan.dst_bases, plan.src_offs, plan.dst_offs,
                             plan.lens, threads)


def copy_plan(plan: Plan, threads: int = COPY_THREADS, timeout_ms: int = 0) -> int:
    """Copy every run of ``plan`` inside this process; returns the bytes copied.  With
    ``timeout_ms`` > 0, ``TimeoutError`` if the copy is not done by then (checked at most
    64 MiB apart; the destination is then undefined)."""
    return _native.copy_plan(plan.src_bases, plan.dst_bases, plan.src_offs, plan.dst_offs, plan.lens, threads,
                             timeout_ms)


def sum_blocks(value: _Buffer, sums: U64Array) -> None:
    """Add the two sums (as :func:`copy_plan_sum` computes them) of each whole 4 KiB block
    of ``value`` (a C-contiguous buffer) to ``sums`` (writable uint64, two per block)."""
    _native.sum_blocks(value, sums)


def sum_stream(data: _Buffer, summed: "StreamSums") -> None:
    """Add ``data`` (C-contiguous), the next bytes of ``summed``'s stream, to its block
    sums, as :func:`sock_send` does with what it sends."""
    summed.pos += _native.sum_stream(data, summed.sums, summed.pos, summed.tail, summed.tail_start)


def copy_plan_sum(plan: Plan, sums: U64Array, value_addr: int, *, value_is_src: bool,
                  threads: int = COPY_THREADS) -> int:
    """``copy_plan`` that also adds the copied bytes into the two sums of each 4 KiB block
    of one value (``sums[2k]``: the sum of the 64-bit little-endian words of block k;
    ``sums[2k + 1]``: the sum of word i times ``i + 1``; mod 2**64), so a checksum over
    them needs no second pass over memory.  The value starts at ``value_addr`` on the
    plan's source side (``value_is_src``) or destination side, and ``sums`` (writable
    uint64, two per started block) is added to, not overwritten.  Raises ``OSError``
    (ERANGE, nothing copied) if a run leaves the value."""
    return _native.copy_plan_sum(plan.src_bases, plan.dst_bases, plan.src_offs, plan.dst_offs, plan.lens,
                                 threads, sums, value_addr, value_is_src)


def copy_plan_stream(plan: Plan, summed: "StreamSums", threads: int = COPY_THREADS) -> int:
    """``copy_plan`` that sums the plan's stream (its runs in plan order: what a socket
    would carry) into ``summed`` (at its start) while it copies, as :func:`sock_recv` sums
    what it receives; returns the bytes copied.  ``OSError`` ERANGE (nothing copied) if
    the plan's bytes do not fit ``summed``."""
    moved: int = _native.copy_plan_stream(plan.src_bases, plan.dst_bases, plan.src_offs, plan.dst_offs, plan.lens,
                                          threads, summed.sums, summed.pos, summed.tail, summed.tail_start)
    summed.pos += moved
    return moved


def sum_plan(bases: U64Array, offs: U64Array, lens: U64Array, summed: "StreamSums", threads: int = 1) -> int:
    """Add the runs of a plan half (``bases`` x ``offs``/``lens``), in plan order, to
    ``summed``'s stream: the sums a transfer of them would produce, without moving them.
    Halves of 8 MiB or more starting on a block boundary of the stream are summed by up
    to ``threads`` threads."""
    added: int = _native.sum_plan(bases, offs, lens, summed.sums, summed.pos, summed.tail, summed.tail_start,
                                  threads)
    summed.pos += added
    return added


def cma_plan(pid: int, plan: Plan, *, write: bool, timeout_ms: int = 0) -> int:
    """One-sided copy with another process by cross-memory attach.

    ``write=True``: plan sources are in this process, destinations in ``pid``.
    ``write=False``: sources are in ``pid``, destinations here.  Raises ``OSError``
    (ESRCH when the peer is gone, EFAULT for an address outside its mappings), and
    ``TimeoutError`` when ``timeout_ms`` (> 0) passed between two batches of runs.
    """
    if write:
        return _native.cma_plan(pid, True, plan.src_bases, plan.dst_bases, plan.src_offs, plan.dst_offs, plan.lens,
                                timeout_ms)
    return _native.cma_plan(pid, False, plan.dst_bases, plan.src_bases, plan.dst_offs, plan.src_offs, plan.lens,
                            timeout_ms)


class StreamSums(Protocol):
    """Where the block sums of a stream go as it moves (:class:`datadist.engine.checksum.StreamSum`):
    ``sums`` (uint64, two per 4 KiB block), ``pos`` (the stream offset of the next byte),
    and the kept bytes of the last partial block, ``tail`` from offset ``tail_start``."""

    sums: U64Array
    pos: int
    tail: Optional[np.ndarray]
    tail_start: int


def _sock(fd: int, send: bool, timeout_ms: int, bases: U64Array, offs: U64Array, lens: U64Array,
          head: Optional[_Buffer] = None, summed: Optional[StreamSums] = None) -> int:
    if summed is None:
        return cast(int, _timed_out(_native.sock_plan, fd, send, timeout_ms, bases, offs, lens, head))
    moved = cast(int, _timed_out(_native.sock_plan, fd, send, timeout_ms, bases, offs, lens, head, summed.sums,
                                 summed.pos, summed.tail, summed.tail_start))
    summed.pos += moved
    return moved


def sock_send(fd: int, plan: Plan, timeout_ms: int, head: _Buffer | None = None,
              summed: Optional[StreamSums] = None) -> int:
    """Write ``head`` (a frame) and then the plan's source runs, in order, to a
    non-blocking socket ``fd``, in as few ``writev`` calls as possible; with ``summed``,
    the runs' bytes are added to its block sums as they go (see :class:`StreamSums`)."""
    return _sock(fd, True, timeout_ms, plan.src_bases, plan.src_offs, plan.lens, head, summed)


def sock_recv(fd: int, plan: Plan, timeout_ms: int, summed: Optional[StreamSums] = None) -> int:
    """Read the plan's destination runs, in order, from a non-blocking socket ``fd``
    (with ``summed``: summing them as they arrive).  Raises ``ConnectionResetError`` if the
    stream ends first, ``TimeoutError`` at the deadline."""
    return _sock(fd, False, timeout_ms, plan.dst_bases, plan.dst_offs, plan.lens, None, summed)


def send_summed(fd: int, plan: Plan, timeout_ms: int, head: _Buffer | None = None) -> int:
    """:func:`sock_send` of ``head`` and a summed payload of 1 to :data:`FAST_SUMMED_MAX`
    bytes, then its checksum (8 bytes, little endian), in one C call; returns the checksum.
    A payload of up to 256 KiB is summed first, and its checksum leaves in the payload's
    own system call (the receiver's read finds it there)."""
    return cast(int, _timed_out(_native.sock_summed, fd, True, timeout_ms, plan.src_bases, plan.src_offs,
                                plan.lens, head))


def recv_summed(fd: int, plan: Plan, timeout_ms: int) -> tuple[int, int]:
    """:func:`sock_recv` of a summed payload of 1 to :data:`FAST_SUMMED_MAX` bytes and the
    checksum behind it, in one C call (the checksum read by the payload's last system
    call): ``(checksum of what arrived, the sender's)``."""
    return cast(tuple[int, int], _timed_out(_native.sock_summed, fd, False, timeout_ms, plan.dst_bases,
                                            plan.dst_offs, plan.lens))


def _timed_out(call: Callable[..., Any], fd: int, send: bool, timeout_ms: int, *args: Any) -> Any:
    """``call(fd, send, timeout_ms, *args)`` (a socket transfer in C), its ETIMEDOUT raised
    as ``TimeoutError``."""
    try:
        return call(fd, send, int(timeout_ms), *args)
    except OSError as exc:
        if exc.errno == errno.ETIMEDOUT:
            raise TimeoutError(errno.ETIMEDOUT, f"socket transfer did not finish in {timeout_ms} ms") from None
        raise


def wait_readable(fd: int, timeout_ms: int, spin_us: int = SPIN_US) -> None:
    """Block until ``fd`` is readable, polling for ``spin_us`` before sleeping; raises
    ``TimeoutError`` after ``timeout_ms``."""
    try:
        _native.wait_readable(fd, spin_us, int(timeout_ms))
    except OSError as exc:
        if exc.errno == errno.ETIMEDOUT:
            raise TimeoutError(errno.ETIMEDOUT, f"no reply within {timeout_ms} ms") from None
        raise


def moves_now(fd: int, push: bool, need: int) -> bool:
    """Whether a transfer's ``need`` bytes move now, without waiting for the peer: a
    push's have all arrived in socket ``fd``'s receive buffer, a pull's fit what its send
    buffer has free (half of ``SO_SNDBUF``).  Two non-blocking system calls, the GIL kept."""
    return _native.moves_now(fd, push, need)


#: What :func:`frame_arrived` finds: nothing, part of a frame, a whole frame (or the end of
#: the stream, or an error), the header of a frame larger than asked for.
FRAME_NONE, FRAME_PART, FRAME_WHOLE, FRAME_LARGE = -1, 0, 1, 2


def frame_arrived(fd: int, whole_max: int) -> int:
    """How far the next frame on socket ``fd`` has arrived, peeked, never read: FRAME_NONE
    when nothing has, FRAME_PART while part of a frame of at most ``whole_max`` bytes
    (header included) has, FRAME_WHOLE once it is whole and for the end of the stream or an
    error (the read that follows meets them), FRAME_LARGE for a frame over ``whole_max``
    whose header is in.  Two non-blocking system calls, the GIL kept."""
    return _native.frame_arrived(fd, whole_max)


def spin_readable(fd: int, spin_us: int) -> bool:
    """Whether ``fd`` becomes readable within ``spin_us``, polling without sleeping (and
    without the GIL); False at once with ``spin_us`` 0."""
    return spin_us > 0 and _native.spin_readable(fd, spin_us)


def recv_exact(fd: int, buf: _Buffer, timeout_ms: int) -> None:
    """Fill ``buf`` from socket ``fd`` (non-blocking) within ``timeout_ms``; raises
    ``TimeoutError`` or ``ConnectionResetError`` (end of stream)."""
    _native.recv_exact(fd, buf, timeout_ms)
