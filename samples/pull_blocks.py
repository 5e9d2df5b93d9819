"""pull_blocks: the decoder engine reads KV blocks out of the prompt's blocks cache.

The prompt allocates a blocks cache named ``BlocksCacheKey(PROMPT_CLUSTER_ID, 0)`` and
fills it; the decoder links to it and pulls

1. blocks [0, 1, 2, 3] of every layer into blocks [3, 2, 1, 0] (any block order is legal;
   runs that ascend on both sides are coalesced into one copy, these are four copies);
2. blocks [5, 6] of layer 0 into blocks [6, 7] of layer 3 (a pull may move layers:
   ``src_layer_range`` and ``dst_layer_range`` only need the same length).

The decoder checks every byte of its cache: the pulled blocks hold the prompt's data, all
other blocks are still zero.  Exits 0 when all bytes match.
"""
from __future__ import annotations

import sys

import torch

from _launch import (BLOCK_TOKENS, DECODER_CLUSTER_ID, KV_SHAPE, NUM_TENSORS, PROMPT_CLUSTER_ID, Peer, blocks_cache,
                     engine, expect_tensors, linked, listening, run_sample, source_tensors)
from datadist import BlocksCacheKey, CacheDesc, DataType, LLMRole, Placement

CACHE_DESC = CacheDesc(NUM_TENSORS, [8, BLOCK_TOKENS, *KV_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
SEED = 2


def run_prompt_sample(peer: Peer, transport: str) -> None:
    with engine(LLMRole.PROMPT, PROMPT_CLUSTER_ID, transport, listen=True) as datadist:
        with blocks_cache(datadist.cache_manager, CACHE_DESC, BlocksCacheKey(PROMPT_CLUSTER_ID, 0), seed=SEED):
            listening(peer, datadist)
            peer.barrier("pulled")  # the decoder has checked its data and unlinked


def run_decoder_sample(peer: Peer, transport: str) -> None:
    with engine(LLMRole.DECODER, DECODER_CLUSTER_ID, transport) as datadist:
        cache_manager = datadist.cache_manager
        with blocks_cache(cache_manager, CACHE_DESC) as (cache, tensors), \
                linked(peer, datadist, {PROMPT_CLUSTER_ID: "prompt"}, done="pulled"):
            src_key = BlocksCacheKey(PROMPT_CLUSTER_ID, 0)
            cache_manager.pull_blocks(src_key, cache, src_blocks=[0, 1, 2, 3], dst_blocks=[3, 2, 1, 0])
            cache_manager.pull_blocks(src_key, cache, src_blocks=[5, 6], dst_blocks=[6, 7],
                                      src_layer_range=range(0, 1), dst_layer_range=range(3, 4), tensor_num_per_layer=2)

            source = source_tensors(NUM_TENSORS, CACHE_DESC.shape, torch.float16, SEED)
            expected = [torch.zeros_like(t) for t in tensors]
            for want, src in zip(expected, source):
                want[[3, 2, 1, 0]] = src[[0, 1, 2, 3]]
            for dst, src in ((6, 0), (7, 1)):  # layer 0 (K0, V0) -> layer 3 (K3, V3)
                expected[dst][[6, 7]] = source[src][[5, 6]]
            expect_tensors(tensors, expected)


if __name__ == "__main__":
    sys.exit(run_sample("pull_blocks", __doc__, {"prompt": run_prompt_sample, "decoder": run_decoder_sample}))
