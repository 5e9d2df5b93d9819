"""The transport interface.

Calls happen in this order, always from the thread of the public API call that holds the
link's lock:

1. ``resolve(link, key_message, deadline)`` -- only when the link's cached lookup is stale;
   every transport resolves over the link's request socket (a small RPC).
2. ``push(link, plan, remote, deadline)`` or ``pull(link, plan, remote, deadline)``: execute
   a plan whose peer-side addresses are in the peer's address space.  A push's plan runs
   local -> peer, a pull's peer -> local.
3. ``close()`` when the link goes away.

Failures raise :class:`~datadist._status.LLMException`; a transport that can no longer
trust its stream (deadline passed mid-transfer, peer gone) marks the link broken.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from ..engine.layout import Plan

__all__ = ["RemoteCache", "Transport"]


@dataclass(frozen=True)
class RemoteCache:
    """A peer's cache as a key resolved it (addresses in the peer's address space)."""

    cache_id: int
    row: int
    num_tensors: int
    tensor_size: int
    batch_size: int
    is_blocks: bool
    dtype: str
    addrs: np.ndarray
    epoch: int

    @property
    def stride(self) -> int:
        return self.tensor_size // self.batch_size


class Transport(abc.ABC):
    """Moves the bytes of a plan between this process and a linked peer."""

    name: str = "?"

    @abc.abstractmethod
    def push(self, link, plan: Plan, remote: RemoteCache, deadline: float) -> None:
        """Copy ``plan`` from local memory into the peer's cache ``remote``."""

    @abc.abstractmethod
    def pull(self, link, plan: Plan, remote: RemoteCache, deadline: float) -> None:
        """Copy ``plan`` from the peer's cache ``remote`` into local memory."""

    def close(self) -> None:
        """Release what the transport holds (mappings); idempotent."""
