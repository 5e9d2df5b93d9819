"""What an engine counts: transfers, bytes and latencies by operation, transport and
outcome, and the life of its links.

Counting must cost a transfer next to nothing (a 4 KiB push over shared memory takes a few
microseconds), so the hot path only adds to plain ints of a per-link :class:`LinkMeter`,
with no lock of its own: a link's meter is written only by the thread that holds the
link's ``lock`` (one transfer at a time, :mod:`.link`), and it is read, never written, by
a snapshot.  Failures that happen before a transfer gets the link (it stayed busy past the
deadline) are rare and counted apart, under a lock of the meter.  When a link is released its
counts move into the engine's totals under that lock, in the same step that drops the
link's meter from the live set, so a snapshot (taken under the lock too) never counts a
transfer twice and a counter never goes down.

Nothing here needs ``prometheus_client``: :meth:`EngineMetrics.snapshot` is a plain dict
(``LLMDataDist.metrics()``), and :mod:`.exporter` turns snapshots into Prometheus families.
"""
from __future__ import annotations

import threading
import time
from array import array
from bisect import bisect_left
from typing import Any, Callable, Dict, Iterable, List, NoReturn, Optional, Protocol, Sequence, Tuple

from . import _native
from .errors import Fault

__all__ = ["LATENCY_BOUNDS", "OPERATIONS", "OpCounts", "LinkMeter", "EngineMetrics", "code_name", "cumulative", "outcome_name"]

#: Upper bounds (seconds) of the transfer latency histogram's buckets; +Inf is implied.
#: From a few microseconds (a small same-host copy) to the default ``sync_kv_timeout`` and
#: beyond.
LATENCY_BOUNDS: Tuple[float, ...] = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0)

#: The operations a transfer is counted under (``LLMDataDist``'s calls that move bytes).
OPERATIONS: Tuple[str, ...] = ("push_blocks", "pull_blocks", "push_cache", "pull_cache", "transfer_cache_async")

#: The outcome of a transfer that went through (the name of status code 0).
SUCCESS = "LLM_SUCCESS"

#: The clock of latencies: the one deadlines are computed with, so a transfer's start
#: costs no second read (``_native.meter_moved`` reads the same clock, CLOCK_MONOTONIC).
_clock = time.monotonic

_native.meter_bounds(array("q", [round(b * 1e9) for b in LATENCY_BOUNDS]))
_moved = _native.meter_moved


class _Counted(Protocol):
    """A transfer as a batch counts it: its operation and when it began."""

    @property
    def op(self) -> str: ...

    @property
    def start(self) -> float: ...


def outcome_name(exc: BaseException) -> str:
    """The engine's own label of a failure: the name of its fault for an engine error,
    else ``FAILED``.  The API layer installs its status-code names instead
    (:attr:`EngineMetrics.outcome_of`)."""
    return code_name(int(getattr(exc, "fault", Fault.FAILED)))


def code_name(code: int) -> str:
    """The engine's own label of a status code: its fault's name."""
    return Fault.of(code).name


class OpCounts:
    """Counts of one operation: failed transfers by outcome, bytes moved, and the latency
    histogram of every transfer (bucket i counts latencies in
    ``(LATENCY_BOUNDS[i-1], LATENCY_BOUNDS[i]]``, the last one those above every bound);
    the transfers that went through are the histogram's count less the failures, so a
    successful one costs no counter of its own.

    The bytes, the latencies' sum (in nanoseconds) and the buckets are the int64 ``cells``
    ``[bytes, nanoseconds, bucket 0 .. bucket B]``, which a transfer that went through
    counts into with one C call (``_native.meter_moved``: the clock, the bucket and three
    additions, a few times cheaper than the same in Python)."""

    __slots__ = ("failed", "cells")

    def __init__(self) -> None:
        self.failed: Dict[str, int] = {}
        self.cells = array("q", bytes(8 * (len(LATENCY_BOUNDS) + 3)))

    @property
    def bytes(self) -> int:
        """Bytes moved by the transfers that went through."""
        return self.cells[0]

    @property
    def seconds(self) -> float:
        """Sum of every transfer's latency."""
        return self.cells[1] / 1e9

    @property
    def buckets(self) -> List[int]:
        """The histogram's counts, one per bucket (not cumulative)."""
        return self.cells[2:].tolist()

    @property
    def ok(self) -> int:
        """Transfers that went through."""
        return sum(self.cells[2:]) - sum(self.failed.values())

    def observe(self, seconds: float) -> None:
        self.cells[1] += round(seconds * 1e9)
        self.cells[2 + bisect_left(LATENCY_BOUNDS, seconds)] += 1

    def add(self, other: "OpCounts") -> None:
        for outcome, n in list(other.failed.items()):  # list: a writer may add an outcome meanwhile
            self.failed[outcome] = self.failed.get(outcome, 0) + n
        cells = self.cells
        for i, n in enumerate(other.cells.tolist()):  # tolist: one copy of a cell array a writer adds to
            cells[i] += n

    def copy(self) -> "OpCounts":
        out = OpCounts()
        out.add(self)
        return out


