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

__all__ = ["checksum", "BLOCK"]

#: Bytes summed into one word before the CRC.
BLOCK = 4096
_WORDS = BLOCK // 8


def checksum(data) -> int:
    """64-bit checksum of a bytes-like object or a 1-D uint8 array."""
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    n = int(arr.shape[0])
    body = n - n % BLOCK
    crc = 0
    if body:
        sums = np.add.reduce(arr[:body].view(np.uint64).reshape(-1, _WORDS), axis=1, dtype=np.uint64)
        crc = zlib.crc32(sums)
    if body != n:
        crc = zlib.crc32(arr[body:], crc)
    return ((n & 0xFFFFFFFF) << 32) | crc
