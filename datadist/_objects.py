"""Value objects of the public API (SPEC-datadist section 3): cache descriptions, caches,
cache keys, memory info, and the checks they share (cluster info and IP addresses:
:mod:`datadist._cluster`).

Validation follows ``llm_datadist``: a wrong Python type is a ``TypeError``; an
out-of-domain value is a :class:`~datadist._status.ParamInvalidError` (both a
``ValueError`` and an ``LLMException(LLM_PARAM_INVALID)``).

Keys are immutable values (equality, hash, ``repr`` that reads back as the constructor
call). A :class:`CacheDesc` is a value too, but, as in CANN, ``update_dim`` changes one
dim of its shape: its hash leaves the dims' values out (so it never changes and equal
descs still hash alike) and a :class:`Cache` keeps a copy of the desc it was made with.
A :class:`Cache` is an entity made by the cache manager: equality is identity.
"""
from __future__ import annotations

import itertools
import operator
import sys
import threading
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Type, Union

from ._status import ParamInvalidError
from ._types import DataType, Memtype, Placement

if TYPE_CHECKING:
    import torch

__all__ = [
    "CacheDesc",
    "Cache",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "BlocksCacheKey",
    "MemInfo",
    "INVALID_ID",
    "as_tensor_addrs",
]

INVALID_ID = 2**64 - 1
"""``req_id``/``prefix_id`` meaning "none" (``CacheKey.prefix_id`` default; a row whose
``req_id`` is this value is empty)."""

_UINT16_MAX = 2**16 - 1
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# ----------------------------------------------------------------------------- checks


