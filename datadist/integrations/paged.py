"""How a serving engine's paged KV-cache tensors map onto datadist blocks caches.

Engines keep one tensor per attention layer whose shape holds a ``num_blocks`` dim, with
dims before it that split the layer into separate regions (K and V: ``(2, num_blocks,
...)``) and dims after it that make one block (any order: heads-major, tokens-major).
MLA layers have no split (``(num_blocks, block_size, head_dim)``), block-major backends put
K and V inside the block (``(num_blocks, 2, ...)``).  Whatever the layout, each region is
``num_blocks`` equal, dense, evenly spaced blocks: exactly a datadist blocks-cache tensor.
:func:`paged_layout` finds the regions from the tensors' strides, without copying, and
refuses a tensor whose blocks are not dense (a block would then hold foreign bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .._status import LLMException
from .._types import DataType, Placement

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .._objects import CacheDesc

__all__ = ["PagedLayout", "paged_layout", "block_views"]


@dataclass(frozen=True)
class PagedLayout:
    """The blocks-cache view of an engine's KV cache: ``addrs`` of every region, layer by
    layer (``tensors_per_layer`` regions each), ``num_blocks`` blocks of ``block_bytes``."""

    layer_names: tuple[str, ...]
    addrs: tuple[int, ...]
    tensors_per_layer: int
    num_blocks: int
    block_bytes: int
    data_type: DataType
    element_size: int
    device: str

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def cache_desc(self) -> "CacheDesc":
        """The :class:`datadist.CacheDesc` of a blocks cache over these regions."""
        from .._objects import CacheDesc

        placement = Placement.HOST if self.device == "cpu" else Placement.DEVICE
        return CacheDesc(len(self.addrs), [self.num_blocks, self.block_bytes // self.element_size], self.data_type,
                         placement)

    def describe(self) -> Dict[str, Any]:
        """What must match between two engines for a block of one to be a block of the other."""
        return {"layers": self.num_layers, "tensors_per_layer": self.tensors_per_layer,
                "block_bytes": self.block_bytes, "dtype": self.data_type.name}


def _dense_blocks(shape: Sequence[int], strides: Sequence[int], dim: int) -> bool:
    """Whether the blocks along ``dim`` are dense (one block holds no foreign bytes) and
    touch (evenly spaced by exactly one block)."""
    inner = [d for d in range(len(shape)) if d != dim and shape[d] > 1 and strides[d] < strides[dim]]
    size = math.prod(shape[d] for d in inner)
    extent = 1 + sum((shape[d] - 1) * strides[d] for d in inner)
    return size == strides[dim] and extent == size


def _block_dim(shape: Sequence[int], strides: Sequence[int], num_blocks: int) -> Optional[int]:
    """The dim that holds ``num_blocks`` dense, evenly spaced blocks; None if no dim does."""
    for dim in reversed(range(len(shape))):  # the standard (2, num_blocks, ...) wins a num_blocks == 2 tie
        if shape[dim] == num_blocks and _dense_blocks(shape, strides, dim):
            return dim
    return None


def _regions(name: str, tensor: "torch.Tensor", num_blocks: int) -> Tuple[List[int], int]:
    """Base addresses of ``tensor``'s block regions and the bytes of one block."""
    shape, strides, esize = tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size()
    found = _block_dim(shape, strides, num_blocks)
    if found is None:
        raise ValueError(f"KV cache tensor of layer {name!r} (shape {shape}, strides {strides}) has no dim of "
                         f"{num_blocks} dense, evenly spaced blocks; its layout is not supported")
    block = strides[found]
    outer = [d for d in range(len(shape)) if d != found and shape[d] > 1 and strides[d] > block]
    base = tensor.data_ptr()
    addrs = [base + esize * sum(i * strides[d] for i, d in zip(index, outer))
             for index in product(*(range(shape[d]) for d in outer))]
    return addrs, block * esize


def paged_layout(kv_caches: Mapping[str, "torch.Tensor"], num_blocks: int) -> PagedLayout:
    """The :class:`PagedLayout` of ``kv_caches`` (layer name -> tensor, in model order),
    every tensor holding ``num_blocks`` blocks.  ``ValueError`` when the layers differ in
    dtype, device, block size or split, or a layout is not blocks-contiguous."""
    if not kv_caches:
        raise ValueError("no KV cache tensors to register")
    names: list[str] = []
    addrs: list[int] = []
    first: Optional[Tuple[int, int, "torch.dtype", str]] = None
    for name, tensor in kv_caches.items():
        regions, block_bytes = _regions(name, tensor, num_blocks)
        shape = (len(regions), block_bytes, tensor.dtype, str(tensor.device))
        if first is None:
            first = shape
        elif shape != first:
            raise ValueError(f"layer {name!r} has {len(regions)} regions of {block_bytes}-byte blocks "
                             f"({tensor.dtype} on {tensor.device}); layer {names[0]!r} has {first[0]} of "
                             f"{first[1]} ({first[2]} on {first[3]}): layers of one cache must match")
        names.append(name)
        addrs.extend(regions)
    assert first is not None
    try:
        dtype = DataType.from_torch(first[2])
    except LLMException:  # fp8 and other types without a DataType move as bytes
        dtype = DataType.DT_UINT8
    esize = dtype.element_size
    return PagedLayout(layer_names=tuple(names), addrs=tuple(addrs), tensors_per_layer=first[0],
                       num_blocks=num_blocks, block_bytes=first[1], data_type=dtype, element_size=esize,
                       device=first[3])



def block_views(kv_caches: Mapping[str, "torch.Tensor"], layout: PagedLayout) -> List[List["torch.Tensor"]]:
    """Per layer, its regions as ``uint8`` tensors ``[num_blocks, block_bytes]`` over the
    same memory (for APIs that take tensors rather than addresses)."""
    import torch

    views: List[List[torch.Tensor]] = []
    n = layout.tensors_per_layer
    for i, tensor in enumerate(kv_caches.values()):
        storage = tensor.untyped_storage()
        layer = []
        for addr in layout.addrs[i * n:(i + 1) * n]:
            view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            view.set_(storage, addr - storage.data_ptr(), (layout.num_blocks, layout.block_bytes),
                      (layout.block_bytes, 1))
            layer.append(view)
        views.append(layer)
    return views
