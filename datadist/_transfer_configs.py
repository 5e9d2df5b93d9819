"""The destinations of ``CacheManager.transfer_cache_async``: :class:`TransferConfig` (raw
peer addresses) and :class:`TransferWithCacheKeyConfig` (a peer cache by key).

As in CANN, both are mutable: every constructor argument is also a property with a setter
that checks the new value as the constructor does (``TypeError`` for a wrong type,
:class:`~datadist._status.ParamInvalidError` for an out-of-domain value; the config is
unchanged then).  Equality is therefore identity, as in CANN.  A task reads its configs
when ``transfer_cache_async`` is called: changing a config afterwards does not change a
running task.  Checks that relate several fields (equal layer ranges of a push, a row with
a ``BlocksCacheKey``) are made by the constructor and again when a task starts.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

from ._objects import _UINT32_MAX, _UINT64_MAX, BlocksCacheKey, CacheKeyByIdAndIndex, _check_type, _int_in
from ._status import ParamInvalidError

__all__ = ["TransferConfig", "TransferWithCacheKeyConfig"]

#: What names the peer cache of a :class:`TransferWithCacheKeyConfig`.
PeerCacheKey = Union[BlocksCacheKey, CacheKeyByIdAndIndex]


def range_arg(name: str, value: object, alternatives: str = "") -> range:
    """``value`` checked as a layer range: a ``range`` of step 1 with ``0 <= start < stop``."""
    if not isinstance(value, range):
        raise TypeError(f"{name} must be a range{alternatives}, got {type(value).__name__}")
    if value.step != 1 or not 0 <= value.start < value.stop:
        raise ParamInvalidError(f"{name} = {value} is invalid: step must be 1 and 0 <= start < stop")
    return value


def optional_range_arg(name: str, value: object) -> Optional[range]:
    """:func:`range_arg`, or None."""
    return None if value is None else range_arg(name, value, " or None")


def _dst_addrs_arg(dst_addrs: object) -> tuple[int, ...]:
    _check_type("dst_addrs", dst_addrs, (list, tuple))
    assert isinstance(dst_addrs, (list, tuple))
    if not dst_addrs:
        raise ParamInvalidError("dst_addrs is empty: give one address per destination tensor")
    return tuple(_int_in(f"dst_addrs[{i}]", a, 1, _UINT64_MAX) for i, a in enumerate(dst_addrs))


def _row_with_key(key: PeerCacheKey, row: int) -> None:
    if isinstance(key, BlocksCacheKey) and row:
        raise ParamInvalidError(f"src_batch_index = {row} with a BlocksCacheKey; it must be 0")


class _Config:
    """``repr`` from ``_fields``; equality is identity (the configs are mutable).  The two
    layer ranges, each a checked range or None, that both configs have."""

    __slots__ = ("_src_layer_range", "_dst_layer_range")
    _fields: tuple[str, ...] = ()

    def __repr__(self) -> str:
        args = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)
        return f"{type(self).__name__}({args})"

    @property
    def src_layer_range(self) -> Optional[range]:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: Optional[range]) -> None:
        self._src_layer_range = optional_range_arg("src_layer_range", value)

    @property
    def dst_layer_range(self) -> Optional[range]:
        """The destination layers (a :class:`TransferConfig` keeps CANN's attribute, None
        unless set, and does not use it: its addresses name the destination)."""
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, value: Optional[range]) -> None:
        self._dst_layer_range = optional_range_arg("dst_layer_range", value)


class TransferConfig(_Config):
    """Push to raw addresses of cluster ``dst_cluster_id``.

    ``dst_addrs``: one address per destination tensor of the layers sent (2 per layer: K, V),
    in the peer's address space.  Into a contiguous destination they point at the
    destination row (offset to it by the caller, as in CANN); into a blocks destination
    (``dst_block_indices`` given to ``transfer_cache_async``) at block 0 of each tensor.
    ``src_layer_range``: the source layers to send (None: all); ``src_batch_index``: the
    source row when the source is contiguous.  ``dst_layer_range`` (CANN's attribute,
    None unless set) is kept, not used: the addresses name the destination.

    Every field has a checking setter.  Raises ``TypeError`` for a wrong type and
    :class:`ParamInvalidError` (a ``ValueError`` and an ``LLMException(LLM_PARAM_INVALID)``)
    for an out-of-domain value or range.
    """

    __slots__ = ("_dst_cluster_id", "_dst_addrs", "_src_batch_index")
    _fields = ("dst_cluster_id", "dst_addrs", "src_layer_range", "src_batch_index")

    def __init__(self, dst_cluster_id: int, dst_addrs: Sequence[int], src_layer_range: Optional[range] = None,
                 src_batch_index: int = 0):
        self._dst_cluster_id = _int_in("dst_cluster_id", dst_cluster_id, 0, _UINT64_MAX)
        self._dst_addrs = _dst_addrs_arg(dst_addrs)
        self._src_layer_range = optional_range_arg("src_layer_range", src_layer_range)
        self._src_batch_index = _int_in("src_batch_index", src_batch_index, 0, _UINT32_MAX)
        self._dst_layer_range = None

    @property
    def dst_cluster_id(self) -> int:
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, value: int) -> None:
        self._dst_cluster_id = _int_in("dst_cluster_id", value, 0, _UINT64_MAX)

    @property
    def dst_addrs(self) -> List[int]:
        """The destination addresses (a new list each time: set the property to change them)."""
        return list(self._dst_addrs)

    @dst_addrs.setter
    def dst_addrs(self, value: Sequence[int]) -> None:
        self._dst_addrs = _dst_addrs_arg(value)

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        self._src_batch_index = _int_in("src_batch_index", value, 0, _UINT32_MAX)


class TransferWithCacheKeyConfig(_Config):
    """Push into the peer cache that ``cache_key`` names (a ``BlocksCacheKey`` or a
    ``CacheKeyByIdAndIndex``, whose ``batch_index`` is the destination row of a contiguous
    cache), like ``push_blocks``/``push_cache``; ``dst_cluster_id`` is the key's cluster.

    Source layers ``src_layer_range`` go to destination layers ``dst_layer_range``, which must
    be the same range (as for every push).  Set to None (CANN allows it), the source range
    means every layer and the destination range the source's.  ``src_batch_index``: the
    source row when the source is contiguous; 0 with a ``BlocksCacheKey``.

    Every field but ``dst_cluster_id`` has a checking setter.  Raises ``TypeError`` for a
    wrong type and :class:`ParamInvalidError` for an invalid or unequal range or a row with
    a ``BlocksCacheKey`` (unequal ranges set one by one: when a task starts).
    """

    __slots__ = ("_cache_key", "_src_batch_index")
    _fields = ("cache_key", "src_layer_range", "dst_layer_range", "src_batch_index")

    def __init__(self, cache_key: Union[BlocksCacheKey, CacheKeyByIdAndIndex], src_layer_range: range,
                 dst_layer_range: range, src_batch_index: int = 0):
        _check_type("cache_key", cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex))
        self._cache_key = cache_key
        self._src_layer_range = range_arg("src_layer_range", src_layer_range)
        self._dst_layer_range = range_arg("dst_layer_range", dst_layer_range)
        if src_layer_range != dst_layer_range:
            raise ParamInvalidError(f"a push needs the same layer range on both sides, got "
                                    f"src_layer_range={src_layer_range} and dst_layer_range={dst_layer_range}")
        self._src_batch_index = _int_in("src_batch_index", src_batch_index, 0, _UINT32_MAX)
        _row_with_key(cache_key, self._src_batch_index)

    @property
    def cache_key(self) -> PeerCacheKey:
        return self._cache_key

    @cache_key.setter
    def cache_key(self, value: PeerCacheKey) -> None:
        _check_type("cache_key", value, (BlocksCacheKey, CacheKeyByIdAndIndex))
        _row_with_key(value, self._src_batch_index)
        self._cache_key = value

    @property
    def dst_cluster_id(self) -> int:
        """The cluster the push goes to: ``cache_key.cluster_id`` (CANN's attribute)."""
        return self._cache_key.cluster_id

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        row = _int_in("src_batch_index", value, 0, _UINT32_MAX)
        _row_with_key(self._cache_key, row)
        self._src_batch_index = row


def check_push_ranges(name: str, config: Any, src_layers: range) -> None:
    """The destination layers of ``config`` (a :class:`TransferWithCacheKeyConfig` whose
    source layers resolved to ``src_layers``) are the same range, or None."""
    dst = config.dst_layer_range
    if dst is not None and dst != src_layers:
        raise ParamInvalidError(f"{name}: a push needs the same layer range on both sides, got "
                                f"src_layer_range={src_layers} and dst_layer_range={dst}")
