"""ems_quickstart: the EMS SDK quick start, against a pool daemon of this run's own.

Two processes on this host, as two inference processes sharing one context-caching pool:

- the saver: ``Ems.init`` with an ``EmsConfig`` around a ``CcConfig``, ``Ems.get_cc``,
  ``register_kvcache`` of its paged KV cache (``kvcache[layer][k_or_v]``, each tensor
  ``[blocks, block_size, heads, head_size]``) filled with seeded data, then ``save`` in the
  hash form: the three full blocks of a prompt, block i taken from cache block
  ``SRC_BLOCKS[i]`` and stored under the prefix hash of the prompt's first i + 1 blocks;
  then ``exists`` of those hashes;
- the loader, a second process with a zeroed cache: the same init and registration; once
  the saver is done, ``exists`` of the hashes and an unknown one after them (the leading
  run counts: 3 of 4) and ``load`` of the three into other blocks (``DST_BLOCKS``).  It
  checks every byte of them against what the saver saved, and that no other block was
  written.

This process starts the pool, an ``ems-server`` in a temporary directory, and stops and
removes it at the end (the node's shared pool in /dev/shm/ems is never touched).  Prints
"ems_quickstart: bytes match" and exits 0; exits 1 on any failure, with the failing
process's traceback.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from typing import List, Optional, Sequence

import torch

from _launch import ChildFailed, Launcher, Peer, expect_bytes, private_pool, source_tensors
from ems import CcConfig, CcKvOption, ContextCaching, Ems, EmsConfig
from tiny_llama import block_slots, prefix_hashes

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 4, 8, 16, 2, 64
DTYPE = torch.float16
SEED = 0
#: The prompt: three full blocks and a partial one, which gets no hash and is not saved.
PROMPT = [random.Random(SEED).randrange(32000) for _ in range(3 * BLOCK_SIZE + 5)]
HASHES = prefix_hashes(PROMPT, BLOCK_SIZE)
#: Where the saver holds the prompt's blocks, and where the loader wants them.
SRC_BLOCKS = [5, 1, 2]
DST_BLOCKS = [0, 6, 3]
#: A hash no process saved.
UNKNOWN_HASH = 0x5EED


def _context_caching(server: str, kvcache: List[List[torch.Tensor]]) -> ContextCaching:
    """Init the process's EMS client on ``server`` and register ``kvcache``."""
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="ems-quickstart"), server=server))
    cc = Ems.get_cc()
    if cc is None:
        raise RuntimeError("Ems.init returned without a ContextCaching")
    cc.register_kvcache(kvcache)
    return cc


def _kvcache(tensors: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
    """``tensors`` (K0, V0, K1, V1, ...) as the ``kvcache[layer][k_or_v]`` lists the SDK takes."""
    return [[tensors[2 * i], tensors[2 * i + 1]] for i in range(LAYERS)]


def _source() -> List[torch.Tensor]:
    """The saver's cache contents; the loader computes the same to know what must arrive."""
    return source_tensors(2 * LAYERS, (BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE), DTYPE, SEED)


def saver(peer: Peer, server: str) -> None:
    cc = _context_caching(server, _kvcache(_source()))
    option = CcKvOption(timeout=5000)
    result = cc.save(slot_mapping=block_slots(SRC_BLOCKS, BLOCK_SIZE), hashes=HASHES,
                     offsets=[BLOCK_SIZE] * len(HASHES), option=option)
    if result.success != len(HASHES):
        raise AssertionError(f"save stored {result.success} of {result.total} blocks")
    present = cc.exists(HASHES, option)
    if present.success != len(HASHES):
        raise AssertionError(f"exists after save: {present}")
    peer.barrier("saved")


def loader(peer: Peer, server: str) -> None:
    tensors = [torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype=DTYPE) for _ in range(2 * LAYERS)]
    cc = _context_caching(server, _kvcache(tensors))
    option = CcKvOption(timeout=5000)
    peer.barrier("saved")
    present = cc.exists(HASHES + [UNKNOWN_HASH], option)
    if (present.success, present.total) != (len(HASHES), len(HASHES) + 1):
        raise AssertionError(f"exists: {present}, expected {len(HASHES)} leading hits of {len(HASHES) + 1}")
    result = cc.load(slot_mapping=block_slots(DST_BLOCKS, BLOCK_SIZE), hashes=HASHES,
                     offsets=[BLOCK_SIZE] * len(HASHES), option=option)
    if result.success != len(HASHES):
        raise AssertionError(f"load filled {result.success} of {result.total} blocks")
    untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
    for t, (got, sent) in enumerate(zip(tensors, _source())):
        for src, dst in zip(SRC_BLOCKS, DST_BLOCKS):
            expect_bytes(got[dst], sent[src], f"tensor {t}, block {dst} (saved from block {src})")
        expect_bytes(got[untouched], torch.zeros_like(got[untouched]), f"tensor {t}, blocks not loaded")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    start = time.perf_counter()
    try:
        with private_pool(64 << 20) as server, Launcher() as launcher:
            launcher.start("saver", saver, server)
            launcher.start("loader", loader, server)
            launcher.serve()
    except ChildFailed as exc:
        print(f"ems_quickstart: FAILED: {exc}", file=sys.stderr)
        return 1
    block_bytes = 2 * LAYERS * BLOCK_SIZE * HEADS * HEAD_SIZE * DTYPE.itemsize
    print(f"ems_quickstart: bytes match ({len(HASHES)} blocks of {block_bytes} bytes saved by one process and "
          f"loaded by another, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
