"""The caches this engine owns and the keys that name them, plus the epoch that tells
peers when cached lookups went stale.

Peers cache what a key resolved to (so a repeated transfer costs no round trip).  Any
change that could make such a lookup wrong (a cache freed, a key removed, consumed or
re-pointed) bumps the epoch, a ``uint64`` in a shared page that same-host peers map and
that socket peers send with every request; a peer whose epoch is old resolves again.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Optional, Protocol

import numpy as np
from numpy.typing import NDArray

from .arrivals import ArrivalBoard, Notice
from .errors import Fault, fail
from .inflight import InFlight
from .memory import Arena

if TYPE_CHECKING:
    from .memory import IpcRegion

__all__ = ["CacheRecord", "Registry", "EPOCH_PAGE_SIZE"]

log = logging.getLogger("datadist")

EPOCH_PAGE_SIZE = 4096
# Offset 8 of the page holds a random nonce that a peer reads back to prove the mapping
# (or cross-memory attach) reaches this very process.
_NONCE_OFFSET = 8

#: A row key as the registry holds it: ``(req_id, model_id, prefix_id)``.
_RowKey = tuple[int, int, int]
#: A blocks cache key as the registry holds it: ``(cluster_id, model_id)``.
_BlocksKey = tuple[int, int]
#: What a record remembers it is named by, to forget the names with it.
_Name = tuple[Literal["key"], int, int, int] | tuple[Literal["blocks"], int, int]


class RowKeyLike(Protocol):
    """A key naming one row (``CacheKey``, or a peer's ``ReleaseKey``)."""

    @property
    def req_id(self) -> int: ...

    @property
    def model_id(self) -> int: ...

    @property
    def prefix_id(self) -> int: ...


class BlocksKeyLike(Protocol):
    """A key naming a whole blocks cache (``BlocksCacheKey``)."""

    @property
    def prompt_cluster_id(self) -> int: ...

    @property
    def model_id(self) -> int: ...


@dataclass
class CacheRecord:
    """What the engine knows about one cache: geometry and where its tensors live."""

    cache_id: int
    num_tensors: int
    tensor_size: int          # bytes of one tensor
    batch_size: int           # rows (blocks in a blocks cache)
    is_blocks: bool
    dtype: str
    addrs: NDArray[np.uint64]  # one per tensor, in this process
    release: Optional[Callable[[], None]] = None   # frees pool memory; None for registered memory
    device: str = "cpu"       # "cpu" (host memory) or "cuda:N"
    ipc: tuple[IpcRegion, ...] = ()  # CUDA IPC regions covering the tensors
    keys: set[_Name] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.addr_set = frozenset(self.addrs.tolist())

    @property
    def stride(self) -> int:
        """Bytes of one row (one block) of one tensor."""
        return self.tensor_size // self.batch_size


class Registry:
    """Thread-safe map of cache ids and keys to :class:`CacheRecord` (owner side)."""

    def __init__(self, cluster_id: int, nonce: int) -> None:
        self.cluster_id = cluster_id
        self._lock = threading.Lock()
        self._caches: dict[int, CacheRecord] = {}
        self._keys: dict[_RowKey, tuple[int, int]] = {}     # (req_id, model_id, prefix_id) -> (cache_id, row)
        self._blocks_keys: dict[_BlocksKey, int] = {}      # (cluster_id, model_id) -> cache_id
        self._next_id = 1
        self._boards: dict[int, ArrivalBoard] = {}
        self.page = Arena(f"datadist-epoch-{cluster_id}", EPOCH_PAGE_SIZE)
        self._epoch = ctypes.c_uint64.from_address(self.page.base)
        ctypes.c_uint64.from_address(self.page.base + _NONCE_OFFSET).value = nonce
        self.nonce = nonce
        #: The peers' requests being served, which freed memory waits for.
        self.inflight = InFlight(lambda: self._epoch.value)

    # -- epoch -------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch.value

    def _bump(self) -> None:
        self._epoch.value += 1

    @staticmethod
    def read_epoch(page_addr: int) -> int:
        """The epoch stored in a (mapped) epoch page at ``page_addr``."""
        return Registry.epoch_cell(page_addr).value

    @staticmethod
    def epoch_cell(page_addr: int) -> ctypes.c_uint64:
        """A view of the epoch in a (mapped) epoch page, to read it again and again
        (``.value``; valid while the page stays mapped)."""
        return ctypes.c_uint64.from_address(page_addr)

    @staticmethod
    def nonce_address(page_addr: int) -> int:
        return page_addr + _NONCE_OFFSET

    # -- caches ------------------------------------------------------------------------
    def add(self, record_fields: dict[str, Any], keys: Iterable[RowKeyLike] = (),
            blocks_key: Optional[BlocksKeyLike] = None) -> CacheRecord:
        """Register a new cache; ``keys[i]`` names row i (``CacheKey``), ``blocks_key`` the
        whole blocks cache.  A key already in use is re-pointed (the last wins)."""
        with self._lock:
            rec = CacheRecord(cache_id=self._next_id, **record_fields)
            self._next_id += 1
            self._caches[rec.cache_id] = rec
            for row, key in enumerate(keys):
                self._bind_key_locked(_key_tuple(key), rec, row)
            if blocks_key is not None:
                bk = (blocks_key.prompt_cluster_id, blocks_key.model_id)
                old = self._blocks_keys.get(bk)
                if old is not None and old in self._caches:
                    log.warning("blocks cache key %s re-registered: cache %d replaces cache %d", blocks_key, rec.cache_id, old)
                    self._bump()
                self._blocks_keys[bk] = rec.cache_id
                rec.keys.add(("blocks",) + bk)
            return rec

    def _bind_key_locked(self, kt: _RowKey, rec: CacheRecord, row: int) -> None:
        if kt[0] == 2**64 - 1:
            return  # req_id 2**64-1 marks an empty row
        old = self._keys.get(kt)
        if old is not None:
            log.warning("cache key %s re-registered: cache %d row %d replaces cache %d row %d",
                        kt, rec.cache_id, row, old[0], old[1])
            prev = self._caches.get(old[0])
            if prev is not None:
                prev.keys.discard(("key",) + kt)
            self._bump()
        self._keys[kt] = (rec.cache_id, row)
        rec.keys.add(("key",) + kt)

    def remove(self, cache_id: int) -> Optional[CacheRecord]:
        """Forget a cache and its keys; returns it, or None if unknown (no-op)."""
        with self._lock:
            rec = self._caches.pop(cache_id, None)
            self._boards.pop(cache_id, None)
            if rec is None:
                return None
            for k in rec.keys:
                if k[0] == "key":
                    self._keys.pop(k[1:], None)
                else:
                    self._blocks_keys.pop(k[1:], None)
            self._bump()
            return rec

    def remove_key(self, key: RowKeyLike) -> bool:
        """Drop one ``CacheKey``; False if it was not registered."""
        kt = _key_tuple(key)
        with self._lock:
            hit = self._keys.pop(kt, None)
            if hit is None:
                return False
            rec = self._caches.get(hit[0])
            if rec is not None:
                rec.keys.discard(("key",) + kt)
            self._bump()
            return True

    def get(self, cache_id: int) -> Optional[CacheRecord]:
        with self._lock:
            return self._caches.get(cache_id)

    def all(self) -> list[CacheRecord]:
        with self._lock:
            return list(self._caches.values())

    # -- arrival notices ---------------------------------------------------------------
    def watch(self, cache_id: int) -> Optional[ArrivalBoard]:
        """Start keeping arrival notices for a cache (idempotent) and return its board;
        None for an unknown cache.  Peers learn of it through the epoch (their cached
        lookups carry ``watched``), so pushes from then on send notices."""
        with self._lock:
            board = self._boards.get(cache_id)
            if board is None:
                rec = self._caches.get(cache_id)
                if rec is None:
                    return None
                board = self._boards[cache_id] = ArrivalBoard(cache_id, rec.num_tensors)
                self._bump()
            return board

    def watched(self, cache_id: int) -> Optional[ArrivalBoard]:
        """The board of a watched cache, else None."""
        with self._lock:
            return self._boards.get(cache_id)

    def record_arrival(self, arrival: Notice) -> None:
        board = self.watched(arrival.cache_id)
        if board is not None:  # unwatched, or freed meanwhile: nobody asked
            board.record(arrival)

    def source_lost(self, cluster_id: int, reason: str) -> None:
        with self._lock:
            boards = list(self._boards.values())
        for board in boards:
            board.source_lost(cluster_id, reason)

    def source_linked(self, cluster_id: int) -> None:
        with self._lock:
            boards = list(self._boards.values())
        for board in boards:
            board.source_linked(cluster_id)

    # -- lookups for peers ---------------------------------------------------------------
    def resolve(self, kind: str, *, cluster_id: int, cache_id: int = 0, batch_index: int = 0,
                req_id: int = 0, model_id: int = 0, prefix_id: int = 2**64 - 1) -> tuple[CacheRecord, int]:
        """The cache and row a peer's key names; raises ``LLM_KV_CACHE_NOT_EXIST``."""
        with self._lock:
            if cluster_id != self.cluster_id:
                fail(Fault.CACHE_NOT_FOUND,
                            f"key names cluster {cluster_id}, but this engine is cluster {self.cluster_id}")
            if kind == "id":
                rec = self._caches.get(cache_id)
                if rec is None:
                    fail(Fault.CACHE_NOT_FOUND, f"cluster {self.cluster_id} has no cache id {cache_id}")
                if not 0 <= batch_index < rec.batch_size:
                    fail(Fault.CACHE_NOT_FOUND,
                                f"batch_index {batch_index} out of range for cache {cache_id} with {rec.batch_size} rows")
                return rec, batch_index
            if kind == "key":
                hit = self._keys.get((req_id, model_id, prefix_id))
                if hit is None:
                    fail(Fault.CACHE_NOT_FOUND,
                                f"cluster {self.cluster_id} has no cache key (req_id={req_id}, model_id={model_id}, "
                                f"prefix_id={prefix_id}); it was never registered, or already pulled or removed")
                return self._caches[hit[0]], hit[1]
            cid = self._blocks_keys.get((cluster_id, model_id))
            if cid is None:
                fail(Fault.CACHE_NOT_FOUND,
                            f"cluster {self.cluster_id} has no blocks cache for model_id {model_id}")
            return self._caches[cid], 0

    def close(self) -> None:
        self.page.close()


def _key_tuple(key: RowKeyLike) -> _RowKey:
    return (int(key.req_id), int(key.model_id), int(key.prefix_id))
