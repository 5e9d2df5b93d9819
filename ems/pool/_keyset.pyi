"""Type stub of the C extension ``ems.pool._keyset`` (``_keyset.c``).

``table`` is the key set's memory: a buffer of uint64 words (header, then the slots),
writable for the writer's calls (``init``, ``add``, ``discard``, ``rebuild``,
``invalidate``), read-only mappings suffice for the readers' (``count_keys``,
``count_ints``, ``stats``).  Every call but ``init`` raises ``ValueError`` unless the
buffer is an initialised table.  Arguments are positional only (``METH_FASTCALL``).
:mod:`ems.pool.keyset` wraps these.
"""
import sys
from collections.abc import Iterable
from typing import Any

from numpy.typing import NDArray

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

#: The table's memory: any object with the buffer protocol (numpy declares
#: ``ndarray.__buffer__`` for Python 3.12 on only, and mypy checks for 3.11).
_Table = Buffer | NDArray[Any]

def count_keys(table: _Table, keys: Iterable[str], /) -> int:
    """Leading ``keys`` present, or -1 when the table cannot answer now (ask the daemon)."""

def count_ints(table: _Table, prefix: bytes, hashes: Iterable[int], suffix: bytes, /) -> int:
    """``count_keys`` of ``prefix + format(h, "x") + suffix`` for each hash, without building
    the keys; -1 when the table cannot answer now.  ``OverflowError`` for a hash outside
    [0, 2**64), ``TypeError`` for one that is not exactly an int."""

def init(table: _Table, /) -> int:
    """An empty, valid table over the whole writable, zeroed buffer; returns its slots."""

def add(table: _Table, key: str, /) -> int:
    """1 added, 0 already present, -1 no room (rebuild first)."""

def discard(table: _Table, key: str, /) -> int:
    """1 removed, 0 absent."""

def rebuild(table: _Table, keys: Iterable[str], /) -> int:
    """Make the table hold exactly ``keys`` (left invalid if they exceed 3/4 of its slots);
    returns their count."""

def invalidate(table: _Table, /) -> None:
    """Readers stop trusting the table."""

def stats(table: _Table, /) -> tuple[int, int, int, int]:
    """``(nslots, live, used, valid)``."""
