"""push_by_layer: the prompt engine sends each layer's KV while it computes the next one.

Two engine processes on this host.  The prompt engine runs a stack of layers with real
torch compute (a residual MLP over the hidden states; that layer's K and V, written into
its blocks of the paged cache, are cheap functions of the result).  ``transfer_cache_async``
pushes the cache into the decoder's blocks cache layer by layer: its ``LayerSynchronizer``
is fed by the compute loop, so layer i travels while layer i+1 is computed.

After an untimed warm-up, the prompt times rounds of three runs: the compute alone, the
transfer alone (every layer already computed), and both overlapped; it reports the medians.
Before each overlapped run its cache is zeroed, and before the last one the decoder's too,
so a layer sent before it was computed would arrive as zeros.  The decoder then compares
every block with the prompt's (SHA-256 per tensor, through the block mapping).  Prints the
timings and "push_by_layer: bytes match", exits 0; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Sequence, Tuple

import torch

from _by_layer import cache_desc, digests, dst_blocks, expect_digests, main, medians, pool_bytes, src_blocks, timed
from _launch import ComputedLayers, Peer, blocks_cache, engine, finish_task, linked, listening
from datadist import BlocksCacheKey, CacheTask, LLMRole, TransferWithCacheKeyConfig

PROMPT_CLUSTER_ID = 1
DECODER_CLUSTER_ID = 2


class Prefill:
    """Layers of real compute whose K and V land in the paged cache, block b holding
    tokens ``[b * block_tokens, (b + 1) * block_tokens)``.  A layer is a residual MLP of
    width ``--hidden`` over the hidden states, which sets its cost; K and V are cheap
    functions of the result."""

    def __init__(self, args: argparse.Namespace) -> None:
        gen = torch.Generator().manual_seed(args.seed)
        tokens, width = args.blocks * args.block_tokens, args.kv_heads * args.head_dim
        self.shape = (args.blocks, args.block_tokens, args.kv_heads, args.head_dim)
        self.x = torch.randn(tokens, width, generator=gen)
        self.layers = [(torch.randn(width, args.hidden, generator=gen) * width ** -0.5,
                        torch.randn(args.hidden, width, generator=gen) * args.hidden ** -0.5)
                       for _ in range(args.layers)]

    def run(self, kv: Sequence[torch.Tensor], computed: Callable[[int], None] = lambda layer: None) -> None:
        """Compute every layer into ``kv`` (K0, V0, K1, V1, ...), calling ``computed(i)``
        as soon as layer i's K and V are written."""
        h = self.x
        for i, (w_up, w_down) in enumerate(self.layers):
            h = h + torch.tanh(h @ w_up) @ w_down
            kv[2 * i].copy_(h.view(self.shape))
            kv[2 * i + 1].copy_(torch.tanh(h).view(self.shape))
            computed(i)


def prompt_process(peer: Peer, args: argparse.Namespace) -> Tuple[float, float, float]:
    """Returns the seconds of the compute alone, the transfer alone and both overlapped
    (medians of ``--rounds`` rounds)."""
    torch.set_num_threads(args.threads)
    with engine(LLMRole.PROMPT, PROMPT_CLUSTER_ID, args.transport, listen=True,
                pool_bytes=pool_bytes(args)) as datadist:
        cache_manager = datadist.cache_manager
        with blocks_cache(cache_manager, cache_desc(args)) as (cache, kv):
            model = Prefill(args)
            every_layer = range(0, args.layers)
            configs = [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_CLUSTER_ID, 0), every_layer, every_layer)]
            listening(peer, datadist)
            peer.barrier("linked")

            def push(synchronizer: ComputedLayers) -> CacheTask:
                return cache_manager.transfer_cache_async(cache, synchronizer, configs, src_blocks(args),
                                                          dst_blocks(args))

            def compute_alone() -> None:
                model.run(kv)

            def transfer_alone() -> None:
                finish_task(push(ComputedLayers(args.layers, all_computed=True)), args.timeout * 1000)

            def overlapped() -> None:
                synchronizer = ComputedLayers(args.layers)
                task = push(synchronizer)
                model.run(kv, synchronizer.computed)
                finish_task(task, args.timeout * 1000)

            compute_alone()  # an untimed round first: torch's kernels and the link's lookup are set up once
            transfer_alone()
            rounds: List[Tuple[float, float, float]] = []
            for r in range(args.rounds):
                compute_s, transfer_s = timed(compute_alone), timed(transfer_alone)
                for tensor in kv:
                    tensor.zero_()  # a layer sent before it was computed would arrive as zeros
                if r == args.rounds - 1:
                    peer.barrier("zeroed")  # the decoder zeroed its copy: the last run is the one checked
                rounds.append((compute_s, transfer_s, timed(overlapped)))
            peer.barrier("pushed", digests(kv, src_blocks(args)))
            peer.barrier("checked")  # the decoder has unlinked
            return medians(rounds)


def decoder_process(peer: Peer, args: argparse.Namespace) -> None:
    with engine(LLMRole.DECODER, DECODER_CLUSTER_ID, args.transport, pool_bytes=pool_bytes(args)) as datadist:
        cache_manager = datadist.cache_manager
        with blocks_cache(cache_manager, cache_desc(args), BlocksCacheKey(DECODER_CLUSTER_ID, 0)) as (_, kv), \
                linked(peer, datadist, {PROMPT_CLUSTER_ID: "prompt"}, done="checked"):
            peer.barrier("linked")
            for tensor in kv:
                tensor.zero_()  # earlier rounds pushed here: only the last, checked round's data may remain
            peer.barrier("zeroed")
            expect_digests(peer.barrier("pushed")["prompt"], kv, args)


if __name__ == "__main__":
    sys.exit(main("push_by_layer", __doc__, 64, prompt_process, decoder_process, timed_by="prompt"))
