"""The lookups a link keeps: what a peer's cache keys name, until the peer's caches change.

A same-host peer publishes an epoch in a shared page that moves whenever its caches
change; a lookup (and a plan made on it) stays good while the epoch stays.  A socket peer
shares no page: it checks each request against its caches itself and answers a stale one
(:class:`~.transports.base.StaleLookup`), which is then looked up again.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, NoReturn, Optional, Union

from . import wire
from .memory import IpcRegion
from .errors import Fault, fail
from .keys import CacheRef, RefKind
from .registry import Registry
from .transports.base import ANY_CACHE, RemoteCache

if TYPE_CHECKING:
    from .layout import Plan

__all__ = ["PeerLookups"]


class PeerLookups:
    """The cache of a link's lookups (a base of :class:`~.link.Link`, which provides
    ``rpc``, ``protocol_error`` and ``peer_epoch_addr``)."""

    peer_epoch_addr: Optional[int]

    if TYPE_CHECKING:
        def rpc(self, msg: Union[wire.Message, bytes], deadline: float,
                send_plan: Optional[Plan] = None) -> wire.Message: ...

        def protocol_error(self, msg: wire.Message, why: str = "") -> NoReturn: ...

    def __init__(self) -> None:
        self._lookups: dict[CacheRef, RemoteCache] = {}
        self._epoch_cell: Optional[tuple[int, ctypes.c_uint64]] = None   # (address, view) of the peer's epoch

    def _epoch_now(self) -> Optional[int]:
        addr = self.peer_epoch_addr
        if addr is None:
            return None
        cell = self._epoch_cell
        if cell is None or cell[0] != addr:
            cell = self._epoch_cell = (addr, Registry.epoch_cell(addr))
        return cell[1].value

    def lookup(self, key: CacheRef, deadline: float, *, cached: bool = True) -> tuple[RemoteCache, bool]:
        """What ``key`` names on the peer, and whether that came from the cache of
        lookups (kept until the peer's epoch moves; ``cached=False`` asks the peer)."""
        hit = self._lookups.get(key) if cached else None
        if hit is not None:
            epoch = self._epoch_now()
            # Socket peers check the epoch themselves on each request (StaleLookup).
            if epoch is None or epoch == hit.epoch:
                return hit, True
            self._lookups.clear()
        reply = self.rpc(key.resolve_message(), deadline)
        if not isinstance(reply, wire.Resolved):
            self.protocol_error(reply)
        if reply.status:
            fail(Fault.of(reply.status), reply.message)
        why = _unsound(reply)
        if why:  # plans are made from these numbers and copied one-sidedly: never trusted blind
            self.protocol_error(reply, f"the peer described cache {reply.cache_id} impossibly: {why}")
        try:
            ipc = tuple(IpcRegion.from_wire(r) for r in reply.ipc)
        except (KeyError, ValueError, TypeError) as exc:
            self.protocol_error(reply, f"the peer described cache {reply.cache_id}'s device memory impossibly: "
                                       f"{type(exc).__name__}: {exc}")
        remote = RemoteCache(cache_id=reply.cache_id, row=reply.row, num_tensors=reply.num_tensors,
                             tensor_size=reply.tensor_size, batch_size=reply.batch_size, is_blocks=reply.is_blocks,
                             dtype=reply.dtype, addrs=reply.arrays[0], epoch=reply.epoch, watched=reply.watched,
                             device=reply.device, ipc=ipc)
        if key.kind != RefKind.KEY:
            # CacheKey lookups are consumed by pulls; caching them buys little.
            self._lookups[key] = remote
        return remote, False

    def _current(self, remote: RemoteCache) -> bool:
        """Whether a plan made against ``remote`` may run again without a new lookup:
        raw addresses do not change, a same-host peer's caches are as they were while
        its epoch stays, and a socket peer refuses a stale request itself."""
        if remote.cache_id == ANY_CACHE or self.peer_epoch_addr is None:
            return True
        return self._epoch_now() == remote.epoch


def _unsound(reply: wire.Resolved) -> str:
    """Why a peer's description of one of its caches cannot be planned against ("" if it
    can): every block plan indexes rows below ``batch_size`` of ``num_tensors`` tensors of
    ``tensor_size`` bytes at the given addresses, so each must be what it claims."""
    if len(reply.arrays) != 1:
        return "no tensor addresses"
    addrs = reply.arrays[0]
    if not 0 < reply.num_tensors == addrs.shape[0]:
        return f"{reply.num_tensors} tensors with {addrs.shape[0]} addresses"
    if not 0 < reply.batch_size <= reply.tensor_size:
        return f"batch_size {reply.batch_size} with tensor_size {reply.tensor_size}"
    if not 0 <= reply.row < reply.batch_size:
        return f"row {reply.row} outside [0, {reply.batch_size})"
    if int(addrs.max()) + reply.tensor_size >= 1 << 62 or not addrs.all():
        return "tensor addresses outside any mapping"
    return ""
