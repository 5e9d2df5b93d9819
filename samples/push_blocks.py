"""push_blocks: the prompt engine writes KV blocks into the decoder's blocks cache.

The decoder allocates a blocks cache named ``BlocksCacheKey(DECODER_CLUSTER_ID, 0)`` and
links to the prompt engine.  The prompt then pushes

1. blocks [0, 1, 2, 3] of every layer into blocks [4, 5, 6, 7];
2. block 6 of layer 2 only into block 1 (``src_layer_range == dst_layer_range``: a push
   keeps layers in place, as when a prefill sends each layer once it is computed).

The decoder checks every byte of its cache: the pushed blocks hold the prompt's data, all
other blocks are still zero.  Exits 0 when all bytes match.
"""
from __future__ import annotations

import sys

import torch

from _launch import (BLOCK_TOKENS, DECODER_CLUSTER_ID, KV_SHAPE, NUM_TENSORS, PROMPT_CLUSTER_ID, Peer, blocks_cache,
                     engine, expect_tensors, linked, listening, run_sample, source_tensors)
from datadist import BlocksCacheKey, CacheDesc, DataType, LLMRole, Placement

CACHE_DESC = CacheDesc(NUM_TENSORS, [8, BLOCK_TOKENS, *KV_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
SEED = 1


def run_prompt_sample(peer: Peer, transport: str) -> None:
    with engine(LLMRole.PROMPT, PROMPT_CLUSTER_ID, transport, listen=True) as datadist:
        cache_manager = datadist.cache_manager
        with blocks_cache(cache_manager, CACHE_DESC, seed=SEED) as (cache, _):
            listening(peer, datadist)
            peer.barrier("decoder ready")  # linked, destination cache allocated

            dst_key = BlocksCacheKey(DECODER_CLUSTER_ID, 0)
            cache_manager.push_blocks(dst_key, cache, src_blocks=[0, 1, 2, 3], dst_blocks=[4, 5, 6, 7])
            cache_manager.push_blocks(dst_key, cache, src_blocks=[6], dst_blocks=[1], src_layer_range=range(2, 3),
                                      dst_layer_range=range(2, 3), tensor_num_per_layer=2)
            peer.barrier("pushed")
            peer.barrier("checked")  # the decoder has unlinked


def run_decoder_sample(peer: Peer, transport: str) -> None:
    with engine(LLMRole.DECODER, DECODER_CLUSTER_ID, transport) as datadist:
        with blocks_cache(datadist.cache_manager, CACHE_DESC, BlocksCacheKey(DECODER_CLUSTER_ID, 0)) as (_, tensors), \
                linked(peer, datadist, {PROMPT_CLUSTER_ID: "prompt"}, done="checked"):
            peer.barrier("decoder ready")
            peer.barrier("pushed")

            source = source_tensors(NUM_TENSORS, CACHE_DESC.shape, torch.float16, SEED)
            expected = [torch.zeros_like(t) for t in tensors]
            for want, src in zip(expected, source):
                want[4:8] = src[0:4]
            for index in (4, 5):  # layer 2: K2, V2
                expected[index][1] = source[index][6]
            expect_tensors(tensors, expected)


if __name__ == "__main__":
    sys.exit(run_sample("push_blocks", __doc__, {"prompt": run_prompt_sample, "decoder": run_decoder_sample}))
