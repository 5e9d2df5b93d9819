"""Prepared block transfers: blocks of one local cache to or from one peer cache, checked
once, run many times, released when done (NIXL's lifecycle: prepare, run, check,
release).

A :class:`PreparedTransfer` holds everything a repeated ``push_blocks`` / ``pull_blocks``
of one call shape would otherwise redo: the local cache's geometry and registry record,
the link, the peer cache's reference, and the plans of the last block lists it ran
(:class:`PlanMemory`: at most :data:`PLANS_PER_HANDLE`, together at most
:data:`PLAN_BLOCKS_PER_HANDLE` entries long), each a :class:`~.transports.base.Prepared`
(the peer's cache as looked up, the plan, the transport's step).  ``run`` then costs a look
at what may have changed and the copy itself.  The API's ``TransferHandle`` and the
cache manager's cache of plain calls by shape are thin users of it.

What is checked on every run, never skipped:

- the local cache is still the registry record the transfer was made with (a
  deallocated cache is ``CACHE_NOT_FOUND``: the registry reader is asked each time);
- the link is up: a link that went down is replaced by the one the link getter gives now
  (a relinked peer), or the getter's error (``NOT_LINKED``), and every plan made over the
  old one is dropped;
- a plan runs again only while the peer's cache is the one it was made for (the link
  checks the peer's epoch on a same-host link; a socket peer refuses a stale request,
  which is then looked up and planned again).

After :meth:`PreparedTransfer.release` its plans are gone and every call fails
(``PARAM_INVALID``).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Hashable, Optional, Sequence, Sized, Tuple, cast

from . import native
from .errors import Fault, fail
from .keys import CacheRef, RefKind
from .layout import Plan
from .link import Link
from .memo import Weighed
from .planning import BlockList, Side, block_list_arg, blocks_plan, check_nonempty, row_blocks_plan
from .registry import CacheRecord, Registry
from .transports.base import Prepared, RemoteCache

__all__ = ["PreparedTransfer", "PlanMemory", "PLANS_PER_HANDLE", "PLAN_BLOCKS_PER_HANDLE", "MAX_BATCH", "SPARSE_AFTER",
           "SPARSE_KEEP"]

#: Block lists whose plans a prepared transfer remembers (the most recent ones).
PLANS_PER_HANDLE = 32
#: Most block-list pairs one ``run_batch`` takes (their answers must fit the socket's buffers).
MAX_BATCH = 256
#: Entries of the block lists whose plans a prepared transfer remembers, all together: a
#: plan and its key take about 40 bytes per entry, so one holds at most about 1.3 MiB.
PLAN_BLOCKS_PER_HANDLE = 32768
#: Misses in a row after which a prepared transfer remembers only every ``SPARSE_KEEP``-th
#: new plan: block lists that never repeat (random blocks per call) would otherwise pay
#: for keys and evictions that nothing finds again (a tenth of a small pull's CPU).
SPARSE_AFTER, SPARSE_KEEP = 64, 16


def _blocks_ident(blocks: object) -> Optional[Hashable]:
    """A block list as a dict key: a range as itself, a list or tuple of ints as an
    ``IntKey`` (one C pass; a memcmp to compare); None for anything else (arrays, floats:
    those are planned every time)."""
    if type(blocks) is range:
        return blocks
    return native.int_key(blocks, PLAN_BLOCKS_PER_HANDLE)


class PlanMemory:
    """The plans a prepared transfer ran, by their block lists: first by the identity of
    the lists' entries (``RefKey``: the lists' pointer arrays, no entry visited, 2 us for
    two lists of 4096), then by their values (``IntKey`` pairs, ranges), which a later call
    with equal lists of other int objects finds (13 us at 4096 + 4096: every entry read).
    A plan is kept under both.  After :data:`SPARSE_AFTER` misses in a row only every
    :data:`SPARSE_KEEP`-th new plan is kept, until one is found again: lists that do repeat
    are then still kept within a few calls, and their first hit restores keeping every one."""

    __slots__ = ("_memo", "_misses")

    def __init__(self) -> None:
        self._memo: Weighed[Hashable, Prepared] = Weighed(PLANS_PER_HANDLE, PLAN_BLOCKS_PER_HANDLE)
        self._misses = 0  # lookups in a row that found nothing

    def find(self, src_blocks: Any, dst_blocks: Any) -> tuple[Optional[Prepared], object]:
        """The plan remembered for these block lists (None if none), and what :meth:`keep`
        needs to remember a new one (None: nothing to remember)."""
        probe = native.ref_key(src_blocks, dst_blocks, PLAN_BLOCKS_PER_HANDLE)
        if probe is not None:
            hit = self._memo.get(probe)
            if hit is not None:
                self._misses = 0
                return hit, None
        sb, db = _blocks_ident(src_blocks), _blocks_ident(dst_blocks)
        key = (sb, db) if sb is not None and db is not None else None
        hit = self._memo.get(key) if key is not None else None
        if hit is not None:
            self._misses = 0
            return hit, None
        self._misses += 1
        return None, (probe, key)

    def keep(self, keys: object, prepared: Prepared, src_blocks: Sized, dst_blocks: Sized) -> None:
        """Remember ``prepared`` under the keys :meth:`find` gave (nothing if it gave None,
        or while lookups keep missing: see the class docstring)."""
        if keys is None:
            return
        if self._misses > SPARSE_AFTER and self._misses % SPARSE_KEEP:
            return
        probe, key = cast(Tuple[Any, Optional[Hashable]], keys)
        weight = len(src_blocks) + len(dst_blocks)  # plan arrays and keys grow with the lists
        if key is not None:
            self._memo.put(key, prepared, weight)
        pinned = probe.pinned() if probe is not None else None
        if pinned is not None:  # every entry an exact int
            self._memo.put(pinned, prepared, weight)

    def clear(self) -> None:
        self._memo.clear()


class PreparedTransfer:
    """Blocks of one local cache (``side``, registry id ``cache_id``; negative: a cache the
    registry never knew) to (``push``) or from one peer cache (``ref`` on the peer
    ``ref.cluster_id``), over the layer ranges and ``tensor_num_per_layer`` given: see the
    module docstring.  ``links(cluster_id)`` gives the link to a peer ready for transfers
    (or raises the contract's error), ``registry()`` the engine's registry; both are asked
    again when the link goes down.  Safe to run from several threads (transfers on one
    link run one at a time)."""

    def __init__(self, links: Callable[[int], Link], registry: Callable[[], Registry], push: bool, ref: CacheRef,
                 side: Side, cache_id: int, src_layer_range: Optional[range] = None,
                 dst_layer_range: Optional[range] = None, tensor_num_per_layer: int = 2) -> None:
        self.push = push
        self.ref = ref
        self._links = links
        self._registry_of = registry
        self._side = side
        self._cache_id = cache_id
        self._ranges = (src_layer_range, dst_layer_range)
        self._tnpl = tensor_num_per_layer
        self._plans = PlanMemory()
        #: The block lists given to :meth:`prepare` and their plan (``run()`` without lists).
        self._given: Optional[Tuple[BlockList, BlockList, Optional[Prepared]]] = None
        self._released = False
        self._rebind = threading.Lock()
        self._registry: Registry
        self._record: Optional[CacheRecord]
        self._link: Link
        self._bind()

    def _bind(self) -> None:
        """Take up the engine's current registry record of the cache and link to the peer."""
        self._registry = self._registry_of()
        self._record = self._registry.get(self._cache_id) if self._cache_id >= 0 else None
        self._link = self._links(self.ref.cluster_id)

    # -- lifecycle ---------------------------------------------------------------------------
    def prepare(self, src_blocks: BlockList, dst_blocks: BlockList) -> None:
        """Check ``src_blocks``/``dst_blocks`` against both caches and plan them now (the
        peer is asked once), so that :meth:`run` without lists only moves them."""
        self.check_blocks(src_blocks, dst_blocks)
        link = self._live()
        self._given = (src_blocks, dst_blocks, link.prepare(self.ref, self._planner(src_blocks, dst_blocks), self.push))

    def run(self, src_blocks: BlockList, dst_blocks: BlockList) -> None:
        """Move ``src_blocks[i]`` -> ``dst_blocks[i]``."""
        link = self._live()  # first: a link that went down takes its plans with it
        prepared, keys = self._plans.find(src_blocks, dst_blocks)
        if prepared is None:
            self.check_blocks(src_blocks, dst_blocks)
        done = link.transfer(self.ref, self._planner(src_blocks, dst_blocks), self.push, prepared)
        if done is not prepared:
            self._plans.keep(keys, done, src_blocks, dst_blocks)

    def run_given(self) -> None:
        """Move the block lists :meth:`prepare` was given."""
        link = self._live()  # first: a link that went down takes the prepared plan with it
        given = self._given
        if given is None:
            fail(Fault.PARAM_INVALID,
                 "run() without block lists needs a handle prepared with src_blocks and dst_blocks")
        src_blocks, dst_blocks, prepared = given
        done = link.transfer(self.ref, self._planner(src_blocks, dst_blocks), self.push, prepared)
        if done is not prepared:
            self._given = (src_blocks, dst_blocks, done)

    def run_batch(self, block_lists: Sequence[Tuple[BlockList, BlockList]]) -> None:
        """:meth:`run` of each pair of ``block_lists`` (1 to :data:`MAX_BATCH` pairs) in one
        go: every pair is checked first and nothing moves if one is wrong; a failure while
        moving is raised after the batch (pairs before it have moved)."""
        if not 0 < len(block_lists) <= MAX_BATCH:
            fail(Fault.PARAM_INVALID, f"block_lists has {len(block_lists)} pairs; give 1 to {MAX_BATCH}")
        link = self._live()  # first: a link that went down takes its plans with it
        keys: list[object] = []
        known: list[Optional[Prepared]] = []
        for i, pair in enumerate(block_lists):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"block_lists[{i}] must be a (src_blocks, dst_blocks) pair")
            prepared, key = self._plans.find(*pair)
            if prepared is None:
                self.check_blocks(*pair)
            keys.append(key)
            known.append(prepared)
        done = link.transfer_batch(self.ref, [self._planner(sb, db) for sb, db in block_lists], self.push, known)
        for key, prepared, now, (sb, db) in zip(keys, known, done, block_lists):
            if now is not prepared:
                self._plans.keep(key, now, sb, db)

    def release(self) -> None:
        """Drop the plans and the lists given to :meth:`prepare`; every later call fails
        with ``PARAM_INVALID``.  Idempotent."""
        self._released = True
        self._given = None
        self._plans.clear()

    # -- checks ------------------------------------------------------------------------------
    def _live(self) -> Link:
        """The link, after checking that the transfer is not released and the cache is
        still the one checked; a link that went down is replaced by the engine's current
        one (or the contract's error), and the plans made over it are dropped."""
        self._check_record()  # a cache freed meanwhile is named first, released or not
        if self._released:
            fail(Fault.PARAM_INVALID, f"{self} was released")
        link = self._link
        if link.broken is not None:
            with self._rebind:
                if self._link is link:
                    self._plans.clear()
                    if self._given is not None:
                        self._given = self._given[:2] + (None,)
                    self._bind()
            self._check_record()
            link = self._link
        return link

    def _check_record(self) -> None:
        if self._record is not None and self._registry.get(self._cache_id) is not self._record:
            fail(Fault.CACHE_NOT_FOUND, f"cache {self._cache_id} is not (or no longer) known to this engine")

    def check_blocks(self, src_blocks: object, dst_blocks: object) -> None:
        """The checks ``push_blocks`` / ``pull_blocks`` make before asking the peer."""
        check_nonempty("dst_blocks", dst_blocks)
        if self.push:
            block_list_arg("src_blocks", src_blocks, self._side.batch_size)
        elif self.ref.kind is RefKind.BLOCKS:
            check_nonempty("src_blocks", src_blocks)

    # -- planning ----------------------------------------------------------------------------
    def _planner(self, src_blocks: Any, dst_blocks: Any) -> Callable[[RemoteCache], Plan]:
        return functools.partial(self.plan, src_blocks, dst_blocks)

    def plan(self, src_blocks: Any, dst_blocks: Any, remote: RemoteCache) -> Plan:
        """The plan of these block lists against the peer cache as looked up (validates
        the remote geometry)."""
        (sr, dr), tnpl = self._ranges, self._tnpl
        peer = Side.of_remote(remote)
        if self.push:
            if not remote.is_blocks:
                fail(Fault.PARAM_INVALID, f"push_blocks: {self.ref} names cache {remote.cache_id}, which is not a "
                                          "blocks cache (push_cache writes rows of contiguous caches)")
            return blocks_plan(self._side, peer, src_blocks, dst_blocks, tnpl, sr, dr, same_range=True)
        if self.ref.kind is not RefKind.BLOCKS and len(src_blocks) == 0:
            return row_blocks_plan(peer, remote.row, self._side, dst_blocks, tnpl, sr, dr)
        if not remote.is_blocks:
            fail(Fault.PARAM_INVALID, "pull_blocks from a contiguous cache needs src_blocks=() (row -> blocks)")
        return blocks_plan(peer, self._side, src_blocks, dst_blocks, tnpl, sr, dr)

    def __repr__(self) -> str:
        return (f"{'push' if self.push else 'pull'} of cache {self._cache_id} {'to' if self.push else 'from'} "
                f"{self.ref}, layers {self._ranges[0]} -> {self._ranges[1]}, "
                f"tensor_num_per_layer={self._tnpl}")
