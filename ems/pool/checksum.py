"""The checksum every pool value carries.

Per 4 KiB block of the value, two 64-bit sums of its little-endian 64-bit words: the plain
sum and the position-weighted sum (word i of the block counts ``i + 1`` times), so words
that change places inside a block change the checksum, as blocks that change places do;
then CRC-32 of those sums (and of the tail bytes), with the length in the high half.  The
sums are what the C copy computes while it moves the bytes (``copy_plan_sum``: adds only,
next to the memory traffic), so a save or a load verifies its value without a second pass
over it; :func:`checksum` runs the same C summing over a value already in memory.  It is an integrity check
against torn, truncated, reordered or bit-rotted values, not a cryptographic hash.
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Union, cast

import numpy as np
from numpy.typing import NDArray

from datadist.engine.native import sum_blocks

if TYPE_CHECKING:
    # numpy declares ``ndarray.__buffer__`` for Python 3.12 on only, and mypy checks for 3.11.
    from typing_extensions import Buffer

#: What :func:`checksum` reads: a bytes-like object or a 1-D uint8 array.
_Data = Union[bytes, bytearray, memoryview, NDArray[np.uint8]]

__all__ = ["checksum", "block_sums", "from_block_sums", "BLOCK"]

#: Bytes of one block.
BLOCK = 4096


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


def from_block_sums(sums: np.ndarray, tail: NDArray[np.uint8], n: int) -> int:
    """The checksum of an ``n``-byte value from the sums of its whole 4 KiB blocks (the
    first ``2 * (n // BLOCK)`` of ``sums``; e.g. summed while copying) and its ``tail``
    bytes."""
    crc = zlib.crc32(cast("Buffer", np.ascontiguousarray(sums[: 2 * (n // BLOCK)]))) if n >= BLOCK else 0
    if n % BLOCK:
        crc = zlib.crc32(cast("Buffer", tail), crc)
    return ((n & 0xFFFFFFFF) << 32) | crc
