"""The checksum of a plan half in CUDA memory, summed on the GPU.

The checksum is :mod:`datadist.engine.checksum`'s: per 4 KiB block of the half's byte
stream (its runs in plan order, tensor by tensor) the sum and the position-weighted sum of
the block's little-endian 64-bit words, modulo 2**64; then CRC-32 of those sums and of the
bytes after the last whole block.  Here the runs are gathered into a device buffer
(batched copy kernels, :func:`..executor.tensor.torch_copy_plan`), the two sums of every
block are two batched integer reductions (64-bit integer adds and multiplies wrap modulo
2**64 on the GPU as they do in the C loops), and only the sums, 16 bytes per 4 KiB block,
and the tail go to host memory for the CRC.  Before, a device half was copied whole into
host memory and summed there: on an H100 a checked shm pull of 256 MiB ran at 3.7 GB/s
instead of 1300, and at 59 GB/s summed here
(``python -m datadist.bench --device cuda --checksum --workload inorder-256k --transport shm``).

Small halves stay on the host path (:data:`GPU_FROM`): the GPU path has a fixed cost of
about 0.3 ms plus about 30 us per tensor (a copy and the reductions' launches and
synchronizations).  Measured on an H100, one call, GPU vs host staging: 4 KiB x 64 tensors
2.1 vs 0.2 ms; 4 MiB in one tensor 0.41 vs 0.41 ms, in 64 tensors 2.6 vs 0.7 ms; 16 MiB in
one tensor 0.47 vs 1.3 ms; 64 MiB in 64 tensors 2.5 vs 9.9 ms; 1 GiB 7.9 vs 127 ms.

Memory: one gather buffer of a group of the half's tensors, at most :data:`GROUP_BYTES`
unless one tensor's share is larger (then that share), and reduction temporaries of at
most :data:`ROWS` blocks.  A half whose per-tensor share is not a whole number of blocks is
gathered in one piece (its blocks straddle tensors).
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..checksum import BLOCK, from_block_sums
from ..executor.tensor import torch_copy_plan
from .local import staging_buffer, staging_plan

__all__ = ["device_checksum", "GPU_FROM", "GROUP_BYTES", "ROWS"]

#: Halves of at least this many bytes are summed on the GPU (smaller ones cost less
#: through host staging; see the module docstring).
GPU_FROM = 16 << 20

#: Bytes of tensors gathered at once (whole tensors' shares of the half).
GROUP_BYTES = 64 << 20
#: Blocks reduced at once (bounds the weighted product's temporary: 64 MiB).
ROWS = 16384

_WORDS = BLOCK // 8


def device_checksum(bases: np.ndarray, offs: np.ndarray, lens: np.ndarray, device: str,
                    group_bytes: int = GROUP_BYTES) -> int:
    """The checksum of the runs of a plan half (``bases`` x ``offs``/``lens``, in plan
    order) in ``device`` memory that torch can address (CUDA; also host memory, which
    is how it is tested against the C loops); equal to :func:`.checked.sum_half`'s."""
    import torch

    per_t = int(lens.astype(np.uint64).sum())
    ntensors = int(bases.shape[0])
    n = per_t * ntensors
    sums = np.zeros(2 * (n // BLOCK), dtype=np.uint64)
    tail = np.zeros(n % BLOCK, dtype=np.uint8)
    if n == 0:
        return from_block_sums(sums, tail, n)
    group = ntensors if per_t % BLOCK else max(1, group_bytes // per_t)
    weights = _weights(device)
    for t0 in range(0, ntensors, group):
        part = bases[t0:t0 + group]
        nbytes = per_t * int(part.shape[0])
        buf, addr = staging_buffer(nbytes, device)
        torch_copy_plan(staging_plan(part, offs, lens, addr, gather=True, half_dev=device, staging_dev=device))
        whole = nbytes // BLOCK
        first = t0 * per_t // BLOCK  # a block boundary: groups of several tensors have whole blocks
        if whole:
            sums[2 * first:2 * (first + whole)] = _block_sums(buf[:whole * BLOCK], weights)
        if nbytes % BLOCK:  # only the last group has a partial block
            tail[:] = buf[whole * BLOCK:nbytes].cpu().numpy()
    return from_block_sums(sums, tail, n)


@functools.lru_cache(maxsize=None)
def _weights(device: str) -> Any:
    """The weight of each word of a block (1 .. 512) as a tensor on ``device``."""
    import torch

    return torch.arange(1, _WORDS + 1, dtype=torch.int64, device=device)


def _block_sums(data: Any, weights: Any) -> np.ndarray:
    """The two sums of every whole block of the uint8 tensor ``data``, interleaved (block
    0's plain and weighted sum, then block 1's...) as uint64 in host memory."""
    import torch

    words = data.view(torch.int64).view(-1, _WORDS)
    out = torch.empty((words.shape[0], 2), dtype=torch.int64, device=data.device)
    for r in range(0, words.shape[0], ROWS):
        chunk = words[r:r + ROWS]
        out[r:r + ROWS, 0] = chunk.sum(dim=1)
        out[r:r + ROWS, 1] = (chunk * weights).sum(dim=1)
    return out.cpu().numpy().view(np.uint64).reshape(-1)
