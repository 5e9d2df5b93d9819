"""What push_by_layer.py and pull_by_layer.py share: their size flags, the paged KV cache
both engines allocate, the block mapping, digests to compare caches across processes, the
timing report and the command line that runs both processes.

The cache is a blocks cache of ``2 * layers`` tensors (K0, V0, K1, V1, ...), each
``[blocks, block_tokens, kv_heads, head_dim]`` in float16.  Source block ``b`` goes to
destination block ``blocks - 1 - b``, so the mapping is visible in the data.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from _launch import ChildFailed, Launcher, positive_int as positive
from datadist import CacheDesc, DataType, Placement

__all__ = ["add_size_args", "cache_desc", "kv_bytes", "pool_bytes", "src_blocks", "dst_blocks", "digests",
           "expect_digests", "timed", "medians", "report", "main"]


def add_size_args(parser: argparse.ArgumentParser, hidden: int) -> None:
    """The flags both samples take (sizes default small: a run takes a few seconds);
    ``hidden`` is the sample's default MLP width."""
    parser.add_argument("--layers", type=positive, default=8, help="layers (default 8)")
    parser.add_argument("--blocks", type=positive, default=128, help="KV blocks per tensor (default 128)")
    parser.add_argument("--block-tokens", type=positive, default=16, help="tokens per block (default 16)")
    parser.add_argument("--kv-heads", type=positive, default=4, help="KV heads (default 4)")
    parser.add_argument("--head-dim", type=positive, default=64, help="head dimension (default 64)")
    parser.add_argument("--hidden", type=positive, default=hidden,
                        help=f"width of each layer's MLP: sets the compute per layer (default {hidden})")
    parser.add_argument("--rounds", type=positive, default=5,
                        help="timed rounds; the medians are reported (default 5)")
    parser.add_argument("--threads", type=positive, default=1,
                        help="torch compute threads (default 1: the transfer needs a core of its own)")
    parser.add_argument("--transport", choices=("auto", "shm", "tcp"), default="auto",
                        help="transfer_backend of both engines (default auto: shm on one host)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    parser.add_argument("--timeout", type=positive, default=120,
                        help="deadline in seconds of every wait on a process (default 120)")


def cache_desc(args: argparse.Namespace) -> CacheDesc:
    """The KV cache of both engines."""
    return CacheDesc(2 * args.layers, [args.blocks, args.block_tokens, args.kv_heads, args.head_dim],
                     DataType.DT_FLOAT16, Placement.DEVICE)


def kv_bytes(args: argparse.Namespace) -> int:
    """Bytes of the whole cache (all layers)."""
    return 2 * args.layers * args.blocks * args.block_tokens * args.kv_heads * args.head_dim * 2


def pool_bytes(args: argparse.Namespace) -> int:
    """A device pool that holds the cache, whatever the flags."""
    return max(64 << 20, 2 * kv_bytes(args))


def src_blocks(args: argparse.Namespace) -> List[int]:
    return list(range(args.blocks))


def dst_blocks(args: argparse.Namespace) -> List[int]:
    return [args.blocks - 1 - b for b in range(args.blocks)]


def digests(tensors: Sequence[torch.Tensor], blocks: Sequence[int]) -> List[str]:
    """SHA-256 of each tensor's ``blocks``, in that order: equal digests on both sides mean
    every block arrived where the mapping says, byte for byte."""
    index = torch.tensor(list(blocks))
    return [hashlib.sha256(t.index_select(0, index).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for t in tensors]


def expect_digests(sent: Sequence[str], kv: Sequence[torch.Tensor], args: argparse.Namespace) -> None:
    """Raise ``AssertionError`` unless the decoder's ``kv`` holds, through the block mapping,
    what the prompt's :func:`digests` (``sent``) say."""
    got = digests(kv, dst_blocks(args))
    wrong = [i for i, (a, b) in enumerate(zip(sent, got)) if a != b]
    if wrong:
        raise AssertionError(f"decoder tensors {wrong} differ from the prompt's")


def timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def medians(rounds: Sequence[Tuple[float, ...]]) -> Tuple[float, ...]:
    """The median of each column of ``rounds``."""
    return tuple(statistics.median(column) for column in zip(*rounds))


def report(title: str, compute_s: float, transfer_s: float, overlapped_s: float) -> None:
    """Print the four timings and what overlapping saved."""
    serial = compute_s + transfer_s
    print(f"{title}:")
    print(f"  compute alone      {compute_s * 1000:9.1f} ms")
    print(f"  transfer alone     {transfer_s * 1000:9.1f} ms")
    print(f"  serial sum         {serial * 1000:9.1f} ms")
    print(f"  overlapped (wall)  {overlapped_s * 1000:9.1f} ms   (saves {(1 - overlapped_s / serial) * 100:.0f}% "
          "of the serial time)")


def main(title: str, description: str, hidden: int, prompt: Callable[..., Any], decoder: Callable[..., Any],
         timed_by: str, argv: Optional[Sequence[str]] = None) -> int:
    """Command line of a by-layer sample: run ``prompt(peer, args)`` and ``decoder(peer, args)``
    in their own processes, then print the timings that process ``timed_by`` returned and
    ``<title>: bytes match``; on a failure print what failed and return 1."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_args(parser, hidden=hidden)
    args = parser.parse_args(argv)
    try:
        with Launcher(args.timeout) as procs:
            procs.start("prompt", prompt, args)
            procs.start("decoder", decoder, args)
            timings = procs.serve()[timed_by]
    except ChildFailed as exc:
        print(f"{title}: FAILED: {exc}", file=sys.stderr)
        return 1
    report(f"{title} ({args.layers} layers, {kv_bytes(args) / (1 << 20):.1f} MiB of KV, {args.transport})", *timings)
    print(f"{title}: bytes match")
    return 0
