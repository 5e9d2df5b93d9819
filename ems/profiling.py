"""``ENABLE_CC_PROFILING=1``: one JSON line per ContextCaching call under ``EMS_SDK_LOG``.

Record fields: ``ts`` (unix seconds), ``pid``, ``op`` (save / load / exists), ``mode``
(sync / async), ``form``, ``keys``, ``hits``, ``bytes``, ``latency_us``, ``error`` (the
EmsErrorCode name, or null).  The directory (default ``/var/log/ems``) is created if
missing; if it cannot be written, the ``ems`` logger warns once and calls go on.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import IO, Optional

__all__ = ["Profiler", "ENV_ENABLE", "ENV_LOG_DIR", "DEFAULT_LOG_DIR"]

ENV_ENABLE = "ENABLE_CC_PROFILING"
ENV_LOG_DIR = "EMS_SDK_LOG"
DEFAULT_LOG_DIR = "/var/log/ems"

log = logging.getLogger("ems")


class Profiler:
    """Appends profiling records to ``EMS_SDK_LOG/ems_cc_profiling_<pid>.jsonl``."""

    def __init__(self) -> None:
        self.enabled = os.environ.get(ENV_ENABLE, "0") == "1"
        self.directory = os.environ.get(ENV_LOG_DIR) or DEFAULT_LOG_DIR
        self._lock = threading.Lock()
        self._file: Optional[IO[str]] = None
        self._pid = 0
        self._failed = False

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"ems_cc_profiling_{os.getpid()}.jsonl")

    def record(self, op: str, mode: str, form: str, keys: int, hits: int, nbytes: int,
               started: float, error: Optional[str] = None) -> None:
        if not self.enabled or self._failed:
            return
        line = json.dumps({"ts": round(time.time(), 6), "pid": os.getpid(), "op": op, "mode": mode,
                           "form": form, "keys": keys, "hits": hits, "bytes": nbytes,
                           "latency_us": round((time.perf_counter() - started) * 1e6, 1),
                           "error": error}, separators=(",", ":"))
        with self._lock:
            try:
                if self._file is None or self._pid != os.getpid():
                    os.makedirs(self.directory, exist_ok=True)
                    self._file = open(self.path, "a", buffering=1, encoding="utf-8")
                    self._pid = os.getpid()
                self._file.write(line + "\n")
            except OSError as exc:
                self._failed = True
                log.warning("EMS profiling disabled: cannot write under %s: %s", self.directory, exc)

    def close(self) -> None:
        with self._lock:
            if self._file is not None and self._pid == os.getpid():
                self._file.close()
            self._file = None
