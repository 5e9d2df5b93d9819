"""The one JSON record of ``python -m datadist.bench`` and ``python -m ems.bench``.

Every row both benches print with ``--json`` has the fields of ``peer_bench.py`` (the peer
systems' bench), so rows of ours and of the peers compare field by field:

========================  ======================================================================
``system``                what ran: ``datadist-shm``, ``datadist-tcp``, ``ems``, ...
``workload``              the workload (datadist) or operation (ems: save, load, exists)
``gbps``                  payload bytes per second of one call, median, in GB/s (0 for exists)
``batch_ms``              one call, median, ms
``p50_us`` / ``p99_us``   one call, percentiles, microseconds
``block_kib``             bytes of one block (one tensor's block for datadist), KiB
``blocks``                blocks per call
``scatter``               whether destination blocks are in random order
``raw_copy_gbps``         a plain copy of the same bytes in one process, in the same run (numpy,
                          or torch on a GPU): a yardstick, not a ceiling; the engine's own copies
                          use several threads and streaming stores and can beat it
``ratio``                 ``gbps / raw_copy_gbps``
``verified``              whether the bytes that arrived were checked against the source
``executor``              the copy executor (``host`` or ``torch``)
``device``                where the caches lived (``cpu``, ``cuda``)
========================  ======================================================================

The layer-wise workload (``kv-7b``: several requests at once, each pushing one layer per
call) reads ``gbps`` and ``batch_ms`` as the whole batch (every call of every request, wall
time from the first request's start to the last one's end), ``p50_us`` / ``p99_us`` as one
layer call over all calls of all rounds, and ``blocks`` as blocks per call; it adds
``requests``, ``layers``, ``calls`` (calls in a batch), ``rounds`` (timed batches) and
``call_mib`` (payload of one call).  The fan-in workload (``fan-in``: several decoder
processes pulling from one prompt at once) reads ``gbps`` as the aggregate of all decoders
(every pulled byte over the wall time from the first decoder's start to the last one's end),
``batch_ms`` as that wall time per round (one pull of each decoder) and ``p50_us`` /
``p99_us`` as one pull over all pulls; it adds ``decoders``, ``rounds``, ``calls`` (pulls in
all), ``call_kib`` (payload of one pull) and ``checked_blocks``.  Rows of ``datadist.bench``
add ``hog``: the busy processes that ran beside the measured ones (``--hog``, 0 without),
``nice``: the niceness the measured processes ran at (``--nice``, 0 without), and
``checksum``: whether the transfers carried end-to-end checksums (``--checksum``).
Other rows may add fields of their own after these.
"""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["FIELDS", "record"]

FIELDS = ("system", "workload", "gbps", "batch_ms", "p50_us", "p99_us", "block_kib", "blocks", "scatter",
          "raw_copy_gbps", "ratio", "verified", "executor", "device")


def record(*, system: str, workload: str, gbps: float, batch_ms: float, p50_us: float, p99_us: float,
           block_kib: float, blocks: int, scatter: bool, raw_copy_gbps: float, verified: bool, executor: str,
           device: str = "cpu", **extra: Any) -> Dict[str, Any]:
    """One row with every field of :data:`FIELDS`, in that order, then ``extra``."""
    row: Dict[str, Any] = {
        "system": system, "workload": workload, "gbps": round(gbps, 3), "batch_ms": round(batch_ms, 3),
        "p50_us": round(p50_us, 1), "p99_us": round(p99_us, 1), "block_kib": block_kib, "blocks": blocks,
        "scatter": scatter, "raw_copy_gbps": round(raw_copy_gbps, 3),
        "ratio": round(gbps / raw_copy_gbps, 3) if gbps and raw_copy_gbps else None,
        "verified": verified, "executor": executor, "device": device,
    }
    row.update(extra)
    return row
