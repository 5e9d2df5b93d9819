"""Copy plans: which bytes move where, as few and as long runs as possible.

A :class:`Plan` is a set of runs (source address, destination address, length).  Plans are built with numpy only (no Python loop per block or per tensor) and are
coalesced: a run whose source and destination both continue where the previous run ended
is merged into it, across blocks and across tensors.  Addresses are plain integers in
*some* address space; which one (this process, a peer, a mapped view of a peer) is the
executor's business, and :meth:`Plan.rebase` moves one side to another space.

Every cache the engine moves is described the same way: ``T`` equally shaped tensors with
a base address each, and units (blocks, rows, token slots) at byte offsets inside every
tensor.  :func:`plan_units` crosses tensors with units.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _native

__all__ = ["Plan", "plan_units", "coalesce", "block_offsets", "layer_tensor_indices", "tensor_span", "sliced"]

_U64 = np.uint64
#: An array of uint64 (addresses, offsets, lengths).
U64Array = NDArray[np.uint64]


@dataclass(frozen=True)
class Plan:
    """Runs in factored form: for every tensor pair t and unit run u, ``lens[u]`` bytes
    move from ``src_bases[t] + src_offs[u]`` to ``dst_bases[t] + dst_offs[u]``.

    The factored form keeps a 4096-block x 64-tensor plan at 4096 + 64 entries instead of
    262144 runs, so building, shipping and executing it stay cheap.  A flat list of runs is
    the case ``T == 1`` with zero bases.  Destinations never overlap.

    ``src_dev`` / ``dst_dev`` say what memory each side addresses: ``"cpu"`` (host memory)
    or a CUDA device (``"cuda:0"``).  Executors that can only reach host memory stage the
    other kind (:mod:`datadist.engine.transports.local`).
    """

    src_bases: U64Array
    dst_bases: U64Array
    src_offs: U64Array
    dst_offs: U64Array
    lens: U64Array
    src_dev: str = "cpu"
    dst_dev: str = "cpu"

    @property
    def nbytes(self) -> int:
        """Total bytes the plan moves."""
        return int(self.lens.sum()) * int(self.src_bases.shape[0])

    @property
    def nruns(self) -> int:
        """Number of contiguous copies the plan executes."""
        return int(self.lens.shape[0]) * int(self.src_bases.shape[0])

    @property
    def on_host(self) -> bool:
        """Both sides are host memory (the C copy loops can run the plan)."""
        return self.src_dev == "cpu" and self.dst_dev == "cpu"

    def on(self, src_dev: str, dst_dev: str) -> "Plan":
        """The same runs, with the memory kinds of the two sides set."""
        return Plan(self.src_bases, self.dst_bases, self.src_offs, self.dst_offs, self.lens, src_dev, dst_dev)

    def swapped(self) -> "Plan":
        """The same runs in the other direction (a pull is a reversed push)."""
        return Plan(self.dst_bases, self.src_bases, self.dst_offs, self.src_offs, self.lens, self.dst_dev,
                    self.src_dev)

    def rebase(self, *, src_delta: int = 0, dst_delta: int = 0) -> "Plan":
        """Shift every source (destination) address by a constant, e.g. from a peer's
        address space to where this process maps the same memory."""
        sb = self.src_bases + _U64(src_delta % (1 << 64)) if src_delta else self.src_bases
        db = self.dst_bases + _U64(dst_delta % (1 << 64)) if dst_delta else self.dst_bases
        return Plan(sb, db, self.src_offs, self.dst_offs, self.lens, self.src_dev, self.dst_dev)

    def src_runs(self) -> tuple[U64Array, U64Array]:
        """Flat (address, length) arrays of the source side, in execution order."""
        return np.add.outer(self.src_bases, self.src_offs).ravel(), np.tile(self.lens, self.src_bases.shape[0])

    def dst_runs(self) -> tuple[U64Array, U64Array]:
        """Flat (address, length) arrays of the destination side, in execution order."""
        return np.add.outer(self.dst_bases, self.dst_offs).ravel(), np.tile(self.lens, self.dst_bases.shape[0])


_ZERO = np.zeros(1, dtype=_U64)


def _u64(values: ArrayLike) -> U64Array:
    arr = np.asarray(values)
    if arr.dtype != _U64:
        arr = arr.astype(np.int64, copy=False).astype(_U64)
    return np.ascontiguousarray(arr)


def coalesce(src: ArrayLike, dst: ArrayLike, lens: ArrayLike) -> Plan:
    """A flat plan of the given runs with neighbours that continue each other merged.

    Runs keep their order; only neighbours merge, so callers list runs in the order that
    makes neighbours adjacent (tensor-major, then ascending offsets).
    """
    src, dst, lens = _coalesce(_u64(src), _u64(dst), _u64(lens))
    return Plan(_ZERO, _ZERO, src, dst, lens)


def _coalesce(src: U64Array, dst: U64Array, lens: U64Array) -> tuple[U64Array, U64Array, U64Array]:
    s, d, n = _native.coalesce(src, dst, lens)  # one pass in C (numpy needs several temporaries)
    return np.frombuffer(s, dtype=_U64), np.frombuffer(d, dtype=_U64), np.frombuffer(n, dtype=_U64)


def plan_units(
    src_bases: Sequence[int] | np.ndarray,
    src_offsets: Sequence[int] | np.ndarray,
    dst_bases: Sequence[int] | np.ndarray,
    dst_offsets: Sequence[int] | np.ndarray,
    unit_bytes: int,
) -> Plan:
    """Plan ``unit_bytes`` copies for every (tensor t, unit u) pair.

    ``src_bases[t] + src_offsets[u] -> dst_bases[t] + dst_offsets[u]``; the bases have one
    entry per tensor pair (T), the offsets one per unit (U).  Units that ascend contiguously
    on both sides merge; when each tensor's units merge into a single run, tensors that sit
    back to back on both sides (pool allocations) merge too, so a whole in-order cache can
    be one run.  Cost is O(T + U), with no Python loop over either.
    """
    sb, db = _u64(src_bases), _u64(dst_bases)
    so, do = _u64(src_offsets), _u64(dst_offsets)
    if sb.shape != db.shape or so.shape != do.shape:
        raise ValueError("plan_units: source and destination lists differ in length")
    if sb.shape[0] == 0 or so.shape[0] == 0 or unit_bytes <= 0:
        empty = np.empty(0, dtype=_U64)
        return Plan(empty, empty, empty, empty, empty)
    so, do, lens = _coalesce(so, do, np.full(so.shape[0], unit_bytes, dtype=_U64))
    if lens.shape[0] == 1 and sb.shape[0] > 1:
        src, dst, merged = _coalesce(sb + so[0], db + do[0], np.full(sb.shape[0], lens[0], dtype=_U64))
        return Plan(_ZERO, _ZERO, src, dst, merged)
    return Plan(sb, db, so, do, lens)


def block_offsets(blocks: Sequence[int] | NDArray[np.integer[Any]], stride: int, base_offset: int = 0) -> U64Array:
    """Byte offsets of ``blocks`` (indices of ``stride``-byte units) inside a tensor."""
    idx = np.asarray(blocks).astype(_U64)
    return idx * _U64(stride) + _U64(base_offset) if base_offset else idx * _U64(stride)


def layer_tensor_indices(layers: range, tensor_num_per_layer: int) -> NDArray[np.int64]:
    """Tensor indices of a layer range in a KV..KV layout: layer i is tensors [i*N, (i+1)*N)."""
    n = int(tensor_num_per_layer)
    return np.arange(layers.start * n, layers.stop * n, dtype=np.int64)


def tensor_span(addrs: U64Array, bases: U64Array, offs: U64Array, lens: U64Array) -> tuple[int, int]:
    """The range ``[lo, hi)`` of tensor indices (tensor i starts at ``addrs[i]``) that one
    side ``(bases, offs, lens)`` of a plan touches.  Bases that are tensor addresses name
    the tensors exactly; a flat plan (tensors merged back to back) is mapped through the
    sorted tensor addresses."""
    index = {a: i for i, a in enumerate(addrs.tolist())}
    hits = [index.get(b) for b in bases.tolist()]
    found = [h for h in hits if h is not None]
    if len(found) == len(hits):  # every base is a tensor's address
        return min(found), max(found) + 1
    order = np.argsort(addrs)
    first = int(bases.min() + offs.min())
    last = int(bases.max() + (offs + lens).max()) - 1
    lo, hi = np.searchsorted(addrs[order], [first, last], side="right") - 1
    picked = order[max(int(lo), 0): int(hi) + 1]
    return int(picked.min()), int(picked.max()) + 1


def sliced(plan: Plan, size: int) -> list[Plan]:
    """``plan`` cut into plans of about ``size`` bytes (at most twice that) that together
    move the same bytes: runs longer than a slice's share per tensor are split, and each
    slice takes consecutive runs of every tensor.  A plan of at most ``size`` bytes is
    itself; the same plan always gives the same slices."""
    if plan.nbytes <= size:
        return [plan]
    per = max(1, size // max(1, plan.src_bases.shape[0]))
    lens = plan.lens.astype(np.int64)
    counts = np.maximum(1, -(-lens // per))
    run = np.repeat(np.arange(lens.shape[0]), counts)
    start = np.arange(run.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    start *= per
    piece = np.minimum(lens[run] - start, per)
    cuts = np.flatnonzero(np.diff((np.cumsum(piece) - 1) // per)) + 1
    at = start.astype(np.uint64)
    parts = zip(np.split(plan.src_offs[run] + at, cuts), np.split(plan.dst_offs[run] + at, cuts),
                np.split(piece.astype(np.uint64), cuts))
    return [replace(plan, src_offs=s, dst_offs=d, lens=n) for s, d, n in parts]
