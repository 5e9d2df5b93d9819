"""Closed sets of the public API: roles, placements, data types, memory kinds (SPEC section 1).

``DataType`` values are GE's ``ge::DataType`` numbers, as in ``llm_datadist``. torch is
imported only inside the torch mappings, so importing this module never loads it.
"""
from __future__ import annotations

from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from ._status import ParamInvalidError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["LLMRole", "Placement", "DataType", "RegisterMemStatus", "Memtype"]


class LLMRole(IntEnum):
    """Role of an engine: PROMPT pushes, DECODER pulls, MIX does both.  ``str()`` of a
    member is ``"LLMRole.NAME"``, as in CANN."""

    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class Placement(IntEnum):
    """Where a cache's memory lives.  ``str()`` of a member is ``"Placement.NAME"``, as in
    CANN."""

    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class RegisterMemStatus(Enum):
    """Progress of the background part of ``LLMDataDist.link``."""

    OK = 0
    PREPARING = 1
    FAILED = 2


class Memtype(Enum):
    """Kind of memory a ``MemInfo`` describes."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class DataType(Enum):
    """Element type of a cache tensor (values: ``ge::DataType``)."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27

    @property
    def has_element_size(self) -> bool:
        """Whether elements have a fixed size (all but ``DT_STRING``, which CANN lists but
        no cache can hold)."""
        return self in _ELEMENT_SIZE

    @property
    def element_size(self) -> int:
        """Bytes per element; :class:`ParamInvalidError` for ``DT_STRING``."""
        size = _ELEMENT_SIZE.get(self)
        if size is None:
            raise ParamInvalidError(f"{self.name} has no element size")
        return size

    def to_torch(self) -> "torch.dtype":
        """The torch dtype with the same element layout (``DT_UINT16/32/64`` map to
        ``torch.uint16/32/64``, which torch supports for storage and copies)."""
        found = _torch_maps()[0].get(self)
        if found is None:  # DT_STRING; uint16/32/64 with torch < 2.3
            raise ParamInvalidError(f"{self.name} has no torch dtype (in this torch version)")
        return found

    @classmethod
    def from_torch(cls, dtype: "torch.dtype") -> "DataType":
        """The DataType of a torch dtype. ``TypeError`` if ``dtype`` is not a
        ``torch.dtype``; :class:`ParamInvalidError` if no DataType matches it."""
        import torch

        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        found = _torch_maps()[1].get(dtype)
        if found is None:
            supported = ", ".join(str(t) for t in _torch_maps()[1])
            raise ParamInvalidError(f"torch dtype {dtype} has no DataType; supported: {supported}")
        return found


_ELEMENT_SIZE: Dict[DataType, int] = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_BF16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_UINT32: 4,
    DataType.DT_UINT64: 8,
    DataType.DT_BOOL: 1,
    DataType.DT_DOUBLE: 8,
}

_TORCH_NAMES: Dict[DataType, str] = {
    DataType.DT_FLOAT: "float32",
    DataType.DT_FLOAT16: "float16",
    DataType.DT_BF16: "bfloat16",
    DataType.DT_INT8: "int8",
    DataType.DT_INT16: "int16",
    DataType.DT_UINT16: "uint16",
    DataType.DT_UINT8: "uint8",
    DataType.DT_INT32: "int32",
    DataType.DT_INT64: "int64",
    DataType.DT_UINT32: "uint32",
    DataType.DT_UINT64: "uint64",
    DataType.DT_BOOL: "bool",
    DataType.DT_DOUBLE: "float64",
}

_TorchMaps = Tuple[Dict[DataType, "torch.dtype"], Dict["torch.dtype", DataType]]

_torch_cache: Optional[_TorchMaps] = None


def _torch_maps() -> _TorchMaps:
    """(DataType -> torch.dtype, torch.dtype -> DataType), built on first use."""
    global _torch_cache
    if _torch_cache is None:
        import torch

        to_torch: Dict[DataType, torch.dtype] = {
            dt: getattr(torch, name) for dt, name in _TORCH_NAMES.items() if hasattr(torch, name)
        }
        _torch_cache = (to_torch, {t: dt for dt, t in to_torch.items()})
    return _torch_cache
