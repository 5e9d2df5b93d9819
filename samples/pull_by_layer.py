"""pull_by_layer: the decoder pulls layer i's KV while it computes on layer i-1.

Two engine processes on this host.  The prompt engine holds a prefilled paged KV cache
(seeded data) under ``BlocksCacheKey(PROMPT_CLUSTER_ID, 0)``.  The decoder runs a stack of
layers with real torch compute: each layer attends over that layer's K and V in the
decoder's own blocks cache, then applies a residual MLP of width ``--hidden``.  It fetches
the cache one layer at a time (``pull_blocks`` with a one-layer ``src_layer_range`` and
``dst_layer_range``) on a helper thread, so the pull of layer i runs while layer i-1 is
computed.

After an untimed warm-up, the decoder times rounds of three runs: the pulls alone, the
compute alone (on the pulled cache), and the pipeline; it reports the medians.  Its cache
is zeroed before each pipelined run, so a layer computed before its pull finished would
use zeros.  The decoder then checks every block against the prompt's (SHA-256 per tensor,
through the block mapping) and that the pipeline computed exactly what the compute alone
did.  Prints the timings and "pull_by_layer: bytes match", exits 0; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Tuple

import torch

from _by_layer import cache_desc, digests, dst_blocks, expect_digests, main, medians, pool_bytes, src_blocks, timed
from _launch import Peer, blocks_cache, engine, linked, listening
from datadist import BlocksCacheKey, LLMRole

PROMPT_CLUSTER_ID = 1
DECODER_CLUSTER_ID = 2
#: Query tokens the decoder computes per layer.
QUERY_TOKENS = 16


class Decode:
    """Layers of real compute over a paged KV cache: attention of ``QUERY_TOKENS`` queries
    over every cached token of the layer, then a residual MLP."""

    def __init__(self, args: argparse.Namespace) -> None:
        gen = torch.Generator().manual_seed(args.seed + 1)
        width = args.kv_heads * args.head_dim
        self.heads, self.head_dim = args.kv_heads, args.head_dim
        self.x = torch.randn(QUERY_TOKENS, width, generator=gen)
        self.layers = [(torch.randn(width, width, generator=gen) * width ** -0.5,
                        torch.randn(width, args.hidden, generator=gen) * width ** -0.5,
                        torch.randn(args.hidden, width, generator=gen) * args.hidden ** -0.5)
                       for _ in range(args.layers)]
        self.h = self.x

    def start(self) -> None:
        self.h = self.x

    def layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i over its cache tensors ``k``, ``v`` (``[blocks, block_tokens, heads, head_dim]``)."""
        w_q, w_up, w_down = self.layers[i]
        q = (self.h @ w_q).view(QUERY_TOKENS, self.heads, self.head_dim).transpose(0, 1)
        keys = k.float().reshape(-1, self.heads, self.head_dim).transpose(0, 1)
        values = v.float().reshape(-1, self.heads, self.head_dim).transpose(0, 1)
        attn = torch.softmax(q @ keys.transpose(1, 2) * self.head_dim ** -0.5, dim=-1) @ values
        self.h = self.h + attn.transpose(0, 1).reshape(QUERY_TOKENS, -1)
        self.h = self.h + torch.tanh(self.h @ w_up) @ w_down


def prompt_process(peer: Peer, args: argparse.Namespace) -> None:
    with engine(LLMRole.PROMPT, PROMPT_CLUSTER_ID, args.transport, listen=True,
                pool_bytes=pool_bytes(args)) as datadist:
        with blocks_cache(datadist.cache_manager, cache_desc(args), BlocksCacheKey(PROMPT_CLUSTER_ID, 0),
                          seed=args.seed) as (_, kv):
            listening(peer, datadist, digests(kv, src_blocks(args)))
            peer.barrier("done")  # the decoder has checked and unlinked


def decoder_process(peer: Peer, args: argparse.Namespace) -> Tuple[float, float, float]:
    """Returns the seconds of the pulls alone, the compute alone and the pipeline (medians
    of ``--rounds`` rounds)."""
    torch.set_num_threads(args.threads)
    with engine(LLMRole.DECODER, DECODER_CLUSTER_ID, args.transport, pool_bytes=pool_bytes(args)) as datadist:
        cache_manager = datadist.cache_manager
        with blocks_cache(cache_manager, cache_desc(args)) as (cache, kv), \
                linked(peer, datadist, {PROMPT_CLUSTER_ID: "prompt"}, done="done") as told:
            sent = told["prompt"]
            model = Decode(args)
            key = BlocksCacheKey(PROMPT_CLUSTER_ID, 0)

            def pull(layer: int) -> None:
                layers = range(layer, layer + 1)
                cache_manager.pull_blocks(key, cache, src_blocks(args), dst_blocks(args), src_layer_range=layers,
                                          dst_layer_range=layers)

            def pulls_alone() -> None:
                for layer in range(args.layers):
                    pull(layer)

            def compute_alone() -> None:
                model.start()
                for layer in range(args.layers):
                    model.layer(layer, kv[2 * layer], kv[2 * layer + 1])

            def pipelined(pulling: ThreadPoolExecutor) -> None:
                model.start()
                arriving: Future = pulling.submit(pull, 0)
                for layer in range(args.layers):
                    arriving.result(args.timeout)
                    if layer + 1 < args.layers:
                        arriving = pulling.submit(pull, layer + 1)
                    model.layer(layer, kv[2 * layer], kv[2 * layer + 1])

            pulls_alone()  # an untimed round first: torch's kernels and the link's lookup are set up once
            compute_alone()
            rounds: List[Tuple[float, float, float]] = []
            with ThreadPoolExecutor(1, thread_name_prefix="pull") as pulling:
                for _ in range(args.rounds):
                    transfer_s, compute_s = timed(pulls_alone), timed(compute_alone)
                    expected = model.h
                    for tensor in kv:
                        tensor.zero_()  # a layer computed before its pull finished would see zeros
                    rounds.append((compute_s, transfer_s, timed(lambda: pipelined(pulling))))
                    if not torch.equal(model.h, expected):
                        raise AssertionError("the pipeline computed something else than the compute alone")
            expect_digests(sent, kv, args)
            return medians(rounds)


if __name__ == "__main__":
    sys.exit(main("pull_by_layer", __doc__, 1024, prompt_process, decoder_process, timed_by="decoder"))
