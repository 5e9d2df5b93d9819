"""Validation and plan building of block and row transfers: check a transfer's blocks,
rows and layer ranges against the geometry of both caches (:class:`Side`), then build one
coalesced :class:`~datadist.engine.layout.Plan`.  Used by prepared transfers
(:mod:`.prepared`) once the link knows the peer's cache, and by the API's layer-wise
calls.  Invalid values fail with ``PARAM_INVALID`` (the contract's ``LLM_PARAM_INVALID``),
wrong types with ``TypeError``; messages name the argument and its value.
"""
from __future__ import annotations

import operator
from typing import Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import NDArray

from . import native
from .errors import Fault, fail
from .layout import Plan, U64Array, block_offsets, layer_tensor_indices, plan_units
from .transports.base import RemoteCache

#: Block indices as callers give them: a list, tuple or range of ints, or an int array.
BlockList = Union[Sequence[int], NDArray[np.integer]]
#: Tensor indices of one side of a transfer.
TensorIndices = NDArray[np.int64]
#: Largest ``tensor_num_per_layer`` (a uint32, as CANN takes it).
_UINT32_MAX = 2**32 - 1

__all__ = ["BlockList", "Side", "int_arg", "tensors_per_layer", "layer_range_arg", "block_list_arg",
           "check_nonempty", "selection", "same_dtype", "same_stride", "blocks_plan", "row_plan",
           "row_blocks_plan", "row_size_arg"]


class Side:
    """Geometry of one side of a transfer: tensor addresses, row stride, the memory the
    tensors are in ("cpu" or "cuda:N") and the element type ("" where unknown: raw peer
    addresses, which are bytes)."""

    __slots__ = ("addrs", "num_tensors", "tensor_size", "batch_size", "device", "dtype")

    def __init__(self, addrs: U64Array, num_tensors: int, tensor_size: int, batch_size: int,
                 device: str = "cpu", dtype: str = "") -> None:
        self.addrs, self.num_tensors, self.tensor_size, self.batch_size = addrs, num_tensors, tensor_size, batch_size
        self.device, self.dtype = device, dtype

    @property
    def stride(self) -> int:
        return self.tensor_size // self.batch_size

    @classmethod
    def of_remote(cls, r: RemoteCache) -> "Side":
        return cls(r.addrs, r.num_tensors, r.tensor_size, r.batch_size, r.device, r.dtype)


# ------------------------------------------------------------------------- validation

def int_arg(name: str, value: object) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return operator.index(value)


def tensors_per_layer(value: object, num_tensors: int, ranges: bool) -> int:
    """``tensor_num_per_layer``, checked as CANN does: any N > 0 (a uint32); only with layer
    ranges does N matter, and then it must be at most, and divide, the cache's tensors."""
    n = int_arg("tensor_num_per_layer", value)
    if n < 0:
        raise ValueError(f"tensor_num_per_layer = {n} must not be negative")
    if n == 0 or n > _UINT32_MAX or (ranges and (n > num_tensors or num_tensors % n)):
        fail(Fault.PARAM_INVALID,
             f"tensor_num_per_layer = {n} is invalid: it must be > 0"
             + (f", at most and dividing the cache's {num_tensors} tensors when layer ranges are given"
                if ranges else ""))
    return n


def layer_range_arg(name: str, value: object, num_layers: int) -> range:
    if value is None:
        return range(0, num_layers)
    if not isinstance(value, range):
        raise TypeError(f"{name} must be a range or None, got {type(value).__name__}")
    if value.step != 1 or not 0 <= value.start < value.stop <= num_layers:
        fail(Fault.PARAM_INVALID,
             f"{name} = {value} is invalid: step must be 1 and 0 <= start < stop <= {num_layers} layers")
    return value


def block_list_arg(name: str, value: object, num_blocks: int) -> NDArray[np.integer]:
    if not isinstance(value, (list, tuple, range, np.ndarray)):
        raise TypeError(f"{name} must be a list of block indices, got {type(value).__name__}")
    try:
        fast = native.index_array(value)  # lists and tuples: one C pass, with min and max
    except (TypeError, OverflowError) as exc:
        raise TypeError(f"{name} must be a flat list of ints: {exc}") from None
    if fast is not None:
        arr, lo, hi = fast
    else:
        arr = np.asarray(value)
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a flat list of ints, got {value!r:.80}")
        lo, hi = int(arr.min()), int(arr.max())
    if arr.shape[0] and (lo < 0 or hi >= num_blocks):
        fail(Fault.PARAM_INVALID,
             f"{name} holds index {lo if lo < 0 else hi}, outside [0, {num_blocks}) blocks")
    return arr


def check_nonempty(name: str, value: object) -> None:
    """CANN refuses empty block lists on pull_blocks/push_blocks (an empty transfer is a bug
    in the caller's bookkeeping, not a no-op)."""
    if isinstance(value, (list, tuple, range, np.ndarray)) and len(value) == 0:
        fail(Fault.PARAM_INVALID, f"{name} = {value!r} is empty; give at least one block index")


