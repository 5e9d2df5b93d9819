"""Same-host links: one-sided copies straight into or out of the peer's memory.

Pool caches live in the peer's memfd arenas, which this process mapped at link time, so a
transfer is a local memcpy of the rebased plan.  Caches over user memory that the peer
registered are reached by cross-memory attach (``process_vm_writev/readv``).  The peer's
threads take no part in either.  When neither works for a cache (cross-memory attach not
permitted), the link's socket transport moves it instead.  Raw peer addresses
(``ANY_CACHE``) are copied here only when they lie in a mapped pool arena; otherwise they
go over the socket, where the peer checks them against its caches: cross-memory attach
could write anywhere in the peer.
"""
from __future__ import annotations

import errno
import logging
from typing import Optional

from .._status import LLMStatusCode, raise_error
from ..engine import native
from ..engine.layout import Plan
from ..engine.memory import PeerArena
from .base import ANY_CACHE, RemoteCache, Transport

__all__ = ["ShmTransport"]

log = logging.getLogger("datadist")


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, pid: int, arenas: list[PeerArena], cma_ok: bool, fallback: Transport) -> None:
        self.pid = pid
        self.arenas = arenas
        self.cma_ok = cma_ok
        self.fallback = fallback
        self._told_fallback = False

    def _delta(self, remote: RemoteCache) -> Optional[int]:
        """Offset from the peer's address of ``remote`` to where it is mapped here."""
        lo, span = remote.span
        for arena in self.arenas:
            local = arena.translate(lo, span)
            if local is not None:
                return local - lo
        return None

    def _run(self, link, plan: Plan, remote: RemoteCache, deadline: float, write: bool) -> bool:
        """Move the plan; True if it went through the peer's agent (socket fallback)."""
        delta = self._delta(remote)
        if delta is not None:
            native.copy_plan(plan.rebase(dst_delta=delta) if write else plan.rebase(src_delta=delta))
        elif self.cma_ok and remote.cache_id != ANY_CACHE:
            try:
                native.cma_plan(self.pid, plan, write=write)
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    link.mark_broken(f"peer process {self.pid} is gone")
                    raise_error(LLMStatusCode.LLM_LINK_FAILED,
                                f"link to cluster {link.remote_cluster_id} is broken: peer process {self.pid} exited")
                raise_error(LLMStatusCode.LLM_FAILED,
                            f"cross-memory copy with cluster {link.remote_cluster_id} (pid {self.pid}) failed: {exc}")
        else:
            if not self._told_fallback:
                self._told_fallback = True
                log.info("link to cluster %d: memory outside the peer's pools (registered caches%s) goes over "
                         "the socket", link.remote_cluster_id,
                         "" if self.cma_ok else "; cross-memory attach is not permitted")
            (self.fallback.push if write else self.fallback.pull)(link, plan, remote, deadline)
            return True
        link.check_alive()
        return False

    def push(self, link, plan: Plan, remote: RemoteCache, deadline: float) -> bool:
        return self._run(link, plan, remote, deadline, True)

    def pull(self, link, plan: Plan, remote: RemoteCache, deadline: float) -> None:
        self._run(link, plan, remote, deadline, False)

    def close(self) -> None:
        for arena in self.arenas:
            arena.close()
        self.arenas = []
