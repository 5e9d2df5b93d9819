"""The transport interface.

A transport moves the bytes of plans; it never looks anything up.  The link resolves the
peer's cache first (:meth:`~datadist.engine.lookups.PeerLookups.lookup`: a cached
:class:`RemoteCache` while the peer's epoch stands, else a ``RESOLVE`` round trip on the
link's request socket) and the caller's planner plans against it.  Then, on the thread
that holds the link's turn (the caller's own, or the holder running transfers queued
behind it, :mod:`datadist.engine.turns`):

1. ``prepare(link, plan, remote, push)`` -- once per plan: the work that depends only on
   the plan (rebasing into a mapped arena, binding the executor, encoding a request), and
   a :data:`Step` that runs the rest; the base class's step calls ``push`` or ``pull``.
2. The step, ``step(deadline)``, for one transfer, or ``run_batch(link, steps, deadline)``
   for several of one link (a socket transport pipelines their requests).  ``push(link,
   plan, remote, deadline)`` / ``pull(...)`` execute a plan whose peer-side addresses are
   in the peer's address space: a push's plan runs local -> peer, a pull's peer -> local.
   A step the peer refuses as planned on a stale lookup raises :class:`StaleLookup`; the
   link looks up again and goes back to 1.  A step stays valid, and is run again, for as
   long as the lookup it rests on (the caller keeps it: ``Prepared``).
3. ``close()`` once, when the link is released.

A collective transport has two calls more: ``warm`` while the link is made, and
``serve_push`` / ``serve_pull`` on the peer's agent thread for the requests that arrive
by it.

A transport reaches its peer only through the link's control :class:`Channel` (requests,
replies, the request stream a payload follows), so it can be driven by any object with that
shape.  Failures raise :class:`~datadist.engine.errors.EngineError`; a transport that can
no longer trust its stream (deadline passed mid-transfer, peer gone) marks the link broken.
"""
from __future__ import annotations

import abc
import functools
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NoReturn, Optional, Protocol

import numpy as np

from ..errors import EngineError, Fault, fail
from .. import wire
from ..layout import Plan

if TYPE_CHECKING:
    from ..memory import IpcRegion

#: Reply status of a request planned against an outdated lookup (resolve again, retry).
STALE = -2


class StaleLookup(Exception):
    """The peer's caches changed since the lookup the plan was built on."""


def check_reply(link: Channel, reply: wire.Message) -> None:
    """Raise for a failed ``REPLY``: :class:`StaleLookup` for ``STALE``, the contract's
    exception for a status code, a protocol error for any other frame."""
    if not isinstance(reply, wire.Reply):
        link.protocol_error(reply)
    if reply.status == STALE:
        raise StaleLookup(reply.message)
    if reply.status:
        fail(Fault.of(reply.status), reply.message)

__all__ = ["Channel", "RemoteCache", "Transport", "Step", "Prepared", "StaleLookup", "STALE", "ANY_CACHE",
           "check_reply"]


class Channel(Protocol):
    """The control connection of a link, as transports use it (a :class:`~datadist.engine.link.Link`)."""

    remote_cluster_id: int
    timeout_ms: int
    #: The stream this end's requests (and a pull's payload) travel on.
    req_sock: Optional[socket.socket]

    def rpc(self, msg: wire.Message | bytes, deadline: float, send_plan: Optional[Plan] = None,
            summed: bool = False) -> wire.Message:
        """Send ``msg`` (or its frame, encoded before; then ``send_plan``'s bytes) and read
        the reply, before ``deadline``."""

    def send_request(self, msg: wire.Message | bytes, deadline: float, send_plan: Optional[Plan] = None) -> None:
        """The first half of :meth:`rpc`: send without reading the reply (pipelined
        requests read their replies in order afterwards, with :meth:`read_reply`)."""

    def read_reply(self, deadline: float) -> wire.Message:
        """Read one more reply to the request in flight."""

    def mark_broken(self, reason: str) -> None:
        """The stream can no longer be trusted: fail this and later calls."""

    def check_peer(self) -> None:
        """Raise if the peer's process has ended (one non-blocking poll)."""

    def protocol_error(self, msg: wire.Message, why: str = "") -> NoReturn:
        """The peer sent ``msg`` where it may not: break the link and raise."""

#: ``RemoteCache.cache_id`` (and ``PUSH.cache_id``) of raw peer addresses that no lookup
#: produced (``TransferConfig.dst_addrs``): the peer accepts such a plan only if every run
#: lies inside one of its caches, and same-host links never reach them by cross-memory attach.
ANY_CACHE = -1


@dataclass(frozen=True)
class RemoteCache:
    """A peer's cache as a key resolved it (addresses in the peer's address space), or raw
    peer addresses described the same way (``cache_id == ANY_CACHE``)."""

    cache_id: int
    row: int
    num_tensors: int
    tensor_size: int
    batch_size: int
    is_blocks: bool
    dtype: str
    addrs: np.ndarray
    epoch: int
    watched: bool = False     # the owner wants arrival notices for this cache
    device: str = "cpu"       # "cpu" or the owner's "cuda:N"
    ipc: tuple[IpcRegion, ...] = ()  # CUDA IPC regions a same-host peer may map

    @property
    def stride(self) -> int:
        return self.tensor_size // self.batch_size

    @functools.cached_property
    def span(self) -> tuple[int, int]:
        """Lowest address and byte length covering every tensor (computed once)."""
        lo = int(self.addrs.min())
        return lo, int(self.addrs.max()) + self.tensor_size - lo


#: A plan bound to its transport: ``step(deadline)`` moves it and returns whether the peer's
#: agent took part (it then knows of a push's arrival; always True for a pull).
Step = Callable[[float], bool]


@dataclass(frozen=True)
class Prepared:
    """A transfer looked up, planned and bound to the link's transport: what a repeated
    call with the same shape runs again while the peer's cache stays the same."""

    remote: RemoteCache
    plan: Plan
    step: Step
    #: Bytes the plan moves (counted once here, not at each run).
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", self.plan.nbytes)


class Transport(abc.ABC):
    """Moves the bytes of a plan between this process and a linked peer."""

    name: str = "?"

    @abc.abstractmethod
    def push(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> bool:
        """Copy ``plan`` from local memory into the peer's cache ``remote``.  Returns True
        if the peer's agent took part (it then knows of the arrival), False for a
        one-sided copy."""

    @abc.abstractmethod
    def pull(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> None:
        """Copy ``plan`` from the peer's cache ``remote`` into local memory."""

    def prepare(self, link: Channel, plan: Plan, remote: RemoteCache, push: bool) -> Step:
        """``push`` or ``pull`` of ``plan`` as a :data:`Step` (valid while the link lives)."""
        if push:
            return functools.partial(self.push, link, plan, remote)

        def pull(deadline: float) -> bool:
            self.pull(link, plan, remote, deadline)
            return True

        return pull

    def run_batch(self, link: Channel, steps: list[Step], deadline: float) -> list[bool | Exception]:
        """Run prepared steps of one link, in order: for each, what it returned or the
        :class:`StaleLookup` / :class:`~datadist.engine.errors.EngineError` it raised
        (any other exception propagates).  Transports that can pipeline requests send
        them back to back and read the answers after."""
        outcomes: list[bool | Exception] = []
        for step in steps:
            try:
                outcomes.append(step(deadline))
            except (StaleLookup, EngineError) as exc:
                outcomes.append(exc)
        return outcomes

    def close(self) -> None:
        """Release what the transport holds (mappings); idempotent."""