def _as_int(name: str, value: Any) -> int:
    """``value`` as a Python int: ints and int-likes (numpy integers) pass, bools and
    everything else are a ``TypeError``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _int_in(name: str, value: Any, lo: int, hi: int) -> int:
    result = _as_int(name, value)
    if not lo <= result <= hi:
        raise ParamInvalidError(f"{name} = {result} is out of range [{lo}, {hi}]")
    return result


def _check_type(name: str, value: Any, cls: Union[type, Tuple[type, ...]]) -> None:
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise TypeError(f"{name} must be {names}, got {type(value).__name__}")


# --------------------------------------------------------------------- value objects


class _Value:
    """Equality, hash and ``repr`` from ``_fields`` (read through the public properties)."""

    __slots__ = ()
    _fields: Tuple[str, ...] = ()

    def _values(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, f) for f in self._fields)

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._values() == other._values()
        return NotImplemented

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._values()))

    def __repr__(self) -> str:
        args = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)
        return f"{type(self).__name__}({args})"


class CacheDesc(_Value):
    """Shape of a cache: ``num_tensors`` tensors of ``shape`` and ``data_type`` each.

    Args:
        num_tensors: tensors in the cache, >= 1 (K and V of every layer: ``2 * layers``).
        shape: dims of ONE tensor, all > 0 (list or tuple of ints).
        data_type: element type.
        placement: ``Placement.DEVICE`` (accelerator; host memory on a CPU-only engine)
            or ``Placement.HOST``.
        batch_dim_index: the batch (row; for a blocks cache, block) dim, in ``[0, len(shape))``.
        seq_len_dim_index: the sequence dim, ``-1`` (unknown) or in ``[0, len(shape))``.
        kv_tensor_format: optional layout name, kept as given.

    Raises:
        TypeError: an argument of the wrong type.
        ParamInvalidError: ``num_tensors < 1``, an empty shape, a dim <= 0, a dim index
            out of range, a ``data_type`` without an element size (``DT_STRING``).

    Equality compares every field; :meth:`update_dim` changes a dim in place (as in
    CANN), so the hash covers every field but the dims' values.  A cache made from the
    desc keeps the shape it was made with (:attr:`Cache.cache_desc` is a copy).
    """

    __slots__ = ("_num_tensors", "_shape", "_data_type", "_placement", "_batch_dim_index",
                 "_seq_len_dim_index", "_kv_tensor_format")
    _fields = ("num_tensors", "shape", "data_type", "placement", "batch_dim_index",
               "seq_len_dim_index", "kv_tensor_format")

    def __init__(self,
                 num_tensors: int,
                 shape: Union[Sequence[int], Tuple[int, ...]],
                 data_type: DataType,
                 placement: Placement = Placement.DEVICE,
                 batch_dim_index: int = 0,
                 seq_len_dim_index: int = -1,
                 kv_tensor_format: Optional[str] = None):
        num_tensors = _as_int("num_tensors", num_tensors)
        _check_type("shape", shape, (list, tuple))
        dims = tuple(_as_int(f"shape[{i}]", d) for i, d in enumerate(shape))
        _check_type("data_type", data_type, DataType)
        if not data_type.has_element_size:
            raise ParamInvalidError(f"data_type = {data_type.name} has no element size; a cache tensor "
                                    "needs a fixed-size element type")
        _check_type("placement", placement, Placement)
        batch_dim_index = _as_int("batch_dim_index", batch_dim_index)
        seq_len_dim_index = _as_int("seq_len_dim_index", seq_len_dim_index)
        if kv_tensor_format is not None:
            _check_type("kv_tensor_format", kv_tensor_format, str)

        if not 1 <= num_tensors <= _UINT32_MAX:
            raise ParamInvalidError(f"num_tensors = {num_tensors} is invalid, must be in [1, {_UINT32_MAX}]")
        if not dims:
            raise ParamInvalidError("shape = [] is invalid, a cache tensor needs at least one dim")
        if any(d <= 0 or d > _INT64_MAX for d in dims):
            raise ParamInvalidError(f"shape = {list(dims)} is invalid, every dim must be > 0")
        if not 0 <= batch_dim_index < len(dims):
            raise ParamInvalidError(
                f"batch_dim_index = {batch_dim_index} is out of range [0, {len(dims)}) for shape {list(dims)}")
        if seq_len_dim_index != -1 and not 0 <= seq_len_dim_index < len(dims):
            raise ParamInvalidError(
                f"seq_len_dim_index = {seq_len_dim_index} is invalid, must be -1 or in [0, {len(dims)}) "
                f"for shape {list(dims)}")
        _check_tensor_bytes(dims, data_type)

        self._num_tensors = num_tensors
        self._shape = dims
        self._data_type = data_type
        self._placement = placement
        self._batch_dim_index = batch_dim_index
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format

    def _values(self) -> Tuple[Any, ...]:
        return (self._num_tensors, self._shape, self._data_type, self._placement, self._batch_dim_index,
                self._seq_len_dim_index, self._kv_tensor_format)

    def __hash__(self) -> int:
        # Every field but the dims' values, which update_dim changes: the hash of a desc
        # never changes, and descs that are equal (all fields) hash alike.
        return hash((type(self).__name__, self._num_tensors, len(self._shape), self._data_type, self._placement,
                     self._batch_dim_index, self._seq_len_dim_index, self._kv_tensor_format))

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set dim ``dim_index`` of :attr:`shape` to ``dim_value``, in place (CANN's call).

        ``dim_index`` indexes the shape as a Python list does (``-1``: the last dim);
        ``dim_value`` must be > 0.  :attr:`size` and :attr:`batch_size` follow the new
        shape.  Caches already made from this desc keep their shape.

        Raises:
            TypeError: a non-int argument.
            ParamInvalidError: ``dim_index`` outside the shape, ``dim_value <= 0``, or a
                tensor that would be too large; the desc is unchanged then.
        """
        index = _as_int("dim_index", dim_index)
        value = _as_int("dim_value", dim_value)
        n = len(self._shape)
        if not -n <= index < n:
            raise ParamInvalidError(f"dim_index = {index} is out of range [{-n}, {n}) for shape {list(self._shape)}")
        if not 0 < value <= _INT64_MAX:
            raise ParamInvalidError(f"dim_value = {value} is invalid, every dim must be > 0")
        dims = list(self._shape)
        dims[index] = value
        _check_tensor_bytes(dims, self._data_type)
        self._shape = tuple(dims)

    def _copy(self) -> "CacheDesc":
        """An equal desc that shares no mutable state with this one (no re-validation)."""
        clone = object.__new__(CacheDesc)
        for slot in CacheDesc.__slots__:
            object.__setattr__(clone, slot, getattr(self, slot))
        return clone

    @property
    def num_tensors(self) -> int:
        return self._num_tensors

    @property
    def shape(self) -> List[int]:
        """Dims of one tensor (a new list each time: change a dim with :meth:`update_dim`)."""
        return list(self._shape)

    @property
    def data_type(self) -> DataType:
        return self._data_type

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def batch_dim_index(self) -> int:
        return self._batch_dim_index

    @property
    def batch_dim(self) -> int:
        """Alias of :attr:`batch_dim_index` (``llm_datadist`` spelling)."""
        return self._batch_dim_index

    @property
    def seq_len_dim_index(self) -> int:
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> Optional[str]:
        return self._kv_tensor_format

    @property
    def batch_size(self) -> int:
        """``shape[batch_dim_index]``: rows of the cache (blocks of a blocks cache)."""
        return self._shape[self._batch_dim_index]

    @property
    def numel(self) -> int:
        """Elements of ONE tensor."""
        n = 1
        for d in self._shape:
            n *= d
        return n

    @property
    def size(self) -> int:
        """Bytes of ONE tensor."""
        return self.numel * self._data_type.element_size


