"""Prepared block transfers: ``push_blocks`` / ``pull_blocks`` between one local cache and
one peer cache, with the keys, the caches and the layer ranges checked once.

A :class:`TransferHandle` (``CacheManager.prepare_push_blocks`` / ``prepare_pull_blocks``)
is what NIXL calls a prepared transfer: ``run(src_blocks, dst_blocks)`` then costs a look
at what may have changed (the local cache still registered, the link still up, the peer's
cache as it was) and the copy itself.  Each handle remembers the plans of the last block
lists it ran (at most :data:`PLANS_PER_HANDLE`, together at most :data:`PLAN_BLOCKS_PER_HANDLE`
entries long), so a repeated call shape skips planning too, and
the plain ``push_blocks`` / ``pull_blocks`` calls run through handles the cache manager
keeps per call shape (:func:`call_ident`): the public calls get the same fast path.

What is never skipped: the local cache must still be the one the handle checked (a
deallocated cache is ``LLM_KV_CACHE_NOT_EXIST``), the link must be up (an unlinked peer is
``LLM_NOT_YET_LINK``, a relinked one is taken up again), and a plan runs again only while
the peer's cache is the one it was made for (the peer's epoch on a same-host link; a socket
peer refuses a stale request, which is then looked up and planned again).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Hashable, Optional, Sequence, Sized, Tuple, cast

from ._objects import BlocksCacheKey, Cache, CacheKey, CacheKeyByIdAndIndex
from ._planning import (BlockList, PeerKey, Side, block_list_arg, blocks_plan, cache_ref, check_nonempty,
                        local_side, peer_cluster, row_blocks_plan)
from ._status import LLMStatusCode, api_class, raise_error
from .engine import native
from .engine.layout import Plan
from .engine.memo import Weighed
from .engine.transports.base import Prepared, RemoteCache

if TYPE_CHECKING:
    from .engine.link import Link
    from .engine.registry import CacheRecord, Registry

__all__ = ["TransferHandle", "PlanMemory", "call_ident", "PLANS_PER_HANDLE", "PLAN_BLOCKS_PER_HANDLE", "MAX_BATCH"]

#: Block lists whose plans a handle remembers (the most recent ones).
PLANS_PER_HANDLE = 32
#: Most block-list pairs one ``run_batch`` takes (their answers must fit the socket's buffers).
MAX_BATCH = 256
#: Entries of the block lists whose plans a handle remembers, all together: a plan and its
#: key take about 40 bytes per entry, so a handle holds at most about 1.3 MiB of them.
PLAN_BLOCKS_PER_HANDLE = 32768

_PUSH_KEYS = (BlocksCacheKey, CacheKeyByIdAndIndex)
_PULL_KEYS = (BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex)


def _blocks_ident(blocks: object) -> Optional[Hashable]:
    """A block list as a dict key: a range as itself, a list or tuple of ints as an
    ``IntKey`` (one C pass; a memcmp to compare); None for anything else (arrays, floats:
    those are planned every time)."""
    if type(blocks) is range:
        return blocks
    return native.int_key(blocks, PLAN_BLOCKS_PER_HANDLE)


class PlanMemory:
    """The plans a handle ran, by their block lists: first by the identity of the lists'
    entries (``RefKey``: the lists' pointer arrays, no entry visited, 2 us for two lists of
    4096), then by their values (``IntKey`` pairs, ranges), which a later call with equal
    lists of other int objects finds (13 us at 4096 + 4096: every entry read).  A plan is
    kept under both."""

    __slots__ = ("_memo",)

    def __init__(self) -> None:
        self._memo: Weighed[Hashable, Prepared] = Weighed(PLANS_PER_HANDLE, PLAN_BLOCKS_PER_HANDLE)

    def find(self, src_blocks: Any, dst_blocks: Any) -> tuple[Optional[Prepared], object]:
        """The plan remembered for these block lists (None if none), and what :meth:`keep`
        needs to remember a new one (None: nothing to remember)."""
        probe = native.ref_key(src_blocks, dst_blocks, PLAN_BLOCKS_PER_HANDLE)
        if probe is not None:
            hit = self._memo.get(probe)
            if hit is not None:
                return hit, None
        sb, db = _blocks_ident(src_blocks), _blocks_ident(dst_blocks)
        key = (sb, db) if sb is not None and db is not None else None
        hit = self._memo.get(key) if key is not None else None
        return (hit, None) if hit is not None else (None, (probe, key))

    def keep(self, keys: object, ready: Prepared, src_blocks: Sized, dst_blocks: Sized) -> None:
        """Remember ``ready`` under the keys :meth:`find` gave (nothing if it gave None)."""
        if keys is None:
            return
        probe, key = cast(Tuple[Any, Optional[Hashable]], keys)
        if key is not None:
            self._memo.put(key, ready, _weight(src_blocks, dst_blocks))
        pinned = probe.pinned() if probe is not None else None
        if pinned is not None:  # every entry an exact int
            self._memo.put(pinned, ready, _weight(src_blocks, dst_blocks))

    def clear(self) -> None:
        self._memo.clear()


def _weight(src_blocks: Sized, dst_blocks: Sized) -> int:
    """What remembering the plan of two block lists costs (entries: plan arrays and key
    grow with them)."""
    return len(src_blocks) + len(dst_blocks)


def _peer_ident(key: object) -> Optional[Hashable]:
    """A peer key as a dict key, for the kinds whose lookups stay valid between calls (a
    ``CacheKey`` row is consumed by the pull that reads it)."""
    kind = type(key)
    if kind is BlocksCacheKey:
        return (1, key.prompt_cluster_id, key.model_id)  # type: ignore[attr-defined]
    if kind is CacheKeyByIdAndIndex:
        return (2, key.cluster_id, key.cache_id, key.batch_index)  # type: ignore[attr-defined]
    return None


def call_ident(push: bool, peer_key: object, cache: object, src_layer_range: object, dst_layer_range: object,
               tensor_num_per_layer: object) -> Optional[Tuple[Hashable, ...]]:
    """What a handle for a ``push_blocks`` / ``pull_blocks`` call depends on, as a dict key
    (exact types only, so ``True`` never finds the handle of ``1``); None where the call
    is not worth keeping a handle for."""
    peer = _peer_ident(peer_key)
    if peer is None or type(cache) is not Cache or type(tensor_num_per_layer) is not int:
        return None
    if (src_layer_range is not None and type(src_layer_range) is not range) or \
            (dst_layer_range is not None and type(dst_layer_range) is not range):
        return None
    cache_id = cache.cache_id
    if cache_id < 0:
        return None
    return (push, peer, cache_id, src_layer_range, dst_layer_range, tensor_num_per_layer)


@api_class
class TransferHandle:
    """Blocks of one local cache to or from one peer cache, prepared: see the module
    docstring.  Made by ``CacheManager.prepare_push_blocks`` / ``prepare_pull_blocks``.

    ``run(src_blocks, dst_blocks)`` moves the blocks as ``push_blocks`` /
    ``pull_blocks`` with the handle's key, cache and layer ranges would, with the same
    errors; without block lists it moves those given when the handle was prepared.
    A handle may be run from several threads (transfers on one link run one at a time).
    """

    def __init__(self, links: Callable[[int], Link], registry: Callable[[], Registry], push: bool,
                 peer_key: PeerKey, cache: Cache, src_layer_range: Optional[range] = None,
                 dst_layer_range: Optional[range] = None, tensor_num_per_layer: int = 2) -> None:
        """``links(cluster_id)`` gives the link to a peer ready for transfers (or raises
        the contract's error), ``registry()`` this engine's registry; both are asked again
        when the link goes down."""
        self._cluster = peer_cluster(peer_key, "dst_cache_key" if push else "src_cache_key",
                                     _PUSH_KEYS if push else _PULL_KEYS)
        self._links = links
        self._registry_of = registry
        self._side = local_side(registry(), cache)
        self._push = push
        self._peer_key = peer_key
        self._cache_id = cache.cache_id
        self._ref = cache_ref(peer_key)
        self._ranges = (src_layer_range, dst_layer_range)
        self._tnpl = tensor_num_per_layer
        self._plans = PlanMemory()
        self._given: Optional[Tuple[BlockList, BlockList]] = None
        self._given_plan: Optional[Prepared] = None
        self._registry: Registry
        self._record: Optional[CacheRecord]
        self._link: Link
        self._bind()

    def _bind(self) -> None:
        """Take up the engine's current registry record of the cache and link to the peer."""
        self._registry = self._registry_of()
        self._record = self._registry.get(self._cache_id) if self._cache_id >= 0 else None
        self._link = self._links(self._cluster)

    # -- public ----------------------------------------------------------------------------
    def prepare(self, src_blocks: BlockList, dst_blocks: BlockList) -> None:
        """Check ``src_blocks``/``dst_blocks`` against both caches and plan them now (the
        peer is asked once), so that ``run()`` without arguments only moves them."""
        self._check_blocks(src_blocks, dst_blocks)
        self._live()
        self._given = (src_blocks, dst_blocks)
        self._given_plan = self._link.prepare(self._ref, functools.partial(self._plan, src_blocks, dst_blocks),
                                              self._push)

    def run(self, src_blocks: Optional[BlockList] = None, dst_blocks: Optional[BlockList] = None) -> None:
        """Move ``src_blocks[i]`` -> ``dst_blocks[i]`` (both or neither; neither: the lists
        the handle was prepared with)."""
        if src_blocks is None and dst_blocks is None:
            if self._given is None:
                raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                            "run() without block lists needs a handle prepared with src_blocks and dst_blocks")
            link = self._live()
            self._given_plan = link.transfer(self._ref, functools.partial(self._plan, *self._given), self._push,
                                             self._given_plan)
            return
        if src_blocks is None or dst_blocks is None:
            raise TypeError("run() takes both src_blocks and dst_blocks, or neither")
        self._run(src_blocks, dst_blocks)

    def run_batch(self, block_lists: Sequence[Tuple[BlockList, BlockList]]) -> None:
        """``run(src_blocks, dst_blocks)`` for each pair of ``block_lists`` (at most
        :data:`MAX_BATCH`), in one go: over a socket link the pushes go out back to back
        and their answers are read after, one round trip for the batch; other links and
        pulls move them in turn.  Every pair is checked first, and nothing moves if one is
        wrong; a failure while moving is raised after the batch (pairs before it have
        moved)."""
        if not isinstance(block_lists, (list, tuple)):
            raise TypeError(f"block_lists must be a list of (src_blocks, dst_blocks) pairs, "
                            f"got {type(block_lists).__name__}")
        if not 0 < len(block_lists) <= MAX_BATCH:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                        f"block_lists has {len(block_lists)} pairs; give 1 to {MAX_BATCH}")
        keys: list[object] = []
        known: list[Optional[Prepared]] = []
        for i, pair in enumerate(block_lists):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"block_lists[{i}] must be a (src_blocks, dst_blocks) pair")
            hit, key = self._plans.find(*pair)
            if hit is None:
                self._check_blocks(*pair)
            keys.append(key)
            known.append(hit)
        link = self._live()
        planners = [functools.partial(self._plan, sb, db) for sb, db in block_lists]
        done = link.transfer_batch(self._ref, planners, self._push, known)
        for key, hint, ready, (sb, db) in zip(keys, known, done, block_lists):
            if ready is not hint:
                self._plans.keep(key, ready, sb, db)

    @property
    def is_push(self) -> bool:
        return self._push

    @property
    def peer_key(self) -> PeerKey:
        return self._peer_key

    def __repr__(self) -> str:
        return (f"TransferHandle({'push' if self._push else 'pull'}, {self._peer_key!r}, cache {self._cache_id}, "
                f"layers {self._ranges[0]} -> {self._ranges[1]}, tensor_num_per_layer={self._tnpl})")

    # -- the call --------------------------------------------------------------------------
    def _run(self, src_blocks: BlockList, dst_blocks: BlockList) -> None:
        """``run`` with block lists, for the public calls (no API wrapper of its own)."""
        known, key = self._plans.find(src_blocks, dst_blocks)
        if known is None:
            self._check_blocks(src_blocks, dst_blocks)
        link = self._live()
        ready = link.transfer(self._ref, functools.partial(self._plan, src_blocks, dst_blocks), self._push, known)
        if ready is not known:
            self._plans.keep(key, ready, src_blocks, dst_blocks)

    def _live(self) -> Link:
        """The link, after checking that the cache is still the one checked; a link that
        went down is replaced by the engine's current one (or the contract's error), and
        the plans made over it are dropped."""
        if self._record is not None and self._registry.get(self._cache_id) is not self._record:
            raise_error(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                        f"cache {self._cache_id} is not (or no longer) known to this engine")
        link = self._link
        if link.broken is not None:
            self._plans.clear()
            self._given_plan = None
            self._bind()
            if self._record is not None and self._registry.get(self._cache_id) is not self._record:
                raise_error(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                            f"cache {self._cache_id} is not (or no longer) known to this engine")
            link = self._link
        return link

    def _check_blocks(self, src_blocks: object, dst_blocks: object) -> None:
        """The checks ``push_blocks`` / ``pull_blocks`` make before asking the peer."""
        check_nonempty("dst_blocks", dst_blocks)
        if self._push:
            block_list_arg("src_blocks", src_blocks, self._side.batch_size)
        elif isinstance(self._peer_key, BlocksCacheKey):
            check_nonempty("src_blocks", src_blocks)

    def _plan(self, src_blocks: Any, dst_blocks: Any, remote: RemoteCache) -> Plan:
        """The plan against the peer cache as looked up (validates the remote geometry)."""
        (sr, dr), tnpl = self._ranges, self._tnpl
        peer = Side.of_remote(remote)
        if self._push:
            if not remote.is_blocks:
                raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                            f"push_blocks: {self._peer_key} names cache {remote.cache_id}, which is not a blocks "
                            "cache (push_cache writes rows of contiguous caches)")
            return blocks_plan(self._side, peer, src_blocks, dst_blocks, tnpl, sr, dr, same_range=True)
        if not isinstance(self._peer_key, BlocksCacheKey) and len(src_blocks) == 0:
            return row_blocks_plan(peer, remote.row, self._side, dst_blocks, tnpl, sr, dr)
        if not remote.is_blocks:
            raise_error(LLMStatusCode.LLM_PARAM_INVALID,
                        "pull_blocks from a contiguous cache needs src_blocks=() (row -> blocks)")
        return blocks_plan(peer, self._side, src_blocks, dst_blocks, tnpl, sr, dr)
