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

from _launch import (BLOCK_TOKENS, KV_SHAPE, NUM_TENSORS, Peer, blocks_cache, engine, expect_tensors, linked, listening,
                     run_sample, source_tensors)
from datadist import BlocksCacheKey, CacheDesc, DataType, LLMRole, Placement

PROMPT_CLUSTER_IDS = [1, 2]
DECODER_CLUSTER_IDS = [11, 12]
CACHE_DESC = CacheDesc(NUM_TENSORS, [8, BLOCK_TOKENS, *KV_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
SEED = 6


def run_prompt_sample(index: int, peer: Peer, transport: str) -> None:
    cluster_id = PROMPT_CLUSTER_IDS[index]
    with engine(LLMRole.PROMPT, cluster_id, transport, listen=True) as datadist:
        with blocks_cache(datadist.cache_manager, CACHE_DESC, BlocksCacheKey(cluster_id, 0), seed=SEED + cluster_id):
            listening(peer, datadist)
            peer.barrier("pulled")  # both decoders have checked their data and unlinked


def run_decoder_sample(index: int, peer: Peer, transport: str) -> None:
    prompts = {cid: f"prompt{p}" for p, cid in enumerate(PROMPT_CLUSTER_IDS)}
    with engine(LLMRole.DECODER, DECODER_CLUSTER_IDS[index], transport) as datadist:
        cache_manager = datadist.cache_manager
        with blocks_cache(cache_manager, CACHE_DESC) as (cache, tensors), \
                linked(peer, datadist, prompts, done="pulled"):  # one link_clusters call for both prompts
            src_blocks = [2 * index, 2 * index + 1]
            for p, cid in enumerate(PROMPT_CLUSTER_IDS):
                cache_manager.pull_blocks(BlocksCacheKey(cid, 0), cache, src_blocks=src_blocks,
                                          dst_blocks=[2 * p, 2 * p + 1])

            expected = [torch.zeros_like(t) for t in tensors]
            for p, cid in enumerate(PROMPT_CLUSTER_IDS):
                source = source_tensors(NUM_TENSORS, CACHE_DESC.shape, torch.float16, SEED + cid)
                for want, src in zip(expected, source):
                    want[[2 * p, 2 * p + 1]] = src[src_blocks]
            expect_tensors(tensors, expected, f"decoder{index}")


if __name__ == "__main__":
    processes = {f"prompt{i}": functools.partial(run_prompt_sample, i) for i in range(len(PROMPT_CLUSTER_IDS))}
    processes.update({f"decoder{i}": functools.partial(run_decoder_sample, i) for i in range(len(DECODER_CLUSTER_IDS))})
    sys.exit(run_sample("xpyd", __doc__, processes))