def _check_tensor_bytes(dims: Sequence[int], data_type: DataType) -> None:
    numel = 1
    for d in dims:
        numel *= d
    if numel * data_type.element_size > _INT64_MAX:
        raise ParamInvalidError(f"shape = {list(dims)} of {data_type.name} is too large for one tensor")


class CacheKey(_Value):
    """A row of an allocated cache on its owner: ``(prompt_cluster_id, req_id, model_id,
    prefix_id)``. ``req_id == INVALID_ID`` marks an empty row.

    ``cluster_id=`` is accepted in place of ``prompt_cluster_id=`` (``llm_datadist``
    accepts both). All ids are uint64: ``TypeError`` for a non-int,
    :class:`ParamInvalidError` out of range.  As in CANN, a missing cluster id or
    ``req_id``, or more than 4 arguments, is :class:`ParamInvalidError` too.
    """

    __slots__ = ("_prompt_cluster_id", "_req_id", "_model_id", "_prefix_id")
    _fields = ("prompt_cluster_id", "req_id", "model_id", "prefix_id")

    def __init__(self, prompt_cluster_id: Optional[int] = None, req_id: Optional[int] = None,
                 model_id: int = 0, prefix_id: int = INVALID_ID, *extra: object, cluster_id: Optional[int] = None):
        _no_extra("CacheKey", 4, extra)
        prompt_cluster_id = _one_cluster_id("CacheKey", prompt_cluster_id, cluster_id)
        if req_id is None:
            raise ParamInvalidError("CacheKey: Param req_id is required (CacheKey(cluster_id, req_id, ...))")
        self._prompt_cluster_id = _int_in("prompt_cluster_id", prompt_cluster_id, 0, _UINT64_MAX)
        self._req_id = _int_in("req_id", req_id, 0, _UINT64_MAX)
        self._model_id = _int_in("model_id", model_id, 0, _UINT64_MAX)
        self._prefix_id = _int_in("prefix_id", prefix_id, 0, _UINT64_MAX)

    @property
    def prompt_cluster_id(self) -> int:
        return self._prompt_cluster_id

    @property
    def cluster_id(self) -> int:
        """Alias of :attr:`prompt_cluster_id`."""
        return self._prompt_cluster_id

    @property
    def req_id(self) -> int:
        return self._req_id

    @property
    def model_id(self) -> int:
        return self._model_id

    @property
    def prefix_id(self) -> int:
        return self._prefix_id


class CacheKeyByIdAndIndex(_Value):
    """A remote cache by owner cluster, cache id and row (``batch_index``).

    ``cluster_id`` uint64, ``cache_id`` int64, ``batch_index`` uint32.
    """

    __slots__ = ("_cluster_id", "_cache_id", "_batch_index")
    _fields = ("cluster_id", "cache_id", "batch_index")

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0):
        self._cluster_id = _int_in("cluster_id", cluster_id, 0, _UINT64_MAX)
        self._cache_id = _int_in("cache_id", cache_id, _INT64_MIN, _INT64_MAX)
        self._batch_index = _int_in("batch_index", batch_index, 0, _UINT32_MAX)

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def batch_index(self) -> int:
        return self._batch_index


class BlocksCacheKey(_Value):
    """A remote blocks cache (paged KV) by owner cluster and model id; ``cluster_id=`` is
    accepted in place of ``prompt_cluster_id=``. Both uint64.  As in CANN, a missing
    cluster id or more than 2 arguments is :class:`ParamInvalidError`."""

    __slots__ = ("_prompt_cluster_id", "_model_id")
    _fields = ("prompt_cluster_id", "model_id")

    def __init__(self, prompt_cluster_id: Optional[int] = None, model_id: int = 0, *extra: object,
                 cluster_id: Optional[int] = None):
        _no_extra("BlocksCacheKey", 2, extra)
        prompt_cluster_id = _one_cluster_id("BlocksCacheKey", prompt_cluster_id, cluster_id)
        self._prompt_cluster_id = _int_in("prompt_cluster_id", prompt_cluster_id, 0, _UINT64_MAX)
        self._model_id = _int_in("model_id", model_id, 0, _UINT64_MAX)

    @property
    def prompt_cluster_id(self) -> int:
        return self._prompt_cluster_id

    @property
    def cluster_id(self) -> int:
        """Alias of :attr:`prompt_cluster_id`."""
        return self._prompt_cluster_id

    @property
    def model_id(self) -> int:
        return self._model_id


