"""The order-sensitive checksum of a value or a transfer, and its sums gathered while the
bytes move.

Per 4 KiB block of a byte stream, two 64-bit sums of its little-endian 64-bit words: the
plain sum and the position-weighted sum (word i of the block counts ``i + 1`` times), so
words that change places inside a block change the checksum, as blocks that change places
do; then CRC-32 of those sums (and of the bytes of a last partial block, taken as they
are), with the length in the high half.  The C loops that move bytes compute the sums
next to the memory traffic (:func:`.native.copy_plan_sum` for a copy;
:func:`.native.sock_send` / :func:`.native.sock_recv` with a :class:`StreamSum` for a
socket, right after each system call), so the sender and the receiver of a stream each
get its checksum without a pass of their own over it.  An integrity check against torn,
truncated, reordered or corrupted bytes, not a cryptographic hash.
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Optional, cast

import numpy as np
from numpy.typing import NDArray

from . import native

if TYPE_CHECKING:
    # numpy declares ``ndarray.__buffer__`` for Python 3.12 on only, and mypy checks for 3.11.
    from typing_extensions import Buffer

__all__ = ["BLOCK", "StreamSum", "from_block_sums"]

#: Bytes of one block.
BLOCK = 4096


def from_block_sums(sums: np.ndarray, tail: NDArray[np.uint8], n: int) -> int:
    """The checksum of an ``n``-byte stream from the sums of its whole 4 KiB blocks (the
    first ``2 * (n // BLOCK)`` of ``sums``; e.g. summed while copying) and its ``tail``
    bytes (those after the last whole block)."""
    crc = zlib.crc32(cast("Buffer", np.ascontiguousarray(sums[: 2 * (n // BLOCK)]))) if n >= BLOCK else 0
    if n % BLOCK:
        crc = zlib.crc32(cast("Buffer", tail), crc)
    return ((n & 0xFFFFFFFF) << 32) | crc


class StreamSum:
    """The block sums of one ``size``-byte stream, filled by the calls that move it (in
    stream order, each from :attr:`pos` on; see :class:`.native.StreamSums`); its bytes
    after the last whole block are kept in :attr:`tail`.  Not thread-safe: one stream,
    one mover."""

    __slots__ = ("size", "sums", "pos", "tail", "tail_start")

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size = size
        self.sums = np.zeros(2 * -(-size // BLOCK), dtype=np.uint64)
        self.pos = 0
        self.tail_start = size - size % BLOCK
        self.tail: Optional[np.ndarray] = np.zeros(size % BLOCK, dtype=np.uint8)

    def add(self, data: "Buffer | NDArray[np.uint8]") -> None:
        """Sum ``data``, the stream's next bytes (a second pass over them: for bytes
        that were staged, e.g. for TLS)."""
        native.sum_stream(data, self)

    def checksum(self) -> int:
        """The stream's checksum; ``ValueError`` unless all ``size`` bytes were summed."""
        if self.pos != self.size:
            raise ValueError(f"{self.pos} of the stream's {self.size} bytes were summed")
        assert self.tail is not None
        return from_block_sums(self.sums, self.tail, self.size)
