"""Prepared block transfers in the API: :class:`TransferHandle` (``CacheManager.
prepare_push_blocks`` / ``prepare_pull_blocks``), what NIXL calls a prepared transfer, and
the shape of a plain ``push_blocks`` / ``pull_blocks`` call as the key of the cache
manager's prepared transfers (:func:`call_ident`), so the public calls get the same fast
path.  Both are thin users of the engine's
:class:`~datadist.engine.prepared.PreparedTransfer`: this module checks the keys and the
cache against the contract and hands it a link getter and a registry reader.
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence, Tuple

from ._objects import BlocksCacheKey, Cache, CacheKey, CacheKeyByIdAndIndex
from ._planning import PeerKey, cache_ref, local_side, peer_cluster
from ._status import api_class
from .engine.link import Link
from .engine.planning import BlockList
from .engine.prepared import MAX_BATCH, PreparedTransfer
from .engine.registry import Registry

__all__ = ["TransferHandle", "call_ident", "prepared_transfer", "MAX_BATCH"]

_PUSH_KEYS = (BlocksCacheKey, CacheKeyByIdAndIndex)
_PULL_KEYS = (BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex)


def prepared_transfer(links: Callable[[int], Link], registry: Callable[[], Registry], push: bool, peer_key: PeerKey,
                      cache: Cache, src_layer_range: Optional[range], dst_layer_range: Optional[range],
                      tensor_num_per_layer: int) -> PreparedTransfer:
    """The engine's prepared transfer for a ``push_blocks`` / ``pull_blocks`` call with
    these keys, cache and layer ranges, after checking the key's kind (``TypeError``), the
    cache (``LLM_KV_CACHE_NOT_EXIST``) and the link (``LLM_NOT_YET_LINK``)."""
    peer_cluster(peer_key, "dst_cache_key" if push else "src_cache_key", _PUSH_KEYS if push else _PULL_KEYS)
    side = local_side(registry(), cache)
    return PreparedTransfer(links, registry, push, cache_ref(peer_key), side, cache.cache_id, src_layer_range,
                            dst_layer_range, tensor_num_per_layer)


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
    """What a prepared transfer for a ``push_blocks`` / ``pull_blocks`` call depends on, as
    a dict key (exact types only, so ``True`` never finds the one of ``1``); None where the
    call is not worth keeping one for."""
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
    """Blocks of one local cache to or from one peer cache, prepared (the engine's
    :class:`~datadist.engine.prepared.PreparedTransfer`).  Made by
    ``CacheManager.prepare_push_blocks`` / ``prepare_pull_blocks``.

    ``run(src_blocks, dst_blocks)`` moves the blocks as ``push_blocks`` /
    ``pull_blocks`` with the handle's key, cache and layer ranges would, with the same
    errors; without block lists it moves those given when the handle was prepared.
    ``release()`` gives back what the handle holds (its plans); it cannot run after.
    A handle may be run from several threads (transfers on one link run one at a time).
    """

    def __init__(self, links: Callable[[int], Link], registry: Callable[[], Registry], push: bool,
                 peer_key: PeerKey, cache: Cache, src_layer_range: Optional[range] = None,
                 dst_layer_range: Optional[range] = None, tensor_num_per_layer: int = 2) -> None:
        """``links(cluster_id)`` gives the link to a peer ready for transfers (or raises
        the contract's error), ``registry()`` this engine's registry; both are asked again
        when the link goes down."""
        self._peer_key = peer_key
        self._transfer = prepared_transfer(links, registry, push, peer_key, cache, src_layer_range, dst_layer_range,
                                           tensor_num_per_layer)

    def prepare(self, src_blocks: BlockList, dst_blocks: BlockList) -> None:
        """Check ``src_blocks``/``dst_blocks`` against both caches and plan them now (the
        peer is asked once), so that ``run()`` without arguments only moves them."""
        self._transfer.prepare(src_blocks, dst_blocks)

    def run(self, src_blocks: Optional[BlockList] = None, dst_blocks: Optional[BlockList] = None) -> None:
        """Move ``src_blocks[i]`` -> ``dst_blocks[i]`` (both or neither; neither: the lists
        the handle was prepared with)."""
        if src_blocks is None and dst_blocks is None:
            self._transfer.run_given()
        elif src_blocks is None or dst_blocks is None:
            raise TypeError("run() takes both src_blocks and dst_blocks, or neither")
        else:
            self._transfer.run(src_blocks, dst_blocks)

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
        self._transfer.run_batch(block_lists)

    def release(self) -> None:
        """Give back the handle's plans; ``run`` then raises ``LLM_PARAM_INVALID``.
        Idempotent."""
        self._transfer.release()

    @property
    def is_push(self) -> bool:
        return self._transfer.push

    @property
    def peer_key(self) -> PeerKey:
        return self._peer_key

    def __repr__(self) -> str:
        return f"TransferHandle({self._transfer!r})"
