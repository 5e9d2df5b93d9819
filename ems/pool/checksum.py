"""The checksum every pool value carries: :mod:`datadist.engine.checksum`'s, over the
value's bytes (its definition lives there, with the sums the C loops gather while they
copy or send).  A save or a load sums its value while it moves it (``copy_plan_sum``
through the arena, a :class:`~datadist.engine.checksum.StreamSum` over a socket);
:func:`checksum` runs the same C summing over a value already in memory.
"""
from __future__ import annotations

from typing import Union

import numpy as np
from numpy.typing import NDArray

from datadist.engine.checksum import BLOCK, from_block_sums
from datadist.engine.native import sum_blocks

#: What :func:`checksum` reads: a bytes-like object or a 1-D uint8 array.
_Data = Union[bytes, bytearray, memoryview, NDArray[np.uint8]]

__all__ = ["checksum", "block_sums", "from_block_sums", "BLOCK"]


def block_sums(arr: np.ndarray) -> np.ndarray:
    """The two sums of each whole 4 KiB block of a 1-D uint8 array, interleaved
    (``[plain_0, weighted_0, plain_1, ...]``), as ``copy_plan_sum`` leaves them."""
    out = np.zeros(2 * (arr.shape[0] // BLOCK), dtype=np.uint64)
    sum_blocks(np.ascontiguousarray(arr), out)
    return out


def checksum(data: _Data) -> int:
    """64-bit checksum of a bytes-like object or a 1-D uint8 array."""
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    n = int(arr.shape[0])
    return from_block_sums(block_sums(arr), arr[n - n % BLOCK:], n)
