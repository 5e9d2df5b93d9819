"""The expected bytes of a destination after a transfer: a plain numpy model of SPEC section 5.

Caches are ``(num_tensors, tensor_bytes)`` uint8 arrays.  Each function returns what the
destination must hold: the targeted blocks/rows carry the source bytes, every other byte
keeps its previous value.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from harness_specs import Desc

__all__ = ["random_bytes", "as_array", "layer_tensors", "expect_blocks", "expect_row_to_blocks",
           "expect_rows"]

def random_bytes(desc: Desc, seed: int) -> np.ndarray:
    """Seeded random content for a cache: ``(num_tensors, tensor_bytes)`` uint8."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(desc.num_tensors, desc.tensor_bytes), dtype=np.uint8)


def as_array(rows: Sequence[bytes]) -> np.ndarray:
    """Stack per-tensor byte strings into a uint8 array."""
    return np.stack([np.frombuffer(r, dtype=np.uint8) for r in rows])


def layer_tensors(layers: Optional[range], n: int, num_tensors: int) -> List[int]:
    """Tensor indices of the layers in ``layers`` (None: all), N tensors per layer."""
    if layers is None:
        return list(range(num_tensors))
    return [layer * n + j for layer in layers for j in range(n)]


def expect_blocks(dst: np.ndarray, src: np.ndarray, src_blocks: Sequence[int],
                  dst_blocks: Sequence[int], block_bytes: int, *,
                  src_layers: Optional[range] = None, dst_layers: Optional[range] = None,
                  n: int = 2) -> np.ndarray:
    """What ``dst`` holds after copying ``src_blocks[i] -> dst_blocks[i]`` of the layers."""
    out = dst.copy()
    st = layer_tensors(src_layers, n, src.shape[0])
    dt = layer_tensors(dst_layers, n, dst.shape[0])
    assert len(st) == len(dt)
    for s_t, d_t in zip(st, dt):
        for sb, db in zip(src_blocks, dst_blocks):
            out[d_t, db * block_bytes:(db + 1) * block_bytes] = \
                src[s_t, sb * block_bytes:(sb + 1) * block_bytes]
    return out


def expect_row_to_blocks(dst: np.ndarray, src: np.ndarray, src_row: int, row_bytes: int,
                         dst_blocks: Sequence[int], block_bytes: int, *,
                         src_layers: Optional[range] = None,
                         dst_layers: Optional[range] = None, n: int = 2) -> np.ndarray:
    """What ``dst`` holds after chunk i of ``src`` row ``src_row`` went to ``dst_blocks[i]``."""
    out = dst.copy()
    st = layer_tensors(src_layers, n, src.shape[0])
    dt = layer_tensors(dst_layers, n, dst.shape[0])
    for s_t, d_t in zip(st, dt):
        row = src[s_t, src_row * row_bytes:(src_row + 1) * row_bytes]
        for i, db in enumerate(dst_blocks):
            out[d_t, db * block_bytes:(db + 1) * block_bytes] = \
                row[i * block_bytes:(i + 1) * block_bytes]
    return out


def expect_rows(dst: np.ndarray, src: np.ndarray, src_row: int, dst_row: int,
                row_bytes: int, *, size: int = -1, src_layers: Optional[range] = None,
                dst_layers: Optional[range] = None, n: int = 2) -> np.ndarray:
    """What ``dst`` holds after the first ``size`` bytes (-1: the row) of a row moved."""
    out = dst.copy()
    nbytes = row_bytes if size == -1 else size
    st = layer_tensors(src_layers, n, src.shape[0])
    dt = layer_tensors(dst_layers, n, dst.shape[0])
    for s_t, d_t in zip(st, dt):
        out[d_t, dst_row * row_bytes:dst_row * row_bytes + nbytes] = \
            src[s_t, src_row * row_bytes:src_row * row_bytes + nbytes]
    return out
