"""The registered KV cache, and plans between it and pool values.

``kvcache[layer][kv]`` is a ``[blocks, block_size, heads, head_size]`` tensor; slot ``s``
is token row ``s`` of every tensor (block ``s // block_size``, position ``s % block_size``).
The tensors of one layer may differ in ``heads``, ``head_size`` and dtype, hence in row
bytes (an MLA layer registers its latent part and its rope part, e.g. 512 and 64 wide);
every layer repeats layer 0's tensors.  A value is laid out tensor after tensor
(layer-major, K then V; for the chunk form, layer group after layer group), each holding
its span's token rows in order.  Plans are built with the datadist block engine relative to a value at address 0
and rebased onto the value's place in the mapped arena; every byte moves through
``copy_plan`` (host tensors) or, for device tensors, the same plan on the torch executor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from datadist.engine import npu
from datadist.engine.executor import executor, torch_copy_plan
from datadist.engine.layout import Plan, coalesce, plan_units
from datadist.engine.native import copy_plan, copy_plan_sum

from ._errors import invalid
from .pool.checksum import BLOCK

__all__ = ["KvLayout", "ValuePlan", "buffers_plan", "HostCopier", "DeviceCopier", "Copier"]

_U64 = np.uint64


@dataclass
class ValuePlan:
    """How one key's value maps to memory: ``size`` bytes, plans with the value at 0
    on the destination side (a save); a load runs them swapped."""

    size: int
    plans: List[Plan]


def buffers_plan(addresses: Sequence[int], lengths: Sequence[int]) -> ValuePlan:
    """V0: the value is the buffers' bytes concatenated."""
    lens = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    return ValuePlan(int(lens.sum()), [coalesce(np.asarray(addresses, dtype=np.int64), starts, lens)])