class LinkMeter:
    """The counts of one link (see the module docstring for who writes them).

    ``path`` names the link's transport when a snapshot is taken (a collective link gets
    its transport after the handshake)."""

    __slots__ = ("ops", "unheld", "path", "outcome_of", "_lock")

    def __init__(self, path: Callable[[], str], outcome_of: Callable[[BaseException], str] = outcome_name) -> None:
        #: Written by the holder of the link's lock only.
        self.ops: Dict[str, OpCounts] = {op: OpCounts() for op in OPERATIONS}
        #: Failures of transfers that never held the link's lock (under ``_lock``).
        self.unheld: Dict[str, OpCounts] = {op: OpCounts() for op in OPERATIONS}
        self.path = path
        self.outcome_of = outcome_of
        self._lock = threading.Lock()

    def moved(self, op: str, nbytes: int, start: float) -> None:
        """A transfer of ``nbytes`` that began at ``start`` (``time.monotonic``) went through."""
        _moved(self.ops[op].cells, nbytes, start)

    def failed(self, op: str, exc: BaseException, start: float) -> None:
        """A transfer that began at ``start`` failed with ``exc``."""
        counts = self.ops[op]
        outcome = self.outcome_of(exc)
        counts.failed[outcome] = counts.failed.get(outcome, 0) + 1
        counts.observe(_clock() - start)

    def settled(self, jobs: Sequence[_Counted], outcomes: Sequence[object]) -> None:
        """Count each job by its outcome: what it moved (an object with ``nbytes``), or its error."""
        for job, outcome in zip(jobs, outcomes):
            if isinstance(outcome, BaseException):
                self.failed(job.op, outcome, job.start)
            else:
                self.moved(job.op, getattr(outcome, "nbytes"), job.start)

    def refused(self, op: str, start: float, error: BaseException, transfers: int = 1) -> NoReturn:
        """Count ``transfers`` that never got the link's lock as failed with ``error``, and
        raise it."""
        seconds = _clock() - start
        outcome = self.outcome_of(error)
        with self._lock:
            counts = self.unheld[op]
            counts.failed[outcome] = counts.failed.get(outcome, 0) + transfers
            for _ in range(transfers):
                counts.observe(seconds)
        raise error

    def totals(self) -> Dict[str, OpCounts]:
        """What the meter counted, by operation (a copy)."""
        with self._lock:
            out = {op: counts.copy() for op, counts in self.unheld.items()}
        for op, counts in self.ops.items():
            out[op].add(counts)
        return out


