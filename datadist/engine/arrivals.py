"""Notice notices: how a receiving engine learns that pushed data landed (or did not).

Pushes are one-sided on the same host, so the receiver's threads see nothing of them.
After every push (``push_blocks``, ``push_cache``, each layer of ``transfer_cache_async``)
the initiator therefore sends the receiver a one-way ``NOTIFY`` on the link: which cache,
which tensors, how many bytes, and the status.  A push that fails after it started sends
a failure notice if the link still works; a link that breaks fails every wait that named
its cluster.

The receiver keeps an :class:`ArrivalBoard` per cache: per-tensor counts of notices not
yet consumed.  ``CacheManager.wait_arrival`` blocks (with a deadline) until every tensor
of a layer range has one, consumes them and returns the notices; callbacks registered with
``add_arrival_callback`` run on the agent thread for each notice (keep them short).  The
API layer shows each :class:`Notice` as a ``datadist.Notice``.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

from .errors import Fault, fail

__all__ = ["Notice", "ArrivalBoard", "MAX_PENDING"]

log = logging.getLogger("datadist")

#: Unconsumed notices kept per cache; older ones are dropped first.
MAX_PENDING = 4096


@dataclass(frozen=True)
class Notice:
    """One push into a local cache, as its initiator reported it: the destination tensor
    indices it wrote, the bytes, and ``Fault.OK`` or why it failed (the tensors' contents
    are then undefined)."""

    cluster_id: int
    cache_id: int
    tensors: range
    nbytes: int
    status: Fault
    message: str = ""


class ArrivalBoard:
    """Unconsumed arrival notices of one cache (thread-safe)."""

    def __init__(self, cache_id: int, num_tensors: int) -> None:
        self.cache_id = cache_id
        self.num_tensors = num_tensors
        self._cond = threading.Condition()
        self._pending: List[Notice] = []
        self._broken: dict[int, str] = {}
        self._callbacks: List[Callable[[Notice], None]] = []

    def record(self, arrival: Notice) -> None:
        with self._cond:
            if len(self._pending) >= MAX_PENDING:
                # Nobody consumes this cache's notices: keep the newest, not all of them.
                dropped = self._pending.pop(0)
                log.debug("cache %d: dropping unconsumed arrival notice %s", self.cache_id, dropped)
            self._pending.append(arrival)
            callbacks = list(self._callbacks)
            self._cond.notify_all()
        for fn in callbacks:
            try:
                fn(arrival)
            except Exception:  # a user callback must not kill the agent thread
                log.exception("arrival callback %r failed", fn)

    def source_lost(self, cluster_id: int, reason: str) -> None:
        """The link to ``cluster_id`` broke: waits that name it fail now."""
        with self._cond:
            self._broken[cluster_id] = reason
            self._cond.notify_all()

    def source_linked(self, cluster_id: int) -> None:
        with self._cond:
            self._broken.pop(cluster_id, None)

    def add_callback(self, fn: Callable[[Notice], None]) -> None:
        with self._cond:
            self._callbacks.append(fn)

    def remove_callback(self, fn: Callable[[Notice], None]) -> None:
        with self._cond:
            if fn in self._callbacks:
                self._callbacks.remove(fn)

    def wait(self, tensors: range, deadline: Optional[float], cluster_id: Optional[int]) -> List[Notice]:
        """Block until every tensor in ``tensors`` has an unconsumed notice (from
        ``cluster_id`` if given); consume and return those notices.  Raises the notice's
        status for a failed push, ``LINK_FAILED`` if ``cluster_id``'s link broke, and
        ``TIMEOUT`` at ``deadline``."""
        with self._cond:
            while True:
                picked = self._pick(tensors, cluster_id)
                if picked is not None:
                    for a in picked:
                        self._pending.remove(a)
                    failed = next((a for a in picked if a.status != Fault.OK), None)
                    if failed is not None:
                        fail(failed.status, f"push from cluster {failed.cluster_id} into cache "
                                                   f"{self.cache_id} failed: {failed.message}")
                    return picked
                if cluster_id is not None and cluster_id in self._broken:
                    fail(Fault.LINK_FAILED,
                                f"link to cluster {cluster_id} broke while waiting for its push into cache "
                                f"{self.cache_id}: {self._broken[cluster_id]}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    fail(Fault.TIMEOUT,
                                f"no push covering tensors [{tensors.start}, {tensors.stop}) of cache {self.cache_id} "
                                "arrived before the deadline")
                self._cond.wait(left)

    def _pick(self, tensors: range, cluster_id: Optional[int]) -> Optional[List[Notice]]:
        """The oldest notices that together cover ``tensors``, or None."""
        need = set(tensors)
        picked: List[Notice] = []
        for a in self._pending:
            if cluster_id is not None and a.cluster_id != cluster_id:
                continue
            hit = need.intersection(a.tensors)
            if hit or (a.status != Fault.OK and set(a.tensors) & set(tensors)):
                picked.append(a)
                need -= hit
                if a.status != Fault.OK:
                    return picked
            if not need:
                return picked
        return None
