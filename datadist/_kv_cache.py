"""``KvCache``: the cache object of CANN's KvCacheManager (v1) mode, for code that imports
it or builds host caches with :meth:`KvCache.create_cpu_cache`.

This library implements CacheManager mode, whose calls take :class:`~datadist.Cache`; a
``KvCache`` is a plain record here (CANN's v1 ``KvCacheManager`` is not provided).
"""
from __future__ import annotations

from typing import Any, List, Optional

from ._objects import CacheDesc, _check_type, _int_in
from ._status import ParamInvalidError, api_class
from ._types import Placement

__all__ = ["KvCache"]

_INT64 = (-(2**63), 2**63 - 1)


@api_class
class KvCache:
    """A v1-mode cache: ``cache_id``, ``cache_desc`` and one list of tensor addresses per
    device (``per_device_tensor_addrs``)."""

    def __init__(self, cache_id: int, cache_desc: CacheDesc, per_device_tensor_addrs: List[List[int]],
                 kv_cache_manager: Optional[Any] = None) -> None:
        self._cache_id = _int_in("cache_id", cache_id, *_INT64)
        _check_type("cache_desc", cache_desc, CacheDesc)
        self._cache_desc = cache_desc
        self._per_device_tensor_addrs = per_device_tensor_addrs
        self._kv_cache_manager = kv_cache_manager

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        return self._cache_desc

    @property
    def per_device_tensor_addrs(self) -> List[List[int]]:
        return self._per_device_tensor_addrs

    def __repr__(self) -> str:
        return f"KvCache(cache_id = {self._cache_id}, num_devices = {len(self._per_device_tensor_addrs)})"

    __str__ = __repr__

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: List[Any]) -> "KvCache":
        """A host cache from int addresses: ``addrs`` holds one address per tensor, or one
        such list per device.  Checked as CANN checks it (HOST placement, one address per
        tensor, one kind of entry); ``cache_id`` is -1."""
        _check_type("cache_desc", cache_desc, CacheDesc)
        if cache_desc.placement != Placement.HOST:
            raise ParamInvalidError(f"cache_desc.placement must be Placement.HOST, got {cache_desc.placement!r}")
        _check_type("addrs", addrs, list)
        if not addrs:
            raise ParamInvalidError("addrs is empty; give one address per tensor (or a list of them per device)")
        nested = isinstance(addrs[0], list)
        for i, entry in enumerate(addrs):
            _check_cpu_entry(i, entry, nested, cache_desc.num_tensors)
        if not nested and len(addrs) != cache_desc.num_tensors:
            raise ParamInvalidError(f"addrs has {len(addrs)} addresses, cache_desc.num_tensors is "
                                    f"{cache_desc.num_tensors}")
        return cls(-1, cache_desc, addrs if nested else [addrs])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_cpu_entry(i: int, entry: object, nested: bool, num_tensors: int) -> None:
    """``addrs[i]`` of :meth:`KvCache.create_cpu_cache`: of the kind of ``addrs[0]`` (a list
    of ``num_tensors`` int addresses when ``nested``, else an int)."""
    if not (isinstance(entry, list) if nested else _is_int(entry)):
        raise TypeError(f"addrs[{i}] must be {'a list of int' if nested else 'an int'} like addrs[0], "
                        f"got {type(entry).__name__}")
    if isinstance(entry, list) and (len(entry) != num_tensors or not all(_is_int(a) for a in entry)):
        raise ParamInvalidError(f"addrs[{i}] must hold {num_tensors} int addresses "
                                "(cache_desc.num_tensors)")