class EngineMetrics:
    """The counts of one engine: its links' meters, what released links counted, link
    attempts and failures; :meth:`snapshot` reads them all as one dict."""

    def __init__(self, cluster_id: int) -> None:
        self.cluster_id = cluster_id
        #: How a failure and a status code are labelled (the API layer sets its status-code names).
        self.outcome_of: Callable[[BaseException], str] = outcome_name
        self.code_name: Callable[[int], str] = code_name
        self._lock = threading.Lock()
        self._live: Dict[int, LinkMeter] = {}
        #: (operation, transport) -> counts of released links.
        self._done: Dict[Tuple[str, str], OpCounts] = {}
        self._attempts: Dict[str, int] = {}
        self._link_failures = 0
        self._relinks = 0
        self._seen: set[tuple[int, bool]] = set()

    # -- links ------------------------------------------------------------------------
    def link_meter(self, path: Callable[[], str]) -> LinkMeter:
        """A meter for a new link, counted from now on."""
        meter = LinkMeter(path, self._outcome)
        with self._lock:
            self._live[id(meter)] = meter
        return meter

    def _outcome(self, exc: BaseException) -> str:
        return self.outcome_of(exc)

    def released(self, meter: LinkMeter) -> None:
        """The link of ``meter`` is released: keep what it counted (idempotent)."""
        with self._lock:
            if self._live.pop(id(meter), None) is not None:
                self._fold(meter)

    def _fold(self, meter: LinkMeter) -> None:
        path = meter.path()
        for op, counts in meter.totals().items():
            self._done.setdefault((op, path), OpCounts()).add(counts)

    def link_attempt(self, code: int) -> None:
        """A link attempt (this end dialled) ended with status ``code`` (0: linked)."""
        outcome = self.code_name(code)
        with self._lock:
            self._attempts[outcome] = self._attempts.get(outcome, 0) + 1

    def installed(self, remote_cluster_id: int, dialled: bool) -> None:
        """A link to ``remote_cluster_id`` (``dialled`` by this end, or accepted) is ready;
        one where such a link was before is a relink."""
        with self._lock:
            key = (remote_cluster_id, dialled)
            if key in self._seen:
                self._relinks += 1
            self._seen.add(key)

    def link_failed(self) -> None:
        """A link broke (its peer went away, a stream was lost or timed out)."""
        with self._lock:
            self._link_failures += 1

    # -- reading --------------------------------------------------------------------------
    def _totals(self) -> Dict[Tuple[str, str], OpCounts]:
        with self._lock:
            totals = {key: counts.copy() for key, counts in self._done.items()}
            for meter in self._live.values():
                path = meter.path()
                for op, counts in meter.totals().items():
                    totals.setdefault((op, path), OpCounts()).add(counts)
        return totals

    def snapshot(self, gauges: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Everything counted so far as plain data (the shape ``LLMDataDist.metrics()``
        documents), with ``gauges`` (links up, pools, agent queue) merged in."""
        transfers: List[Dict[str, Any]] = []
        latency: List[Dict[str, Any]] = []
        timeouts: Dict[str, int] = {}
        for (op, path), counts in sorted(self._totals().items()):
            outcomes = ([(SUCCESS, counts.ok)] if counts.ok else []) + sorted(counts.failed.items())
            for outcome, n in outcomes:
                transfers.append({"operation": op, "transport": path, "outcome": outcome, "count": n,
                                  "bytes": counts.bytes if outcome == SUCCESS else 0})
            n = sum(counts.buckets)
            if n:
                latency.append({"operation": op, "transport": path, "count": n, "sum_seconds": counts.seconds,
                                "buckets": cumulative(counts.buckets)})
            timed_out = sum(v for k, v in counts.failed.items() if k.endswith("TIMEOUT"))
            if timed_out:
                timeouts[op] = timeouts.get(op, 0) + timed_out
        with self._lock:
            links = {"failures": self._link_failures, "relinks": self._relinks, "attempts": dict(self._attempts)}
        out: Dict[str, Any] = {"cluster_id": self.cluster_id, "transfers": transfers, "latency": latency,
                               "timeouts": timeouts, "links": links}
        for key, value in (gauges or {}).items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key].update(value)
            else:
                out[key] = value
        return out


def cumulative(buckets: Iterable[int]) -> List[Tuple[float, int]]:
    """Per-bucket counts as Prometheus' cumulative ``(le, count)`` pairs, +Inf last."""
    out: List[Tuple[float, int]] = []
    total = 0
    for bound, n in zip((*LATENCY_BOUNDS, float("inf")), buckets):
        total += n
        out.append((bound, total))
    return out
