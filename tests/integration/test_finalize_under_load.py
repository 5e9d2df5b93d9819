"""``finalize`` while transfers run: every call in flight on the finalizing engine, and
every call its peer has in flight to it, ends with a status (an ``LLMException``) within
a bound: none hangs, none dies of something else, the process survives."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import pytest

from datadist import LLMStatusCode as S
from harness import DECODER_ID, PROMPT_ID, TRANSPORTS, Desc, Ref, blocks_key

pytestmark = pytest.mark.timeout(90)

BLOCKS = Desc(8, (16, 16, 64), "fp16")  # 8 tensors of 16 blocks
ALL = list(range(16))
THREADS = 3
#: Seconds within which every call in flight must end once finalize has begun.
BOUND_S = 20.0
#: What a call racing with finalize may end with.
ENDINGS = {int(S.LLM_ENGINE_FINALIZED), int(S.LLM_LINK_FAILED), int(S.LLM_NOT_YET_LINK),
           int(S.LLM_TIMEOUT), int(S.LLM_KV_CACHE_NOT_EXIST)}


def _check(errors: List[Optional[Dict[str, Any]]]) -> None:
    assert all(e is not None for e in errors), f"calls still running {BOUND_S} s after finalize: {errors}"
    for e in errors:
        assert e is not None and e["error"] == "LLMException", e
        assert e["status_code"] in ENDINGS, e


def _linked_pair(peer_factory: Any, transport: str) -> Tuple[Any, Any]:
    """A linked prompt and decoder, each with its blocks cache (source, destination)."""
    p, d = peer_factory("pair", transport).peers()
    p.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID))
    d.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID))
    return p, d


@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t in ("shm", "tcp")])
def test_finalize_ends_the_calls_in_flight_with_a_status(peer_factory: Any, transport: str) -> None:
    p, d = _linked_pair(peer_factory, transport)
    pull = ("pull_blocks", (blocks_key(PROMPT_ID), Ref("dst"), ALL, ALL), {})
    out = d.call("finalize_under_load", *pull, THREADS, BOUND_S, timeout=BOUND_S + 30)
    assert min(out["calls"]) >= 1
    _check(out["errors"])
    assert d.call("ping")  # the process survived its engine


@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t in ("shm", "tcp")])
def test_the_peer_of_a_finalized_engine_gets_a_status(peer_factory: Any, transport: str) -> None:
    p, d = _linked_pair(peer_factory, transport)
    pending = d.start_call("loop", "pull_blocks", (blocks_key(PROMPT_ID), Ref("dst"), ALL, ALL), {}, BOUND_S + 10)
    assert pending.note() == "running"
    p.call("finalize")
    out = pending.result(BOUND_S + 30)
    assert out["iterations"] >= 1
    _check([out])
