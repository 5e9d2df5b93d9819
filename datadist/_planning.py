"""The API's half of planning a transfer: which peer and which peer cache a key names, and
the local side of a transfer as the registry records the caller's cache (the contract's
exceptions, naming the argument and value).  Block and row checks and the plans
themselves are the engine's (:mod:`datadist.engine.planning`).
"""
from __future__ import annotations

from typing import Tuple, Type, Union

import numpy as np

from ._objects import BlocksCacheKey, Cache, CacheKey, CacheKeyByIdAndIndex
from ._status import LLMStatusCode, raise_error
from .engine.keys import CacheRef, RefKind
from .engine.planning import Side
from .engine.registry import Registry

#: A key naming a peer cache (or one of its rows).
PeerKey = Union[CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey]

__all__ = ["PeerKey", "cache_ref", "cache_side", "local_side", "peer_cluster"]


def cache_side(cache: Cache) -> Side:
    """The side of a transfer as ``cache`` describes itself (its own addresses and shape)."""
    d = cache.cache_desc
    return Side(np.asarray(cache.tensor_addrs, dtype=np.uint64), d.num_tensors, d.size, d.batch_size,
                dtype=d.data_type.name)


def local_side(registry: Registry, cache: Cache) -> Side:
    """The local side of a transfer with ``cache``: as ``registry`` records it now (a
    cache it does not know is ``LLM_KV_CACHE_NOT_EXIST``), or as the object describes it
    for a cache never registered (``Cache.create_cpu_cache``)."""
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a Cache, got {type(cache).__name__}")
    if cache.cache_id < 0:
        return cache_side(cache)
    rec = registry.get(cache.cache_id)
    if rec is None:
        raise_error(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"cache {cache.cache_id} is not (or no longer) known to this engine")
    return Side(rec.addrs, rec.num_tensors, rec.tensor_size, rec.batch_size, rec.device, rec.dtype)


def peer_cluster(key: object, what: str, kinds: Tuple[Type[PeerKey], ...]) -> int:
    """The cluster that owns the peer cache ``key`` names (the ``prompt_cluster_id`` of a
    ``CacheKey`` or ``BlocksCacheKey``); ``TypeError`` naming ``what`` unless ``key`` is
    one of ``kinds``."""
    if not isinstance(key, kinds):
        raise TypeError(f"{what} must be one of {', '.join(k.__name__ for k in kinds)}, got {type(key).__name__}")
    return key.cluster_id


def cache_ref(key: CacheKeyByIdAndIndex | CacheKey | BlocksCacheKey) -> CacheRef:
    """How the engine names the peer cache ``key`` names (a validated key object)."""
    if isinstance(key, CacheKeyByIdAndIndex):
        return CacheRef(RefKind.ID, key.cluster_id, key.cache_id, key.batch_index, origin=key)
    if isinstance(key, BlocksCacheKey):
        return CacheRef(RefKind.BLOCKS, key.prompt_cluster_id, model_id=key.model_id, origin=key)
    return CacheRef(RefKind.KEY, key.prompt_cluster_id, req_id=key.req_id, model_id=key.model_id,
                    prefix_id=key.prefix_id, origin=key)
