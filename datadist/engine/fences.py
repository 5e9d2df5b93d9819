"""Freed memory goes back to the pool only once no peer can still be copying into it or
out of it.

A same-host peer copies into and out of this engine's mapped memory itself (:mod:`.shm`):
it checks this engine's epoch before each copy, and a copy that checked it just before a
cache was freed may still be writing when the pool hands the memory to the next cache,
whose bytes it then overwrites.  Freeing therefore moves the epoch first (the registry
does), then sends each such peer a ``FENCE`` and waits for its answer: the peer answers
once the transfer that held its end of the link then has let go of it (every copy checks
the epoch with the link held, so any later one sees the new epoch and looks again).
Requests a socket peer sent are this engine's own agent's work, and waited for in
process (:mod:`.inflight`).

A peer that cannot answer in time breaks its link, as any request would; the memory is
then given back only if the peer's process is gone: one that lives on may still be in
the middle of a copy, and the memory stays out of the pool (until the engine ends)
rather than be overwritten later (logged, with its size).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from . import wire
from .conn_owner import process_alive
from .errors import EngineError, Fault, fail

if TYPE_CHECKING:
    from .inflight import InFlight
    from .link import Link

__all__ = ["fence", "answer_fence", "free_after_peers"]

log = logging.getLogger("datadist")


def fence(link: "Link", deadline: float) -> None:
    """Send ``link``'s peer a ``FENCE`` (with the link's turn, so no transfer of this end
    is on the stream) and wait for its answer; errors as a request's."""
    link.take_turn(deadline)
    link.fencing = True
    try:
        link.check_alive()
        reply = link.rpc(wire.Fence(), deadline)
        if not isinstance(reply, wire.Reply):
            link.protocol_error(reply)
        if reply.status:
            fail(Fault.of(reply.status), reply.message)
    finally:
        link.fencing = False
        link.let_go()


def answer_fence(link: "Link", timeout_ms: int) -> Optional[Callable[[], wire.Message]]:
    """The peer of ``link`` fences: None if no transfer of this end holds the link now
    (answer at once), else what answers once it has let go (run off the agent thread)."""
    deadline = time.monotonic() + timeout_ms / 1000.0
    if link.after_turn(time.monotonic()):
        return None

    def answer() -> wire.Message:
        if link.after_turn(deadline):
            return wire.Reply()
        return wire.Reply(status=int(Fault.TIMEOUT),
                          message=f"a transfer of cluster {link.local_cluster_id} held the link for "
                                  f"sync_kv_timeout ({timeout_ms} ms) after the fence came")
    return answer


def free_after_peers(links: Iterable["Link"], inflight: "InFlight", epoch: int, nbytes: int,
                     release: Optional[Callable[[], None]], timeout_ms: int) -> None:
    """Give memory freed at ``epoch`` back (``release``; None: nothing to give back, only
    wait) once the same-host peers among ``links`` and the requests being served have
    no copy of it under way."""
    deadline = time.monotonic() + timeout_ms / 1000.0
    kept = []
    for link in links:
        if not link.may_map_here or link.broken is not None or link.req_sock is None:
            continue  # a link not ready yet has carried no copy: the peer's starts with a lookup
        try:
            fence(link, deadline)
        except EngineError as exc:
            if process_alive(link.peer_pid):
                kept.append(f"cluster {link.remote_cluster_id} ({exc})")
    if kept:
        log.error("%d bytes freed are kept out of the pool: same-host peers that did not answer a fence may still "
                  "copy into them: %s", nbytes, "; ".join(kept))
        release = None
    inflight.release_after(epoch, release or _nothing, deadline)


def _nothing() -> None:
    pass
