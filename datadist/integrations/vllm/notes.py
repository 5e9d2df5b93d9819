"""The notices a decode worker sends a prefill worker over datadist's notifications
(JSON): ``{"pulled": [request ids], "readers": n}`` (the blocks are pulled, by one of the
``n`` decode ranks that read this prefill rank) and ``{"renew": [request ids]}`` (extend
their lease).  A peer's bytes are not trusted: anything else parses as nothing."""
from __future__ import annotations

import json

__all__ = ["MAX_READERS", "pulled_note", "renew_note", "parse_note", "parse_readers"]

#: The most decode ranks a notice may say read one prefill rank (a peer's count is bounded
#: before it is trusted: a larger one would keep blocks until their lease ends).
MAX_READERS = 1024


def pulled_note(request_ids: list[str], count: int = 1) -> str:
    """The notice that ``request_ids`` are pulled, by one of ``count`` decode ranks that
    read this prefill rank (it frees the blocks after ``count`` notices)."""
    return json.dumps({"pulled": request_ids, "readers": count})


def renew_note(request_ids: list[str]) -> str:
    return json.dumps({"renew": request_ids})


def parse_note(text: str, kind: str = "pulled") -> list[str]:
    """Request ids of a decode worker's notification of ``kind`` (``pulled`` or
    ``renew``); [] for anything else (a peer's bytes are not trusted)."""
    try:
        ids = json.loads(text).get(kind, [])
    except (ValueError, AttributeError):
        return []
    return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []


def parse_readers(text: str) -> int:
    """The count of decode ranks of a ``pulled`` notice (1 when it names none; 0, to be
    ignored, when it is not an integer from 1 to :data:`MAX_READERS`)."""
    try:
        count = json.loads(text).get("readers", 1)
    except (ValueError, AttributeError):
        return 0
    return count if type(count) is int and 1 <= count <= MAX_READERS else 0
