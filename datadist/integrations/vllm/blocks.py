"""Prefill blocks smaller than decode blocks: a decode block of ``k * P`` tokens filled from
``k`` prefill blocks of ``P`` tokens, without a copy on either side.

vLLM's CPU attention backend (``CPU_ATTN``) keeps a layer's cache as ``(num_blocks,
kv_heads, block_size, 2 * head_size)``; its kernels view each head of a block as
``2 * block_size`` rows of ``head_size``: the keys of the block's tokens one after the
other, then their values (``cpu_attn.py``: ``view(num_blocks, kv_heads, 2 * block_size,
head_size)``, then ``chunk(2, dim=2)``).  A block is therefore ``R = 2 * kv_heads`` runs of
token rows, in the same order whatever the block size, and run ``o`` of a decode block
holds, one after the other, run ``o`` of the ``k`` prefill blocks it is made of.

Cut both caches into chunks of ``P`` token rows (one prefill run): run ``o`` of prefill
block ``p`` is chunk ``p * R + o``; part ``i`` of run ``o`` of decode block ``d`` is chunk
``(d * R + o) * k + i``.  Each side registers that chunk view of its memory as a second
datadist blocks cache, and the pull of ``m`` prefill blocks is one ``pull_blocks`` of
``m * R`` chunks (NixlConnector instead reads whole prefill blocks and permutes the
decode block afterwards, ``kv_postprocess_blksize_on_receive``).

Only layouts whose token runs are known split: the kernels this was checked with are
named in :data:`SPLITTABLE`; any other refuses the load with a message.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

import numpy as np

from ..paged import PagedLayout

if TYPE_CHECKING:
    import torch

    from ..._objects import CacheDesc

__all__ = ["SPLITTABLE", "attention_kind", "token_runs", "chunk_desc", "split_pairs"]

#: Attention kernels (``backend:isa``) whose blocks are ``2 * kv_heads`` runs of token rows
#: (checked token-exact with vLLM 0.32's CPU build).  Not the AMX kernels: they prepack keys
#: and values in tiles laid out over a whole block.
SPLITTABLE = frozenset({"CPU_ATTN:vec"})


def attention_kind(vllm_config: Any) -> str:
    """``backend:isa`` of the model's attention layers (the ISA: vLLM's CPU kernels'
    instruction set, chosen per model), or ``""`` when there is no such layer."""
    layers = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    for layer in layers.values():
        backend = getattr(layer, "get_attn_backend", None)
        if backend is not None:
            return f"{backend().get_name()}:{getattr(layer, 'isa', '')}"
    return ""


def token_runs(kind: str, kv_caches: Mapping[str, "torch.Tensor"]) -> int:
    """Runs of token rows per block of ``kv_caches`` (0: the layout cannot be split)."""
    if kind not in SPLITTABLE:
        return 0
    shapes = {tuple(t.shape) for t in kv_caches.values()}
    if len(shapes) != 1 or any(not t.is_contiguous() for t in kv_caches.values()):
        return 0
    shape = shapes.pop()
    return 2 * shape[1] if len(shape) == 4 and shape[3] % 2 == 0 else 0


def chunk_desc(layout: PagedLayout, parts: int) -> "CacheDesc":
    """The blocks cache of ``layout``'s memory with each block cut into ``parts`` chunks."""
    from ..._objects import CacheDesc

    desc = layout.cache_desc()
    per_chunk = layout.block_bytes // parts // layout.element_size
    return CacheDesc(len(layout.addrs), [layout.num_blocks * parts, per_chunk], layout.data_type, desc.placement)


def split_pairs(remote: list[int], local: list[int], ratio: int, runs: int, src_runs: Optional[int] = None,
                src_first: int = 0, dst_first: int = 0, count: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """Chunk indices (prefill, decode) that put prefill block ``remote[j]`` into part
    ``j % ratio`` of decode block ``local[j // ratio]``: ``count`` runs (all ``runs`` by
    default) from prefill run ``src_first`` of ``src_runs`` per prefill block (``runs`` by
    default) to decode run ``dst_first`` of ``runs`` per decode block, in order.

    Unequal tensor parallelism moves a range of heads (:mod:`.heads`): the runs of one
    head range are neighbours on both sides, so with ``ratio`` 1 each block's range is one
    contiguous region and the transports move it as one copy."""
    src_runs = runs if src_runs is None else src_runs
    count = runs if count is None else count
    src = np.asarray(remote, dtype=np.int64)
    dst = np.asarray(local, dtype=np.int64)
    j = np.arange(src.shape[0])
    o = np.arange(count)
    src_chunks = src[:, None] * src_runs + src_first + o
    dst_chunks = (dst[j // ratio][:, None] * runs + dst_first + o) * ratio + (j % ratio)[:, None]
    return src_chunks.ravel(), dst_chunks.ravel()
