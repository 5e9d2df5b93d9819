"""pull_blocks from a contiguous cache: the decoder pages a prompt's row into its blocks.

A prefill engine that keeps each request's KV in one contiguous row can feed a decoder
that keeps KV in blocks: ``pull_blocks`` with a row key and ``src_blocks=()`` cuts the
row into block-sized chunks and puts chunk i into ``dst_blocks[i]``.

The prompt allocates a 1-row cache of 64 tokens named ``CacheKey(PROMPT_CLUSTER_ID,
req_id=7)`` and fills it; the decoder, whose blocks hold 16 tokens, pulls

1. the whole row, every layer, by ``CacheKey`` into blocks [6, 1, 3, 4];
2. the first 32 tokens of layer 1, by ``CacheKeyByIdAndIndex(prompt, cache_id, 0)``, into
   blocks [0, 2] of layer 1.

The decoder checks every byte of its cache: chunk i of the row is in the block it named,
every other block is still zero.  Exits 0 when all bytes match.
"""
from __future__ import annotations

import sys

import torch

from _launch import (BLOCK_TOKENS, DECODER_CLUSTER_ID, KV_SHAPE, NUM_TENSORS, PROMPT_CLUSTER_ID, Peer, blocks_cache,
                     contiguous_cache, engine, expect_tensors, linked, listening, run_sample, source_tensors)
from datadist import CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMRole, Placement

ROW_DESC = CacheDesc(NUM_TENSORS, [1, 4 * BLOCK_TOKENS, *KV_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
BLOCKS_DESC = CacheDesc(NUM_TENSORS, [8, BLOCK_TOKENS, *KV_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
PROMPT_CACHE_KEY = CacheKey(prompt_cluster_id=PROMPT_CLUSTER_ID, req_id=7)
SEED = 5


def run_prompt_sample(peer: Peer, transport: str) -> None:
    with engine(LLMRole.PROMPT, PROMPT_CLUSTER_ID, transport, listen=True) as datadist:
        with contiguous_cache(datadist.cache_manager, ROW_DESC, [PROMPT_CACHE_KEY], seed=SEED) as (cache, _):
            listening(peer, datadist, cache.cache_id)
            peer.barrier("pulled")  # the decoder has checked its data and unlinked


def run_decoder_sample(peer: Peer, transport: str) -> None:
    with engine(LLMRole.DECODER, DECODER_CLUSTER_ID, transport) as datadist:
        cache_manager = datadist.cache_manager
        with blocks_cache(cache_manager, BLOCKS_DESC) as (cache, tensors), \
                linked(peer, datadist, {PROMPT_CLUSTER_ID: "prompt"}, done="pulled") as told:
            prompt_cache_id = told["prompt"]
            cache_manager.pull_blocks(PROMPT_CACHE_KEY, cache, src_blocks=(), dst_blocks=[6, 1, 3, 4])
            cache_manager.pull_blocks(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, prompt_cache_id, 0), cache,
                                      src_blocks=(), dst_blocks=[0, 2], src_layer_range=range(1, 2),
                                      dst_layer_range=range(1, 2), tensor_num_per_layer=2)

            rows = source_tensors(NUM_TENSORS, ROW_DESC.shape, torch.float16, SEED)
            expected = [torch.zeros_like(t) for t in tensors]
            for index, (want, row) in enumerate(zip(expected, rows)):
                chunks = row[0].view(-1, BLOCK_TOKENS, *KV_SHAPE)
                want[[6, 1, 3, 4]] = chunks
                if index in (2, 3):  # layer 1: K1, V1
                    want[[0, 2]] = chunks[:2]
            expect_tensors(tensors, expected)


if __name__ == "__main__":
    sys.exit(run_sample("pull_from_cache_to_blocks", __doc__,
                        {"prompt": run_prompt_sample, "decoder": run_decoder_sample}))
