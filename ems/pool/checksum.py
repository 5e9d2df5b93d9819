"""The checksum every pool value carries.

CRC-32 of the per-4-KiB sums of the value's 64-bit words (then of the tail bytes), with
the length in the high half.  Summing words runs at memory bandwidth (numpy), several times
faster than a CRC over the bytes, so verifying a value costs a fraction of copying it; the
CRC over the block sums keeps it position-sensitive at block granularity.  It is an
integrity check against torn, truncated or bit-rotted values, not a cryptographic hash.
"""
from __future__ import annotations

import zlib

import numpy as np

__all__ = ["checksum", "from_block_sums", "BLOCK"]

#: Bytes summed into one word before the CRC.
BLOCK = 4096
_WORDS = BLOCK // 8


def checksum(data) -> int:
    """64-bit checksum of a bytes-like object or a 1-D uint8 array."""
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    n = int(arr.shape[0])
    body = n - n % BLOCK
    sums = np.add.reduce(arr[:body].view(np.uint64).reshape(-1, _WORDS), axis=1, dtype=np.uint64)
    return from_block_sums(sums, arr[body:], n)


def from_block_sums(sums: np.ndarray, tail, n: int) -> int:
    """The checksum of an ``n``-byte value from the sums of its whole 4 KiB blocks (the
    first ``n // BLOCK`` of ``sums``; e.g. summed while copying) and its ``tail`` bytes."""
    crc = zlib.crc32(sums[: n // BLOCK]) if n >= BLOCK else 0
    if n % BLOCK:
        crc = zlib.crc32(tail, crc)
    return ((n & 0xFFFFFFFF) << 32) | crc
