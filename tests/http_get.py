"""One HTTP GET for the tests of the metrics endpoints: the status and the body, also of
an error answer (``/healthz`` answers 503 when not ready)."""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Tuple

__all__ = ["http_get"]


def http_get(url: str, timeout_s: float = 10.0) -> Tuple[int, str]:
    """``(status, body)`` of a GET of ``url``; connection errors raise ``OSError``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
