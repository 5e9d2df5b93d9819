"""A link fails correctly: a one-sided push into a dead peer is an error, never a silent
success, and bytes of one element type never land in a cache of another."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import DECODER_ID, PROMPT_ID, Desc, Ref, blocks_key, expect_llm

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
