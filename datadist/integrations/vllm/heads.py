"""Unequal tensor parallelism: which prefill ranks a decode rank reads, and which runs of
their blocks go to which runs of its own.

With tensor parallelism each rank's KV cache holds the KV heads of that rank only.  In the
layouts that :mod:`.blocks` splits, a block is ``R = 2 * kv_heads`` runs of token rows, run
``2 * h + kv`` holding the keys (``kv`` 0) or values (1) of head ``h``, so a range of
heads is a range of neighbouring runs.  With ``P`` prefill and ``D`` decode ranks (one
dividing the other), decode rank ``r`` reads as vLLM's NixlConnector does
(``compute_tp_mapping`` in ``nixl/tp_mapping.py``):

- ``P > D``: the ``g = P / D`` ranks ``r * g ..``; slot ``s`` of them (``Rp = Rd / g``
  runs per block) fills runs ``s * Rp ..`` of each decode block, every run of its own:
  the heads are joined, one pull per prefill rank into disjoint runs of the same blocks;
- ``P < D``: rank ``r * P // D``, only its ``Rd`` runs from ``(r % g) * Rd`` on
  (``g = D / P``, ``Rp = g * Rd``): the heads are split, and ``g`` decode ranks read each
  prefill rank, which frees a request's blocks after the ``g``-th notice;
- MLA: one latent "head" that every rank holds whole: rank ``r * P // D``'s whole
  blocks (the other ranks of its :func:`sources`, when ``P > D``, are only told).

Heads replicated over ranks (fewer KV heads than ranks on a side) are not mapped here.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Read", "TPPlan", "sources", "readers", "tp_plan"]

@dataclass(frozen=True)
class Read:
    """One pull: ``count`` runs from run ``src_first`` of each block of the prefill rank
    ``source`` (its index in the request's peers) to run ``dst_first`` of ours."""

    source: int
    src_first: int
    dst_first: int
    count: int


@dataclass(frozen=True)
class TPPlan:
    """What a decode rank pulls for a request.  ``split``: runs move (chunk views, see
    :mod:`.blocks`), else whole blocks; ``src_runs``: runs per prefill block.  The ranks
    it tells are :func:`sources` (all of them, read or not)."""

    reads: tuple[Read, ...]
    src_runs: int
    split: bool


def sources(prefill_tp: int, decode_tp: int, rank: int) -> list[int]:
    """The prefill ranks decode rank ``rank`` reads from, or tells: ranks ``rank * P/D ..``
    when ``P >= D``, else rank ``rank * P // D``."""
    if prefill_tp >= decode_tp:
        per = prefill_tp // decode_tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * prefill_tp // decode_tp] if prefill_tp else []


def readers(prefill_tp: int, decode_tp: int) -> int:
    """Decode ranks that read (and tell) each prefill rank that one of them reads."""
    return max(1, decode_tp // max(prefill_tp, 1))


def tp_plan(prefill_tp: int, decode_tp: int, rank: int, runs: int, *, mla: bool = False,
            total_kv_heads: int = 0, kind: str = "") -> TPPlan:
    """The pulls of decode rank ``rank`` (of ``decode_tp``) from ``prefill_tp`` ranks whose
    blocks are ``runs`` runs each on our side (0: blocks that cannot be split).
    ``total_kv_heads`` (0: unknown) guards against heads replicated over ranks; ``kind``
    names the attention kernel in a refusal.  Raises
    ``ValueError`` saying why when the heads cannot be mapped."""
    if prefill_tp == decode_tp:
        return TPPlan((Read(rank, 0, 0, runs),), runs, False)
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise ValueError(f"prefill instance has {prefill_tp} tensor-parallel ranks, this one {decode_tp}: "
                         "DatadistConnector maps heads only when one divides the other")
    group = sources(prefill_tp, decode_tp, rank)
    if mla:
        return TPPlan((Read(group[0], 0, 0, runs),), runs, False)
    if not runs:
        raise ValueError(f"prefill instance has {prefill_tp} tensor-parallel ranks, this one {decode_tp}: "
                         "DatadistConnector splits or joins heads only in the KV cache layouts it knows "
                         f"(datadist.integrations.vllm.blocks.SPLITTABLE), not in this one ({kind or 'unknown'})")
    if 0 < total_kv_heads < max(prefill_tp, decode_tp):
        raise ValueError(f"{total_kv_heads} KV heads over {max(prefill_tp, decode_tp)} tensor-parallel ranks are "
                         "replicated; DatadistConnector maps unequal tensor parallelism only over distinct heads")
    if prefill_tp > decode_tp:
        per = prefill_tp // decode_tp
        if (runs // 2) % per:
            raise ValueError(f"this rank's {runs // 2} KV heads do not split over {per} prefill ranks")
        src_runs = runs // per
        return TPPlan(tuple(Read(source, 0, slot * src_runs, src_runs) for slot, source in enumerate(group)),
                      src_runs, True)
    per = decode_tp // prefill_tp
    return TPPlan((Read(group[0], (rank % per) * runs, 0, runs),), runs * per, True)
