"""Whether a peer's plan half lies inside this engine's caches, and in whose memory.

A request names the runs it moves in this engine's memory as a plan half: tensor bases,
offsets and lengths, from the peer.  :func:`native.half_extent` bounds the values first (no
sum of them wraps around 64 bits); these checks then place every run inside the memory of
the cache the request names (:func:`runs_inside`) or, for raw addresses, inside the caches
of one device (:func:`device_holding`): a run may not reach memory no cache holds, and a
plan may not mix host and device memory (the host path would read device addresses).
Bases that are not tensor addresses (flat plans, raw addresses) are checked run by run, in
pieces of bounded size, and a half of more than :data:`SPAN_RUNS_MAX` runs is refused.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import numpy.typing as npt

from .registry import CacheRecord

__all__ = ["runs_inside", "device_holding", "SPAN_RUNS_MAX"]

_U64 = npt.NDArray[np.uint64]

#: Most runs (bases x offsets) checked one by one in one plan half: more is no plan this
#: engine makes (and checking them would hold the agent, which serves every link).
SPAN_RUNS_MAX = 1 << 24
#: Runs checked at a time (bounds the temporaries to some tens of MB).
_PIECE = 1 << 20


def runs_inside(rec: CacheRecord, bases: _U64, offs: _U64, lens: _U64, end: int) -> bool:
    """True if every run of the bounded plan half (whose largest ``off + len`` is ``end``)
    lies inside the cache's tensors (tensors that sit back to back count as one span,
    since coalesced runs may cross them)."""
    if lens.shape[0] == 0:
        return True
    known = rec.addr_set
    if all(b in known for b in bases.tolist()):  # a factored plan over tensor bases: the common case
        return end <= rec.tensor_size
    return _inside_spans([rec], bases, offs, lens)


def device_holding(recs: list[CacheRecord], bases: _U64, offs: _U64, lens: _U64) -> Optional[str]:
    """The device (``"cpu"``, ``"cuda:N"``) whose caches among ``recs`` hold every run of
    the bounded plan half (raw addresses, which no lookup tied to one cache), or None."""
    for device in dict.fromkeys(r.device for r in recs):
        if lens.shape[0] == 0 or _inside_spans([r for r in recs if r.device == device], bases, offs, lens):
            return device
    return None


def _inside_spans(recs: list[CacheRecord], bases: _U64, offs: _U64, lens: _U64) -> bool:
    """Whether every run lies inside one span of memory covered by the tensors of ``recs``;
    tensors that touch or overlap merge into one span."""
    nt, nu = bases.shape[0], lens.shape[0]
    if nt * nu > SPAN_RUNS_MAX:
        return False
    lo = np.concatenate([r.addrs for r in recs])
    hi = np.concatenate([r.addrs + np.uint64(r.tensor_size) for r in recs])
    order = np.argsort(lo, kind="stable")
    lo, reach = lo[order], np.maximum.accumulate(hi[order])
    seg_first = np.ones(lo.shape[0], dtype=bool)
    seg_first[1:] = lo[1:] > reach[:-1]
    seg_start = lo[seg_first]
    seg_end = reach[np.append(np.flatnonzero(seg_first)[1:] - 1, lo.shape[0] - 1)]
    rstep = min(nu, _PIECE)
    bstep = max(1, _PIECE // rstep)
    for b in range(0, nt, bstep):
        for r in range(0, nu, rstep):
            piece = lens[r:r + rstep]
            starts = np.add.outer(bases[b:b + bstep], offs[r:r + rstep]).ravel()
            ends = starts + np.tile(piece, starts.shape[0] // piece.shape[0])
            seg = np.searchsorted(seg_start, starts, side="right") - 1
            if (seg < 0).any() or not (ends <= seg_end[seg]).all():
                return False
    return True
