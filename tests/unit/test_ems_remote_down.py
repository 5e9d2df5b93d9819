"""The remote tier after a fault: down for ``DOWN_S`` (reads miss, stores fail, nothing
sent to Redis, each skip counted), then tried again."""
from __future__ import annotations

from typing import Any, List

import pytest

from ems.server.tiers import remote
from ems.server.tiers.remote import RedisTier


class _Failing:
    """A Redis client whose every call fails (a node that went silent)."""

    def __init__(self) -> None:
        self.calls: List[str] = []

    def get(self, key: str) -> Any:
        self.calls.append("get")
        raise TimeoutError("Timeout connecting to server")

    def set(self, key: str, value: Any, ex: Any = None) -> Any:
        self.calls.append("set")
        raise TimeoutError("Timeout connecting to server")


def test_a_fault_marks_the_tier_down_until_the_window_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(remote.time, "monotonic", lambda: now[0])
    client = _Failing()
    tier = RedisTier(client, "redis+cluster://h:7000")
    assert tier.load("", "a", lambda n: bytearray(n)) is None
    assert client.calls == ["get"]
    assert tier.load("", "b", lambda n: bytearray(n)) is None
    assert tier.store("", "c", memoryview(b"x"), 0) is False
    assert tier.exists("", ["d", "e"]) == [False, False]
    assert client.calls == ["get"], "the tier asked Redis while it was down"
    assert tier.stats()["errors"] == 1 and tier.stats()["skipped"] == 3
    now[0] += remote.DOWN_S
    assert tier.store("", "c", memoryview(b"x"), 0) is False
    assert client.calls == ["get", "set"], "the tier did not try Redis again after the window"