def _one_cluster_id(owner: str, prompt_cluster_id: Optional[int], cluster_id: Optional[int]) -> int:
    if prompt_cluster_id is not None and cluster_id is not None:
        raise TypeError(f"{owner}() got both prompt_cluster_id and cluster_id; pass one")
    value = prompt_cluster_id if prompt_cluster_id is not None else cluster_id
    if value is None:
        raise ParamInvalidError(f"{owner}: Param prompt_cluster_id or cluster_id is required")
    return value


def _no_extra(owner: str, most: int, extra: Tuple[object, ...]) -> None:
    """CANN's arity check: positional arguments past the ``most`` a key takes."""
    if extra:
        raise ParamInvalidError(f"{owner}: Param num is over limit ({most + len(extra)} arguments, "
                                f"at most {most})")


class MemInfo(_Value):
    """A memory range: ``mem_type`` (:class:`Memtype`), ``addr`` and ``size`` in bytes
    (both uint64)."""

    __slots__ = ("_mem_type", "_addr", "_size")
    _fields = ("mem_type", "addr", "size")

    def __init__(self, mem_type: Memtype, addr: int, size: int):
        _check_type("mem_type", mem_type, Memtype)
        self._mem_type = mem_type
        self._addr = _int_in("addr", addr, 0, _UINT64_MAX)
        self._size = _int_in("size", size, 0, _UINT64_MAX)

    @property
    def mem_type(self) -> Memtype:
        return self._mem_type

    @property
    def addr(self) -> int:
        return self._addr

    @property
    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type!r}, addr={self._addr:#x}, size={self._size})"


# ---------------------------------------------------------------------------- caches


def _torch_tensor_type() -> Optional[Type[torch.Tensor]]:
    # Only look at torch if the caller has loaded it: a tensor argument implies it is.
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None)


def as_tensor_addrs(addrs: Sequence[Any], cache_desc: CacheDesc, *,
                    name: str = "addrs") -> Tuple[List[int], Tuple[Any, ...]]:
    """Validate the per-tensor addresses of a cache of ``cache_desc``.

    ``addrs`` is a list or tuple of ``cache_desc.num_tensors`` entries, each an int address
    (as ``tensor.data_ptr()`` gives) or a contiguous torch tensor of at least
    ``cache_desc.size`` bytes.

    Returns:
        ``(addresses, tensors)``: the int addresses, and the tensors among ``addrs``, which
        the caller keeps referenced for as long as it uses the addresses.

    Raises:
        TypeError: ``addrs`` is not a list/tuple, or an entry is neither int nor tensor.
        ParamInvalidError: wrong count, an address outside ``(0, 2**64)``, a tensor that is
            not contiguous or smaller than one cache tensor.
    """
    _check_type(name, addrs, (list, tuple))
    if len(addrs) != cache_desc.num_tensors:
        raise ParamInvalidError(
            f"{name} has {len(addrs)} entries, cache_desc.num_tensors is {cache_desc.num_tensors}")
    tensor_type = _torch_tensor_type()
    result: List[int] = []
    tensors: List[Any] = []
    for i, entry in enumerate(addrs):
        if tensor_type is not None and isinstance(entry, tensor_type):
            nbytes = entry.numel() * entry.element_size()
            if not entry.is_contiguous():
                raise ParamInvalidError(f"{name}[{i}] is a non-contiguous tensor")
            if nbytes < cache_desc.size:
                raise ParamInvalidError(
                    f"{name}[{i}] is a tensor of {nbytes} bytes, one cache tensor needs {cache_desc.size}")
            addr = entry.data_ptr()
            tensors.append(entry)
        else:
            if isinstance(entry, bool) or not hasattr(entry, "__index__"):
                raise TypeError(f"{name}[{i}] must be an int address or a torch.Tensor, got {type(entry).__name__}")
            addr = operator.index(entry)
        if not 0 < addr <= _UINT64_MAX:
            raise ParamInvalidError(f"{name}[{i}] = {addr:#x} is not a valid address")
        result.append(addr)
    return result, tuple(tensors)


