"""A link fails correctly: a one-sided push into a dead peer is an error, never a silent
success, and bytes of one element type never land in a cache of another."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import DECODER_ID, PROMPT_ID, Desc, PeerError, Ref, base_config, blocks_key, expect_llm, free_port

pytestmark = pytest.mark.timeout(120)

BLOCKS = Desc(4, (8, 8, 32), "fp16")


@pytest.mark.parametrize("attempt", range(4))
def test_shm_push_into_a_killed_peer_fails(peer_factory: Any, attempt: int) -> None:
    pair = peer_factory("pair", "shm")
    p, d = pair.peers()
    p.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    d.alloc("src", BLOCKS, blocks=True)
    d.fill("src", BLOCKS, 3)
    d.cm("push_blocks", blocks_key(PROMPT_ID, 1), Ref("src"), [0], [0])  # the mapping is in place
    p.kill()
    with expect_llm(S.LLM_LINK_FAILED) as seen:
        d.cm("push_blocks", blocks_key(PROMPT_ID, 1), Ref("src"), [1, 2], [1, 2])
    assert "exited" in seen[0].message or "broken" in seen[0].message


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dtype_mismatch_is_refused_naming_both(peer_factory: Any, transport: str) -> None:
    pair = peer_factory("pair", transport)
    p, d = pair.peers()
    p.alloc("src", Desc(4, (8, 16, 32), "uint8"), blocks=True, bkey=blocks_key(PROMPT_ID, 2))  # 512-byte blocks
    d.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 2))                        # fp16, 512 bytes too
    p.fill("src", Desc(4, (8, 16, 32), "uint8"), 4)
    before = d.fill("dst", BLOCKS, 5)
    with expect_llm(S.LLM_PARAM_INVALID) as seen:
        d.cm("pull_blocks", blocks_key(PROMPT_ID, 2), Ref("dst"), [0], [0])
    assert "DT_UINT8" in seen[0].message and "DT_FLOAT16" in seen[0].message
    with expect_llm(S.LLM_PARAM_INVALID):
        p.cm("push_blocks", blocks_key(DECODER_ID, 2), Ref("src"), [1], [1])
    np.testing.assert_array_equal(d.read("dst"), before)


def test_a_shm_copy_stops_at_sync_kv_timeout(peer_factory: Any) -> None:
    """A one-sided copy bounded by sync_kv_timeout: 768 MiB cannot move in 20 ms, so the
    push is LLM_TIMEOUT (not a late success), and the link still serves the next push."""
    big = Desc(2, (96, 4096, 1024), "uint8")  # 4 MiB blocks, 384 MiB per tensor
    pool = '{"memory_size": 1073741824, "page_shift": 16}'
    prompt = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID,
                          base_config("shm", listen_port=free_port(), sync_kv_timeout=20, host_mem_pool_cfg=pool,
                                       mem_pool_cfg=pool))
    decoder = peer_factory("peer", "decoder", "DECODER", DECODER_ID,
                           base_config("shm", sync_kv_timeout=20, host_mem_pool_cfg=pool,
                                       mem_pool_cfg=pool))
    prompt.wait_ready()
    decoder.wait_ready()
    decoder.link(prompt)
    prompt.alloc("dst", big, blocks=True, bkey=blocks_key(PROMPT_ID, 3))
    decoder.alloc("src", big, blocks=True)
    for _ in range(50):  # the first push also looks the cache up; on a busy machine that may take > 20 ms
        try:
            decoder.cm("push_blocks", blocks_key(PROMPT_ID, 3), Ref("src"), [0], [0])
            break
        except PeerError as exc:
            assert exc.status_code == S.LLM_TIMEOUT, exc
    else:
        pytest.fail("a 4 MiB push never finished within 20 ms")
    everything = list(range(96))
    with expect_llm(S.LLM_TIMEOUT) as seen:
        decoder.cm("push_blocks", blocks_key(PROMPT_ID, 3), Ref("src"), everything, everything)
    assert "sync_kv_timeout" in seen[0].message and "undefined" in seen[0].message
    for _ in range(50):
        try:
            decoder.cm("push_blocks", blocks_key(PROMPT_ID, 3), Ref("src"), [1], [1])
            return
        except PeerError as exc:
            assert exc.status_code == S.LLM_TIMEOUT, exc
    pytest.fail("the link did not serve a 4 MiB push after the timeout")
