"""Many threads of one engine moving blocks over one link at once (requests of a batch,
each pushing or pulling its own blocks, as a serving engine's workers do): every call
returns without error and every byte lands where its own call put it, whichever thread
ran it (the link's holder runs prepared transfers queued behind it)."""
from __future__ import annotations

import numpy as np
import pytest

from harness import DECODER_ID, PROMPT_ID, Desc, Pair, Ref, blocks_key, expect_blocks

pytestmark = pytest.mark.timeout(120)

#: 8 tensors (4 layers of K,V) of 32 blocks of 2 KiB.
CACHE = Desc(8, (32, 16, 64), "fp16")
THREADS = 8


def _requests() -> list[tuple[list[int], list[int], range]]:
    """Per thread: its own source blocks, scattered destination blocks, and a layer range."""
    order = np.random.default_rng(11).permutation(32).tolist()
    return [([4 * r, 4 * r + 1, 4 * r + 2, 4 * r + 3], order[4 * r:4 * r + 4], range(r % 4, r % 4 + 1))
            for r in range(THREADS)]


@pytest.mark.parametrize("push", [True, False], ids=["push", "pull"])
def test_concurrent_transfers_on_one_link_each_move_their_own_blocks(pair: Pair, push: bool) -> None:
    pair.prompt.alloc("src", CACHE, blocks=True, bkey=blocks_key(PROMPT_ID, 5))
    src = pair.prompt.fill("src", CACHE, 21)
    pair.decoder.alloc("dst", CACHE, blocks=True, bkey=blocks_key(DECODER_ID, 5))
    dst = pair.decoder.fill("dst", CACHE, 22)
    # a push from the prompt into the decoder's blocks, or the decoder pulling the same
    key, local, caller = (blocks_key(DECODER_ID, 5), "src", pair.prompt) if push else \
        (blocks_key(PROMPT_ID, 5), "dst", pair.decoder)
    calls = [([key, Ref(local), s, d], {"src_layer_range": layers, "dst_layer_range": layers})
             for s, d, layers in _requests()]
    errors = caller.call("concurrent", "push_blocks" if push else "pull_blocks", calls, 40)
    assert errors == [None] * THREADS
    for s, d, layers in _requests():
        dst = expect_blocks(dst, src, s, d, CACHE.row_bytes, src_layers=layers, dst_layers=layers)
    np.testing.assert_array_equal(pair.decoder.read("dst"), dst)
