"""pull_cache: the decoder engine reads rows of the prompt's contiguous KV cache.

The prompt allocates a 2-row cache whose rows are named ``CacheKey(PROMPT_CLUSTER_ID,
req_id=1)`` and ``req_id=2``, fills it and tells its cache id.  The decoder pulls

1. the row of request 2, every layer, into its row 0 by ``CacheKey``; a pull through a
   ``CacheKey`` consumes it: the prompt forgets the key, so pulling it again raises
   ``LLM_KV_CACHE_NOT_EXIST``, which the decoder checks;
2. prompt row 0, layers 0 and 1, into layers 2 and 3 of its row 1, by
   ``CacheKeyByIdAndIndex(prompt, cache_id, 0)`` (a pull may move layers).

The decoder checks every byte of its cache: the pulled rows and layers hold the prompt's
data, everything else is still zero.  Exits 0 when all bytes match.
"""
from __future__ import annotations

import sys

import torch

from _launch import (DECODER_CLUSTER_ID, KV_SHAPE, NUM_TENSORS, PROMPT_CLUSTER_ID, Peer, contiguous_cache, engine,
                     expect_tensors, linked, listening, run_sample, source_tensors)
from datadist import (CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMException, LLMRole, LLMStatusCode,
                      Placement)

CACHE_DESC = CacheDesc(NUM_TENSORS, [2, 64, *KV_SHAPE], DataType.DT_FLOAT16, Placement.DEVICE)  # 2 rows of 64 tokens
PROMPT_CACHE_KEYS = [CacheKey(prompt_cluster_id=PROMPT_CLUSTER_ID, req_id=1),
                     CacheKey(prompt_cluster_id=PROMPT_CLUSTER_ID, req_id=2)]
SEED = 4


def run_prompt_sample(peer: Peer, transport: str) -> None:
    with engine(LLMRole.PROMPT, PROMPT_CLUSTER_ID, transport, listen=True) as datadist:
        with contiguous_cache(datadist.cache_manager, CACHE_DESC, PROMPT_CACHE_KEYS, seed=SEED) as (cache, _):
            listening(peer, datadist, cache.cache_id)
            peer.barrier("pulled")  # the decoder has checked its data and unlinked


def run_decoder_sample(peer: Peer, transport: str) -> None:
    with engine(LLMRole.DECODER, DECODER_CLUSTER_ID, transport) as datadist:
        cache_manager = datadist.cache_manager
        with contiguous_cache(cache_manager, CACHE_DESC) as (cache, tensors), \
                linked(peer, datadist, {PROMPT_CLUSTER_ID: "prompt"}, done="pulled") as told:
            prompt_cache_id = told["prompt"]
            cache_manager.pull_cache(PROMPT_CACHE_KEYS[1], cache, batch_index=0)
            try:
                cache_manager.pull_cache(PROMPT_CACHE_KEYS[1], cache, batch_index=1)
            except LLMException as exc:
                if exc.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                    raise
            else:
                raise AssertionError(f"{PROMPT_CACHE_KEYS[1]} was pulled twice; a pull by CacheKey must consume it")
            cache_manager.pull_cache(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, prompt_cache_id, 0), cache,
                                     batch_index=1, src_layer_range=range(0, 2), dst_layer_range=range(2, 4),
                                     tensor_num_per_layer=2)

            source = source_tensors(NUM_TENSORS, CACHE_DESC.shape, torch.float16, SEED)
            expected = [torch.zeros_like(t) for t in tensors]
            for want, src in zip(expected, source):
                want[0] = src[1]
            for dst, src in zip(range(4, 8), range(0, 4)):  # K0, V0, K1, V1 -> K2, V2, K3, V3
                expected[dst][1] = source[src][0]
            expect_tensors(tensors, expected)


if __name__ == "__main__":
    sys.exit(run_sample("pull_cache", __doc__, {"prompt": run_prompt_sample, "decoder": run_decoder_sample}))
