"""The reports of a bench's child processes (decoders of ``fan-in``, clients of
``python -m ems.bench --clients``), read from their pipes in one place."""
from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any, List, Sequence, Tuple, Type

__all__ = ["collect_reports"]


def collect_reports(conns: Sequence[Connection], what: str, who: str, timeout_s: float,
                    error: Type[BaseException] = RuntimeError) -> List[Tuple[Any, ...]]:
    """Each child's next message, which must be a tuple starting with ``what``; raises
    ``error`` naming the first child (``who`` and its index) that sent something else or
    nothing within ``timeout_s``."""
    out = []
    for i, conn in enumerate(conns):
        if not conn.poll(timeout_s):
            raise error(f"{who} {i} sent no {what!r} report within {timeout_s:.0f} s")
        msg = conn.recv()
        if msg[0] != what:
            raise error(f"{who} {i} failed: {msg}")
        out.append(msg)
    return out
