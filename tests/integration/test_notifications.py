"""``send_notification``/``get_notifications``: application messages over a link, from the
engine that linked to the one it linked to, in order with the link's transfers, filed
under the authenticated peer."""
from __future__ import annotations

import time
from typing import Any, List, Tuple

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import DECODER_ID, PROMPT_ID, Desc, PeerError, Ref, base_config, blocks_key, expect_blocks, free_port

pytestmark = pytest.mark.timeout(120)

BLOCKS = Desc(2, (4, 8, 32), "fp16")


def _linked(peer_factory: Any, transport: str = "shm") -> Tuple[Any, Any]:
    port = free_port()
    prompt = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID, base_config(transport, listen_port=port))
    prompt.register("kv", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    dec = peer_factory("peer", "decoder", "DECODER", DECODER_ID, base_config(transport))
    dec.alloc("dst", BLOCKS, blocks=True)
    dec.link(prompt, port=port)
    return prompt, dec


def _collect(peer: Any, count: int, deadline_s: float = 10.0) -> List[Any]:
    """Notifications of ``peer`` until ``count`` have come (each call is a round trip to
    the child, so this polls without sleeping); fails at the deadline."""
    got: List[Any] = []
    end = time.monotonic() + deadline_s
    while len(got) < count:
        assert time.monotonic() < end, f"only {got} of {count} notifications arrived"
        got.extend(tuple(n) for n in peer.call("engine", "get_notifications"))
    return got


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_notes_arrive_in_order_under_the_sender(peer_factory: Any, transport: str) -> None:
    prompt, dec = _linked(peer_factory, transport)
    texts = ["first", "второй ✓", "x" * (60 << 10)]
    for text in texts:
        assert dec.call("engine", "send_notification", PROMPT_ID, text) is None
    assert _collect(prompt, 3) == [(DECODER_ID, t) for t in texts]
    assert prompt.call("engine", "get_notifications") == []  # taken once


def test_a_note_after_a_push_finds_the_pushed_bytes(peer_factory: Any) -> None:
    prompt, dec = _linked(peer_factory)
    before = prompt.read("kv")
    data = dec.fill("dst", BLOCKS, 9)
    dec.cm("push_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0, 1], [2, 3])
    dec.call("engine", "send_notification", PROMPT_ID, "pushed")
    assert _collect(prompt, 1) == [(DECODER_ID, "pushed")]
    np.testing.assert_array_equal(prompt.read("kv"), expect_blocks(before, data, [0, 1], [2, 3], BLOCKS.row_bytes))


def test_notes_go_from_the_linking_engine_only(peer_factory: Any) -> None:
    prompt, dec = _linked(peer_factory)
    with pytest.raises(PeerError) as info:
        prompt.call("engine", "send_notification", DECODER_ID, "back")
    assert info.value.status_code == S.LLM_NOT_YET_LINK and "link_clusters" in info.value.message
    with pytest.raises(PeerError) as info:
        dec.call("engine", "send_notification", 77, "nobody")
    assert info.value.status_code == S.LLM_NOT_YET_LINK


@pytest.mark.parametrize("message, error", [("y" * ((60 << 10) + 1), "LLMException"), ("\ud800", "LLMException"),
                                            (b"bytes", "TypeError")])
def test_bad_notes_are_refused_and_send_nothing(peer_factory: Any, message: Any, error: str) -> None:
    prompt, dec = _linked(peer_factory)
    with pytest.raises(PeerError) as info:
        dec.call("engine", "send_notification", PROMPT_ID, message)
    assert info.value.is_a(error), info.value
    if error == "LLMException":
        assert info.value.status_code == S.LLM_PARAM_INVALID and "message" in info.value.message
    dec.call("engine", "send_notification", PROMPT_ID, "after")
    assert _collect(prompt, 1) == [(DECODER_ID, "after")]  # the link still works; nothing else came


def test_a_wait_ends_when_a_note_comes_or_at_its_timeout(peer_factory: Any) -> None:
    prompt, dec = _linked(peer_factory)
    start = time.monotonic()
    assert prompt.call("engine", "get_notifications", 300) == []  # nothing came: the whole wait
    assert time.monotonic() - start >= 0.3
    pending = prompt.start_call("engine", "get_notifications", 20_000)
    start = time.monotonic()
    dec.call("engine", "send_notification", PROMPT_ID, "now")
    assert [tuple(n) for n in pending.result(30)] == [(DECODER_ID, "now")]
    assert time.monotonic() - start < 10  # woken by the note, not by the timeout
    for bad in (-1, 3_600_001, 1.5):
        with pytest.raises(PeerError) as info:
            prompt.call("engine", "get_notifications", bad)
        assert info.value.status_code == S.LLM_PARAM_INVALID and "timeout_ms" in info.value.message
