"""xPyD: two prompt engines and two decoder engines, every decoder linked to every prompt.

Each prompt engine allocates a blocks cache named ``BlocksCacheKey(<its cluster id>, 0)``
and fills it with its own data.  Each decoder links to both prompts with one
``link_clusters`` call and pulls from each: decoder d takes blocks [2d, 2d + 1] of prompt
p into its blocks [2p, 2p + 1], so both decoders read both prompts at the same time.

Every decoder checks every byte of its cache: blocks 0-1 hold prompt 0's data, blocks 2-3
prompt 1's, the rest is still zero.  Exits 0 when all bytes match.
"""
from __future__ import annotations

import functools
import sys

import torch

from _launch import (Peer, expect_bytes, fill, init_llm_datadist, link_clusters, run_sample, source_tensors,
                     unlink_clusters)
from datadist import BlocksCacheKey, CacheDesc, DataType, LLMRole, Placement

PROMPT_CLUSTER_IDS = [1, 2]
DECODER_CLUSTER_IDS = [11, 12]
NUM_LAYERS = 4
NUM_TENSORS = 2 * NUM_LAYERS  # K and V of each layer: K0, V0, K1, V1, ...
BLOCKS_NUM = 8
BLOCK_SHAPE = [16, 2, 32]  # tokens per block, KV heads, head dim
CACHE_DESC = CacheDesc(NUM_TENSORS, [BLOCKS_NUM, *BLOCK_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
SEED = 6


def run_prompt_sample(index: int, peer: Peer, transport: str) -> None:
    cluster_id = PROMPT_CLUSTER_IDS[index]
    datadist = init_llm_datadist(LLMRole.PROMPT, cluster_id, transport, listen=True)
    try:
        cache_manager = datadist.cache_manager
        cache = cache_manager.allocate_blocks_cache(CACHE_DESC, BlocksCacheKey(cluster_id, 0))
        fill(cache_manager.get_cache_tensors(cache), SEED + cluster_id)
        peer.barrier("listening", datadist.listen_port)
        peer.barrier("pulled")  # both decoders have checked their data and unlinked
        cache_manager.deallocate_blocks_cache(cache)
    finally:
        datadist.finalize()


def run_decoder_sample(index: int, peer: Peer, transport: str) -> None:
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_IDS[index], transport)
    try:
        cache_manager = datadist.cache_manager
        cache = cache_manager.allocate_blocks_cache(CACHE_DESC)
        tensors = cache_manager.get_cache_tensors(cache)
        for tensor in tensors:
            tensor.zero_()  # pool memory is not cleared when it is reused
        ports = peer.barrier("listening")
        link_clusters(datadist, {cid: ports[f"prompt{p}"] for p, cid in enumerate(PROMPT_CLUSTER_IDS)})

        src_blocks = [2 * index, 2 * index + 1]
        for p, cid in enumerate(PROMPT_CLUSTER_IDS):
            cache_manager.pull_blocks(BlocksCacheKey(cid, 0), cache, src_blocks=src_blocks,
                                      dst_blocks=[2 * p, 2 * p + 1])

        expected = [torch.zeros_like(t) for t in tensors]
        for p, cid in enumerate(PROMPT_CLUSTER_IDS):
            for want, src in zip(expected, source_tensors(NUM_TENSORS, CACHE_DESC.shape, torch.float16, SEED + cid)):
                want[[2 * p, 2 * p + 1]] = src[src_blocks]
        for t, (got, want) in enumerate(zip(tensors, expected)):
            expect_bytes(got, want, f"decoder{index} tensor {t}")

        unlink_clusters(datadist, PROMPT_CLUSTER_IDS)
        peer.barrier("pulled")
        cache_manager.deallocate_blocks_cache(cache)
    finally:
        datadist.finalize()


if __name__ == "__main__":
    processes = {f"prompt{i}": functools.partial(run_prompt_sample, i) for i in range(len(PROMPT_CLUSTER_IDS))}
    processes.update({f"decoder{i}": functools.partial(run_decoder_sample, i) for i in range(len(DECODER_CLUSTER_IDS))})
    sys.exit(run_sample("xpyd", __doc__, processes))
