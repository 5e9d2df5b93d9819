"""Copies inside this process: between two local caches (copy/swap) or to a peer's arena
that this process has mapped (the shared-memory path reuses it)."""
from __future__ import annotations

from ..engine import native
from ..engine.layout import Plan

__all__ = ["LocalTransport"]


class LocalTransport:
    """Executes a plan whose both sides are addressable here, with the C copy loop."""

    name = "local"

    @staticmethod
    def copy(plan: Plan) -> int:
        """Copy the plan; returns the bytes moved."""
        return native.copy_plan(plan)
