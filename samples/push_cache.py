"""push_cache: the prompt engine writes rows of a contiguous KV cache into the decoder's.

A contiguous cache holds one row per request (``[batch, seq_len, kv_heads, head_dim]`` per
tensor).  The decoder allocates a 3-row cache and tells the prompt its cache id; the
prompt, which holds a 2-row cache, pushes

1. its row 1, every layer, into decoder row 2 (``CacheKeyByIdAndIndex(decoder, cache_id, 2)``);
2. its row 0, layers 1 and 2 only, into decoder row 0 (a push uses the same layer range on
   both sides).

The decoder checks every byte of its cache: the pushed rows and layers hold the prompt's
data, everything else is still zero.  Exits 0 when all bytes match.
"""
from __future__ import annotations

import sys

import torch

from _launch import (DECODER_CLUSTER_ID, KV_SHAPE, NUM_TENSORS, PROMPT_CLUSTER_ID, Peer, contiguous_cache, engine,
                     expect_tensors, linked, listening, run_sample, source_tensors)
from datadist import CacheDesc, CacheKeyByIdAndIndex, DataType, LLMRole, Placement

ROW_SHAPE = [64, *KV_SHAPE]  # tokens, KV heads, head dim
PROMPT_DESC = CacheDesc(NUM_TENSORS, [2, *ROW_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
DECODER_DESC = CacheDesc(NUM_TENSORS, [3, *ROW_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)
SEED = 3


def run_prompt_sample(peer: Peer, transport: str) -> None:
    with engine(LLMRole.PROMPT, PROMPT_CLUSTER_ID, transport, listen=True) as datadist:
        cache_manager = datadist.cache_manager
        with contiguous_cache(cache_manager, PROMPT_DESC, seed=SEED) as (cache, _):
            listening(peer, datadist)
            decoder_cache_id = peer.barrier("decoder ready")["decoder"]  # linked, destination cache allocated

            cache_manager.push_cache(CacheKeyByIdAndIndex(DECODER_CLUSTER_ID, decoder_cache_id, 2), cache,
                                     src_batch_index=1)
            cache_manager.push_cache(CacheKeyByIdAndIndex(DECODER_CLUSTER_ID, decoder_cache_id, 0), cache,
                                     src_batch_index=0, src_layer_range=range(1, 3), dst_layer_range=range(1, 3),
                                     tensor_num_per_layer=2)
            peer.barrier("pushed")
            peer.barrier("checked")  # the decoder has unlinked


def run_decoder_sample(peer: Peer, transport: str) -> None:
    with engine(LLMRole.DECODER, DECODER_CLUSTER_ID, transport) as datadist:
        with contiguous_cache(datadist.cache_manager, DECODER_DESC) as (cache, tensors), \
                linked(peer, datadist, {PROMPT_CLUSTER_ID: "prompt"}, done="checked"):
            peer.barrier("decoder ready", cache.cache_id)
            peer.barrier("pushed")

            source = source_tensors(NUM_TENSORS, PROMPT_DESC.shape, torch.float16, SEED)
            expected = [torch.zeros_like(t) for t in tensors]
            for want, src in zip(expected, source):
                want[2] = src[1]
            for index in range(2, 6):  # layers 1 and 2: K1, V1, K2, V2
                expected[index][0] = source[index][0]
            expect_tensors(tensors, expected)


if __name__ == "__main__":
    sys.exit(run_sample("push_cache", __doc__, {"prompt": run_prompt_sample, "decoder": run_decoder_sample}))
