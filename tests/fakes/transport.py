"""A transport in memory: runs each plan with the process's executor (both sides are
addresses of this process) or fails as scripted, and records what it was asked."""
from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional, Tuple

from datadist.engine import executor
from datadist.engine.layout import Plan
from datadist.engine.transports.base import Channel, RemoteCache, Transport


class FakeTransport(Transport):
    """``failures`` are raised by the next calls, one each (None: that call succeeds);
    ``one_sided`` is what a successful push returns (True: the peer's agent took part)."""

    name = "fake"

    def __init__(self, failures: Tuple[Optional[BaseException], ...] = (), one_sided: bool = True) -> None:
        self.failures: Deque[Optional[BaseException]] = deque(failures)
        self.one_sided = one_sided
        self.calls: List[Tuple[str, Plan, RemoteCache]] = []
        self.closed = False

    def _run(self, what: str, plan: Plan, remote: RemoteCache) -> None:
        self.calls.append((what, plan, remote))
        failure = self.failures.popleft() if self.failures else None
        if failure is not None:
            raise failure
        executor.copy_plan(plan)

    def push(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> bool:
        self._run("push", plan, remote)
        return not self.one_sided

    def pull(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> None:
        self._run("pull", plan, remote)

    def close(self) -> None:
        self.closed = True
