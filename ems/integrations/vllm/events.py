"""KV events of ``EmsConnector`` for KV-aware routers: what the pool holds.

vLLM's scheduler publishes, each step, the events of its own prefix cache and those of
its connector's ``take_events`` (``Scheduler.update_from_output``) on the KV event
publisher (``--kv-events-config``).  This connector's are about the pool:

- ``BlockStored`` once a request's saves are confirmed (its id comes back in
  ``finished_sending``), one event per request: the pool keys of the blocks it saved
  (``ems.keys.token_chain_hashes``, the same in every instance), the key of the block before
  the first one as ``parent_block_hash`` (``None`` from the prompt's start), the blocks'
  token ids and vLLM's block size; ``medium`` ``"CPU"`` (the pool is host memory).
- ``BlockRemoved`` for a key this connector announced that a later lookup found missing
  (evicted): ``exists`` reports how many leading blocks are there, so the first missing
  one is known gone; later ones are not reported (a prefix lookup stops there anyway).

Keys are those of the pool, not vLLM's own block hashes (seeded per process unless
``PYTHONHASHSEED`` is set), so a router sees the same key for the same tokens from every
instance sharing the pool.  The keys announced and not yet seen removed are remembered up
to ``ANNOUNCED_MAX`` (oldest forgotten first), so memory stays bounded on a long run.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional, Sequence

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored

__all__ = ["PoolEvents", "ANNOUNCED_MAX"]

ANNOUNCED_MAX = 1 << 20


class PoolEvents:
    """Events collected between two ``take`` calls (scheduler side, one thread)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[Any] = []
        self._announced: "OrderedDict[int, None]" = OrderedDict()

    def stored(self, hashes: Sequence[int], parent: Optional[int], token_ids: Sequence[int]) -> None:
        """Blocks ``hashes`` (whose tokens are ``token_ids``, ``block_size`` each) are in the pool."""
        if not hashes:
            return
        self._events.append(BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                                        token_ids=list(token_ids), block_size=self.block_size,
                                        lora_id=None, medium=MEDIUM_CPU, lora_name=None))
        for key in hashes:
            self._announced[key] = None
            self._announced.move_to_end(key)
        while len(self._announced) > ANNOUNCED_MAX:
            self._announced.popitem(last=False)

    def missing(self, key: int) -> None:
        """A lookup found ``key`` absent: reported once if this connector announced it."""
        if key in self._announced:
            del self._announced[key]
            self._events.append(BlockRemoved(block_hashes=[key], medium=MEDIUM_CPU))

    def take(self) -> list[Any]:
        events, self._events = self._events, []
        return events