def selection(src: Side, dst: Side, tnpl: int, src_range: Optional[range], dst_range: Optional[range],
              same_range: bool = False) -> Tuple[TensorIndices, TensorIndices]:
    """Tensor indices of both sides for the layer ranges (validated)."""
    ranges = src_range is not None or dst_range is not None
    n = tensors_per_layer(tnpl, src.num_tensors, ranges)
    if not ranges:
        if src.num_tensors != dst.num_tensors:
            fail(Fault.PARAM_INVALID,
                 f"source has {src.num_tensors} tensors, destination {dst.num_tensors}; give layer ranges")
        every = np.arange(src.num_tensors)
        return every, every
    if dst.num_tensors % n:
        fail(Fault.PARAM_INVALID,
             f"tensor_num_per_layer = {n} does not divide the destination's {dst.num_tensors} tensors")
    sr = layer_range_arg("src_layer_range", src_range, src.num_tensors // n)
    dr = layer_range_arg("dst_layer_range", dst_range, dst.num_tensors // n)
    if len(sr) != len(dr):
        fail(Fault.PARAM_INVALID,
             f"src_layer_range {sr} and dst_layer_range {dr} differ in length")
    if same_range and sr != dr:
        fail(Fault.PARAM_INVALID,
             f"a push needs the same layer range on both sides, got src_layer_range={sr} and dst_layer_range={dr}")
    return layer_tensor_indices(sr, n), layer_tensor_indices(dr, n)


def same_dtype(src: Side, dst: Side) -> None:
    """Bytes of one element type never land in a cache of another (a uint8 row is not an
    fp16 row of the same size); raw peer addresses carry no type and are exempt."""
    if src.dtype and dst.dtype and src.dtype != dst.dtype:
        fail(Fault.PARAM_INVALID,
             f"source cache holds {src.dtype}, destination {dst.dtype}; both sides must have one data type")


def same_stride(src: Side, dst: Side, what: str) -> int:
    same_dtype(src, dst)
    if src.stride != dst.stride:
        fail(Fault.PARAM_INVALID,
             f"{what}: source {what} is {src.stride} bytes per tensor, destination {dst.stride}")
    return src.stride


def blocks_plan(src: Side, dst: Side, src_blocks: BlockList, dst_blocks: BlockList, tnpl: int,
                src_range: Optional[range], dst_range: Optional[range], same_range: bool = False) -> Plan:
    sb = block_list_arg("src_blocks", src_blocks, src.batch_size)
    db = block_list_arg("dst_blocks", dst_blocks, dst.batch_size)
    if sb.shape != db.shape:
        fail(Fault.PARAM_INVALID,
             f"src_blocks has {sb.shape[0]} entries, dst_blocks {db.shape[0]}; they must be equal")
    ts, td = selection(src, dst, tnpl, src_range, dst_range, same_range)
    stride = same_stride(src, dst, "block size")
    return plan_units(src.addrs[ts], block_offsets(sb, stride), dst.addrs[td], block_offsets(db, stride),
                      stride).on(src.device, dst.device)


def row_plan(src: Side, src_row: int, dst: Side, dst_row: int, size: int, offset: int, tnpl: int,
             src_range: Optional[range], dst_range: Optional[range], same_range: bool = False) -> Plan:
    same_dtype(src, dst)
    ts, td = selection(src, dst, tnpl, src_range, dst_range, same_range)
    return plan_units(src.addrs[ts], [src_row * src.stride + offset], dst.addrs[td],
                      [dst_row * dst.stride + offset], size).on(src.device, dst.device)


def row_blocks_plan(src: Side, src_row: int, dst: Side, dst_blocks: BlockList, tnpl: int,
                    src_range: Optional[range], dst_range: Optional[range]) -> Plan:
    """Chunk i of row ``src_row`` (chunks of one destination block) -> ``dst_blocks[i]``."""
    same_dtype(src, dst)
    db = block_list_arg("dst_blocks", dst_blocks, dst.batch_size)
    chunk = dst.stride
    if db.shape[0] * chunk > src.stride:
        fail(Fault.PARAM_INVALID,
             f"{db.shape[0]} blocks of {chunk} bytes exceed the source row of {src.stride} bytes")
    ts, td = selection(src, dst, tnpl, src_range, dst_range)
    src_offs = block_offsets(np.arange(db.shape[0]), chunk, src_row * src.stride)
    return plan_units(src.addrs[ts], src_offs, dst.addrs[td], block_offsets(db, chunk), chunk).on(src.device,
                                                                                                     dst.device)


def row_size_arg(size: object, src: Side, dst: Side, offset: int = 0) -> int:
    n = int_arg("size", size)
    limit = min(src.stride, dst.stride) - offset
    if n == -1:
        if src.stride != dst.stride:
            fail(Fault.PARAM_INVALID,
                 f"rows differ in size ({src.stride} vs {dst.stride} bytes per tensor); pass size")
        return limit
    if not 0 < n <= limit:
        fail(Fault.PARAM_INVALID, f"size = {n} is invalid: must be -1 or in (0, {limit}] bytes")
    return n
