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

from _launch import (Peer, expect_bytes, fill, init_llm_datadist, link_clusters, run_sample, source_tensors,
                     unlink_clusters)
from datadist import BlocksCacheKey, CacheDesc, DataType, LLMRole, Placement

PROMPT_CLUSTER_ID = 1
DECODER_CLUSTER_ID = 2
NUM_LAYERS = 4
NUM_TENSORS = 2 * NUM_LAYERS  # K and V of each layer: K0, V0, K1, V1, ...
BLOCKS_NUM = 8
BLOCK_SHAPE = [16, 2, 32]  # tokens per block, KV heads, head dim
CACHE_DESC = CacheDesc(NUM_TENSORS, [BLOCKS_NUM, *BLOCK_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
SEED = 1


def run_prompt_sample(peer: Peer, transport: str) -> None:
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, transport, listen=True)
    try:
        cache_manager = datadist.cache_manager
        cache = cache_manager.allocate_blocks_cache(CACHE_DESC)
        fill(cache_manager.get_cache_tensors(cache), SEED)
        peer.barrier("listening", datadist.listen_port)
        peer.barrier("decoder ready")  # linked, destination cache allocated

        dst_key = BlocksCacheKey(DECODER_CLUSTER_ID, 0)
        cache_manager.push_blocks(dst_key, cache, src_blocks=[0, 1, 2, 3], dst_blocks=[4, 5, 6, 7])
        cache_manager.push_blocks(dst_key, cache, src_blocks=[6], dst_blocks=[1], src_layer_range=range(2, 3),
                                  dst_layer_range=range(2, 3), tensor_num_per_layer=2)
        peer.barrier("pushed")
        peer.barrier("checked")  # the decoder has unlinked
        cache_manager.deallocate_blocks_cache(cache)
    finally:
        datadist.finalize()


def run_decoder_sample(peer: Peer, transport: str) -> None:
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, transport)
    try:
        cache_manager = datadist.cache_manager
        cache = cache_manager.allocate_blocks_cache(CACHE_DESC, BlocksCacheKey(DECODER_CLUSTER_ID, 0))
        tensors = cache_manager.get_cache_tensors(cache)
        for tensor in tensors:
            tensor.zero_()  # pool memory is not cleared when it is reused
        ports = peer.barrier("listening")
        link_clusters(datadist, {PROMPT_CLUSTER_ID: ports["prompt"]})
        peer.barrier("decoder ready")
        peer.barrier("pushed")

        source = source_tensors(NUM_TENSORS, CACHE_DESC.shape, torch.float16, SEED)
        expected = [torch.zeros_like(t) for t in tensors]
        for want, src in zip(expected, source):
            want[4:8] = src[0:4]
        for index in (4, 5):  # layer 2: K2, V2
            expected[index][1] = source[index][6]
        for index, (got, want) in enumerate(zip(tensors, expected)):
            expect_bytes(got, want, f"decoder tensor {index}")

        unlink_clusters(datadist, [PROMPT_CLUSTER_ID])
        peer.barrier("checked")
        cache_manager.deallocate_blocks_cache(cache)
    finally:
        datadist.finalize()


if __name__ == "__main__":
    sys.exit(run_sample("push_blocks", __doc__, {"prompt": run_prompt_sample, "decoder": run_decoder_sample}))
