"""``wait_work``: a collective that never completes (HCCL's ``Work.wait`` ignores its
timeout) ends at the deadline with the group aborted, never a hang."""
from __future__ import annotations

import time

import pytest

from datadist.engine.transports.collective import wait_work


class _Work:
    def __init__(self, done_after: float, error: Exception = None) -> None:
        self.t = time.monotonic() + done_after
        self.error = error
        self.waited = 0

    def is_completed(self) -> bool:
        return time.monotonic() >= self.t

    def wait(self, *args) -> bool:
        self.waited += 1
        if not self.is_completed():
            raise AssertionError("wait() called before completion: it could block for good")
        if self.error is not None:
            raise self.error
        return True


class _Group:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


def test_stuck_work_times_out_and_aborts_the_group() -> None:
    group, work = _Group(), _Work(done_after=3600)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        wait_work(work, t0 + 0.2, group, poll=True)
    assert 0.2 <= time.monotonic() - t0 < 1.0
    assert group.aborted == 1 and work.waited == 0


def test_completed_work_returns_and_surfaces_its_error() -> None:
    group = _Group()
    wait_work(_Work(done_after=0.01), time.monotonic() + 5, group, poll=True)
    with pytest.raises(RuntimeError, match="peer"):
        wait_work(_Work(done_after=0, error=RuntimeError("peer reset")), time.monotonic() + 5, group, poll=True)
    assert group.aborted == 0


class _HcclGroup:
    """torch_npu's binding: ``abort_hccl_comm(reason)``, and no ``abort``."""

    def __init__(self) -> None:
        self.reasons: list = []

    def abort_hccl_comm(self, reason: str) -> None:
        self.reasons.append(reason)


def test_an_hccl_group_is_aborted_through_abort_hccl_comm() -> None:
    group = _HcclGroup()
    with pytest.raises(TimeoutError):
        wait_work(_Work(done_after=3600), time.monotonic() + 0.05, group, poll=True)
    assert group.reasons == ["deadline passed"]