def _layers_of(kvcache: Any) -> List[Sequence[Any]]:
    """``kvcache`` as a list of layers (a single 6-d tensor is split into them)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        raise invalid("kvcache", "needs torch") from None
    if isinstance(kvcache, torch.Tensor):
        if kvcache.dim() != 6:
            raise invalid("kvcache", "a single tensor must be [layers, kv, blocks, block_size, heads, head_size]")
        kvcache = [[kvcache[i][j] for j in range(kvcache.shape[1])] for i in range(kvcache.shape[0])]
    if not isinstance(kvcache, (list, tuple)) or not kvcache:
        raise invalid("kvcache", "must be a non-empty list (layers) of lists (K, V) of tensors")
    return list(kvcache)


def _kv_per_layer(kvcache: List[Sequence[Any]], kvcache_type: str) -> int:
    """Tensors per layer: 2 (K, V), or 1 or 2 for MLA; the same for every layer."""
    kv_counts = {len(layer) if isinstance(layer, (list, tuple)) else -1 for layer in kvcache}
    allowed = (1, 2) if kvcache_type == "MLA" else (2,)
    if len(kv_counts) != 1 or next(iter(kv_counts)) not in allowed:
        raise invalid("kvcache", f"every layer must be a list of {' or '.join(map(str, allowed))} "
                      f"tensors (kvcache_type {kvcache_type})")
    return len(kvcache[0])


def _check_tensors(tensors: List[Any], kvp: int) -> None:
    """Every entry a contiguous 4-d tensor ``[blocks, block_size, heads, head_size]``, all
    with layer 0's blocks, block size and device, each like its counterpart in layer 0."""
    import torch

    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise invalid("kvcache", f"entry {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.dim() != 4:
            raise invalid("kvcache", f"tensor {i} has shape {tuple(t.shape)}, expected "
                          "[blocks, block_size, heads, head_size]")
        if t.shape[:2] != first.shape[:2] or t.device != first.device:
            raise invalid("kvcache", f"tensor {i} differs from tensor 0 in blocks, block_size or device")
        model = tensors[i % kvp]  # the same tensor of layer 0
        if t.shape != model.shape or t.dtype != model.dtype:
            raise invalid("kvcache", f"tensor {i} (layer {i // kvp}, kv {i % kvp}) differs from "
                          f"layer 0's in shape or dtype")
        if not t.is_contiguous():
            raise invalid("kvcache", f"tensor {i} is not contiguous")


class KvLayout:
    """A validated, registered ``kvcache`` and its layer groups."""

    def __init__(self, kvcache: Any, store_layer_group_desc: Optional[Sequence[Sequence[int]]],
                 kvcache_type: str) -> None:
        layers = _layers_of(kvcache)
        kvp = _kv_per_layer(layers, kvcache_type)
        tensors = [t for layer in layers for t in layer]
        _check_tensors(tensors, kvp)
        first = tensors[0]
        blocks, block_size = (int(x) for x in first.shape[:2])
        if block_size <= 0 or blocks <= 0:
            raise invalid("kvcache", f"shape {tuple(first.shape)} has no slots")
        self.tensors = tensors  # keeps the memory alive while registered
        self.num_layers = len(layers)
        self.kv_per_layer = kvp
        self.block_size = block_size
        self.num_slots = blocks * block_size
        #: Bytes of one token row, per tensor.
        self.row_bytes = np.array([t[0, 0].numel() * t.element_size() for t in tensors], dtype=np.int64)
        self.device = first.device
        self.ptrs = np.array([t.data_ptr() for t in tensors], dtype=_U64)
        self.groups = self._groups(store_layer_group_desc)
        self._every = self._parts(np.arange(len(tensors), dtype=np.int64))
        self.copier = _copier_for(tensors)

    def _groups(self, desc: Optional[Sequence[Sequence[int]]]) -> List["_Parts"]:
        if desc is None:
            desc = [list(range(self.num_layers))]
        if not isinstance(desc, (list, tuple)) or not desc:
            raise invalid("store_layer_group_desc", "must be a non-empty list of layer-index lists")
        seen: Set[int] = set()
        groups = []
        for g, layers in enumerate(desc):
            if not isinstance(layers, (list, tuple)) or not layers:
                raise invalid("store_layer_group_desc", f"group {g} must be a non-empty list of layer indices")
            for layer in layers:
                if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
                    raise invalid("store_layer_group_desc", f"group {g}: {layer!r} is not a layer index "
                                  f"in [0, {self.num_layers})")
                if layer in seen:
                    raise invalid("store_layer_group_desc", f"layer {layer} is in two groups")
                seen.add(layer)
            idx = np.array([layer * self.kv_per_layer + kv for layer in layers
                            for kv in range(self.kv_per_layer)], dtype=np.int64)
            groups.append(self._parts(idx))
        return groups

    @property
    def num_tensors(self) -> int:
        return int(self.ptrs.shape[0])

    def check_slots(self, name: str, slots: np.ndarray) -> None:
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            bad = int(slots.min()) if int(slots.min()) < 0 else int(slots.max())
            raise invalid(name, f"slot {bad} is outside the registered cache [0, {self.num_slots})")

    def _parts(self, idx: np.ndarray) -> "_Parts":
        """Tensors ``idx`` of a value, split by row size: one part for an MHA cache, two for
        an MLA cache of latent and rope parts.  A tensor's place in a value of ``n`` slots
        is ``n`` times the row bytes of the tensors before it, so the split is done once."""
        rows = self.row_bytes[idx]
        before = np.cumsum(rows) - rows
        return _Parts(int(rows.sum()), [(int(rb), self.ptrs[idx][rows == rb], before[rows == rb])
                                        for rb in np.unique(rows)])

    def span_plan(self, slots: np.ndarray) -> ValuePlan:
        """The value of one hash/token-form key: ``slots``' rows of every tensor."""
        plans, size = self._every.plans(slots, 0)
        return ValuePlan(size, plans)

    def chunk_plan(self, descs: Sequence[Tuple[int, int]]) -> ValuePlan:
        """The value of one chunk-form key: group g's tensors, slots ``descs[g]``."""
        plans: List[Plan] = []
        at = 0
        for parts, (start, length) in zip(self.groups, descs):
            group_plans, at = parts.plans(np.arange(start, start + length, dtype=np.int64), at)
            plans.extend(group_plans)
        return ValuePlan(at, plans)


def _copier_for(tensors: Sequence[Any]) -> Copier:
    """What moves the bytes of a cache of ``tensors`` (all on one device)."""
    device = tensors[0].device
    if device.type not in ("cpu", "cuda", "npu"):  # never read device memory as host memory
        raise invalid("kvcache", f"tensors on {device}: this build moves CPU, CUDA and NPU caches only")
    if device.type == "npu":  # the torch executor reaches NPU memory through its tensors
        for t in tensors:
            npu.track(t)
    # With DATADIST_EXECUTOR=torch host caches take the device path too, so CI runs it.
    on_host = device.type == "cpu" and executor() != "torch"
    return HostCopier() if on_host else DeviceCopier(str(device))


@dataclass
class _Parts:
    """Tensors of a value grouped by row size: ``(row_bytes, ptrs, rows_before)`` each."""

    row_total: int
    parts: List[Tuple[int, np.ndarray, np.ndarray]]

    def plans(self, slots: np.ndarray, at: int) -> Tuple[List[Plan], int]:
        """Plans moving ``slots``' rows of these tensors into a value from offset ``at``,
        and the offset after them."""
        n = int(slots.shape[0])
        slots = slots.astype(np.int64)
        units = np.arange(n, dtype=np.int64)
        plans = [plan_units(ptrs, slots * rb, at + n * before, units * rb, rb) for rb, ptrs, before in self.parts]
        return plans, at + n * self.row_total


class HostCopier:
    """Executes plans between host memory and the mapped arena (``copy_plan``)."""

    def save(self, vp: ValuePlan, value_addr: int) -> None:
        for plan in vp.plans:
            copy_plan(plan.rebase(dst_delta=value_addr))

    def load(self, vp: ValuePlan, value_addr: int) -> None:
        for plan in vp.plans:
            copy_plan(plan.swapped().rebase(src_delta=value_addr))

    # The summed twins return the value's 4 KiB block sums, gathered during the copy, so
    # the checksum of a save or the verification of a load reads no byte a second time.
    def save_summed(self, vp: ValuePlan, value_addr: int) -> np.ndarray:
        sums = np.zeros(2 * -(-vp.size // BLOCK), dtype=_U64)
        for plan in vp.plans:
            copy_plan_sum(plan.rebase(dst_delta=value_addr), sums, value_addr, value_is_src=False)
        return sums

    def load_summed(self, vp: ValuePlan, value_addr: int) -> np.ndarray:
        sums = np.zeros(2 * -(-vp.size // BLOCK), dtype=_U64)
        for plan in vp.plans:
            copy_plan_sum(plan.swapped().rebase(src_delta=value_addr), sums, value_addr, value_is_src=True)
        return sums


class DeviceCopier:
    """Executes the same plans when the KV cache lives in device memory: on the torch
    executor (:mod:`datadist.engine.executor`), device side to host arena and back, with
    no Python loop per run and no host staging."""

    def __init__(self, device: str) -> None:
        self.device = device

    def save(self, vp: ValuePlan, value_addr: int) -> None:
        for plan in vp.plans:
            torch_copy_plan(plan.rebase(dst_delta=value_addr).on(self.device, "cpu"))

    def load(self, vp: ValuePlan, value_addr: int) -> None:
        for plan in vp.plans:
            torch_copy_plan(plan.swapped().rebase(src_delta=value_addr).on("cpu", self.device))


#: What moves a value's bytes between the KV cache (or V0 buffers) and the mapped arena.
Copier = Union[HostCopier, DeviceCopier]
