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

from _launch import (Peer, expect_bytes, fill, init_llm_datadist, link_clusters, run_sample, source_tensors,
                     unlink_clusters)
from datadist import CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMRole, Placement

PROMPT_CLUSTER_ID = 1
DECODER_CLUSTER_ID = 2
NUM_LAYERS = 4
NUM_TENSORS = 2 * NUM_LAYERS  # K and V of each layer: K0, V0, K1, V1, ...
BLOCK_SIZE = 16
KV_SHAPE = [2, 32]  # KV heads, head dim
ROW_DESC = CacheDesc(NUM_TENSORS, [1, 4 * BLOCK_SIZE, *KV_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
BLOCKS_DESC = CacheDesc(NUM_TENSORS, [8, BLOCK_SIZE, *KV_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
PROMPT_CACHE_KEY = CacheKey(prompt_cluster_id=PROMPT_CLUSTER_ID, req_id=7)
SEED = 5


def run_prompt_sample(peer: Peer, transport: str) -> None:
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, transport, listen=True)
    try:
        cache_manager = datadist.cache_manager
        cache = cache_manager.allocate_cache(ROW_DESC, [PROMPT_CACHE_KEY])
        fill(cache_manager.get_cache_tensors(cache), SEED)
        peer.barrier("listening", (datadist.listen_port, cache.cache_id))
        peer.barrier("pulled")  # the decoder has checked its data and unlinked
        cache_manager.deallocate_cache(cache)
    finally:
        datadist.finalize()


def run_decoder_sample(peer: Peer, transport: str) -> None:
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, transport)
    try:
        cache_manager = datadist.cache_manager
        cache = cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        tensors = cache_manager.get_cache_tensors(cache)
        for tensor in tensors:
            tensor.zero_()  # pool memory is not cleared when it is reused
        port, prompt_cache_id = peer.barrier("listening")["prompt"]
        link_clusters(datadist, {PROMPT_CLUSTER_ID: port})

        cache_manager.pull_blocks(PROMPT_CACHE_KEY, cache, src_blocks=(), dst_blocks=[6, 1, 3, 4])
        cache_manager.pull_blocks(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, prompt_cache_id, 0), cache, src_blocks=(),
                                  dst_blocks=[0, 2], src_layer_range=range(1, 2), dst_layer_range=range(1, 2),
                                  tensor_num_per_layer=2)

        rows = source_tensors(NUM_TENSORS, ROW_DESC.shape, torch.float16, SEED)
        expected = [torch.zeros_like(t) for t in tensors]
        for index, (want, row) in enumerate(zip(expected, rows)):
            chunks = row[0].view(-1, BLOCK_SIZE, *KV_SHAPE)
            want[[6, 1, 3, 4]] = chunks
            if index in (2, 3):  # layer 1: K1, V1
                want[[0, 2]] = chunks[:2]
        for index, (got, want) in enumerate(zip(tensors, expected)):
            expect_bytes(got, want, f"decoder tensor {index}")

        unlink_clusters(datadist, [PROMPT_CLUSTER_ID])
        peer.barrier("pulled")
        cache_manager.deallocate_blocks_cache(cache)
    finally:
        datadist.finalize()


if __name__ == "__main__":
    sys.exit(run_sample("pull_from_cache_to_blocks", __doc__,
                        {"prompt": run_prompt_sample, "decoder": run_decoder_sample}))