# Caches made by Cache.create_cpu_cache get ids -1, -2, ... from this process-wide counter;
# the cache manager numbers its caches from 1 up, so the two never collide.
_cpu_cache_ids = itertools.count(-1, -1)
_cpu_cache_ids_lock = threading.Lock()


class Cache:
    """A cache known to the cache manager: ``cache_desc.num_tensors`` tensors at
    ``tensor_addrs`` (this process's address space).

    Made by the manager (``allocate_*``/``register_*``) through the keyword-only
    constructor, never by users; :meth:`create_cpu_cache` wraps host memory for
    ``swap_blocks``. Equality is identity.

    Args (manager only):
        cache_id: the manager's id (>= 0), or a negative id from :meth:`create_cpu_cache`.
        cache_desc: the shape of the cache.
        tensor_addrs: one address per tensor.
        is_blocks_cache: whether ``batch_dim`` counts blocks (paged KV) rather than rows.
        is_registered: whether the memory is the user's (``register_*``) rather than pool memory.
        handle: the manager's private state for this cache (kept, never read here).
    """

    def __init__(self, *, cache_id: int, cache_desc: CacheDesc, tensor_addrs: Sequence[int],
                 is_blocks_cache: bool = False, is_registered: bool = False, handle: Any = None):
        _check_type("cache_desc", cache_desc, CacheDesc)
        self._cache_id = _int_in("cache_id", cache_id, _INT64_MIN, _INT64_MAX)
        self._cache_desc = cache_desc._copy()  # the shape the memory was made for, whatever update_dim does later
        self._tensor_addrs = tuple(_as_int("tensor_addrs[]", a) for a in tensor_addrs)
        if len(self._tensor_addrs) != cache_desc.num_tensors:
            raise ParamInvalidError(f"tensor_addrs has {len(self._tensor_addrs)} entries, "
                                    f"cache_desc.num_tensors is {cache_desc.num_tensors}")
        self._is_blocks_cache = bool(is_blocks_cache)
        self._is_registered = bool(is_registered)
        self._handle = handle

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: Sequence[Any]) -> "Cache":
        """Wrap host memory the caller owns as a blocks cache (the host side of
        ``swap_blocks``).

        Args:
            cache_desc: must have ``placement=Placement.HOST``.
            addrs: one entry per tensor: an int address or a contiguous CPU tensor (kept
                referenced by the returned cache).

        Returns:
            A Cache with a negative ``cache_id`` unique in this process (never a manager id).

        Raises:
            TypeError: ``cache_desc`` is not a CacheDesc, or a bad ``addrs`` entry type.
            ParamInvalidError: placement is not HOST, wrong number of addresses, an invalid
                address, or a tensor that is not on the CPU or too small.
        """
        _check_type("cache_desc", cache_desc, CacheDesc)
        if cache_desc.placement != Placement.HOST:
            raise ParamInvalidError(
                f"create_cpu_cache needs cache_desc.placement == Placement.HOST, got {cache_desc.placement!r}")
        tensor_addrs, tensors = as_tensor_addrs(addrs, cache_desc)
        for i, t in enumerate(tensors):
            if t.device.type != "cpu":
                raise ParamInvalidError(f"create_cpu_cache: addrs tensor {i} is on {t.device}, not the CPU")
        with _cpu_cache_ids_lock:
            cache_id = next(_cpu_cache_ids)
        return cls(cache_id=cache_id, cache_desc=cache_desc, tensor_addrs=tensor_addrs,
                   is_blocks_cache=True, is_registered=True, handle=tensors or None)

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """The desc the cache was made with (a copy each time, equal to the one given:
        ``update_dim`` on it, or on the desc given, does not change the cache)."""
        return self._cache_desc._copy()

    @property
    def tensor_addrs(self) -> List[int]:
        """One address per tensor (a new list each time)."""
        return list(self._tensor_addrs)

    @property
    def is_blocks_cache(self) -> bool:
        return self._is_blocks_cache

    @property
    def is_registered(self) -> bool:
        return self._is_registered

    def __repr__(self) -> str:
        addrs = ", ".join(f"{a:#x}" for a in self._tensor_addrs[:4])
        if len(self._tensor_addrs) > 4:
            addrs += f", ... ({len(self._tensor_addrs)} in all)"
        return (f"Cache(cache_id={self._cache_id}, cache_desc={self._cache_desc!r}, tensor_addrs=[{addrs}], "
                f"is_blocks_cache={self._is_blocks_cache})")
