"""Torch tensors over raw memory: ``create_tensors`` and the views ``get_cache_tensors`` returns."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, List, Sequence, Union

from ._status import LLMStatusCode, api_errors, raise_error
from ._types import DataType

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["create_tensors", "tensor_at"]


def _torch_dtype(dtype: object) -> "torch.dtype":
    import torch

    if isinstance(dtype, DataType):
        return dtype.to_torch()
    if isinstance(dtype, torch.dtype):
        return dtype
    raise TypeError(f"dtype must be a DataType or torch.dtype, got {type(dtype).__name__}")


def tensor_at(addr: int, shape: Sequence[int], dtype: Union[DataType, "torch.dtype"],
              device: str = "cpu") -> "torch.Tensor":
    """A tensor of ``shape``/``dtype`` viewing the memory at ``addr`` (no copy), host
    memory for ``device="cpu"``, CUDA device memory for ``"cuda"`` / ``"cuda:N"``, NPU
    memory of a tensor the engine knows (its pool, a registered cache) for ``"npu:N"``.

    The memory must outlive the tensor: the caller owns that (as with ``llm_datadist``).
    """
    import torch

    tdtype = _torch_dtype(dtype)
    numel = 1
    for d in shape:
        numel *= int(d)
    nbytes = numel * torch.empty((), dtype=tdtype).element_size()
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda", "npu"):
        raise_error(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                    f"create_tensors on device {device!r}: this build maps CPU, CUDA and NPU memory only")
    if kind == "cuda" and not torch.cuda.is_available():
        raise_error(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                    f"create_tensors on device {device!r}, but torch sees no CUDA device here")
    if kind == "npu":
        from .engine.core import npu_visible

        if not npu_visible():
            raise_error(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                        f"create_tensors on device {device!r}, but torch_npu sees no NPU here")
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=tdtype, device=device)
    raw_t: torch.Tensor
    if kind == "cuda":
        from .engine.cuda import cuda_tensor

        raw_t = cuda_tensor(int(addr), nbytes, str(device))
    elif kind == "npu":
        from .engine.npu import view

        raw_t = view(int(addr), nbytes, str(device))
    else:
        raw_t = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(int(addr)), dtype=torch.uint8)
    return raw_t.view(tdtype).view(tuple(int(d) for d in shape))


@api_errors
def create_tensors(shape: Sequence[int], dtype: Union[DataType, "torch.dtype"], addrs: Sequence[int],
                   device: str = "cpu") -> List["torch.Tensor"]:
    """One tensor of ``shape``/``dtype`` over each address in ``addrs`` (module helper of
    the contract).  ``TypeError`` for a wrong argument type."""
    if not isinstance(addrs, (list, tuple)):
        raise TypeError(f"addrs must be a list of int addresses, got {type(addrs).__name__}")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise TypeError(f"shape must be a list of non-negative ints, got {shape!r}")
    out = []
    for i, a in enumerate(addrs):
        if isinstance(a, bool) or not isinstance(a, int):
            raise TypeError(f"addrs[{i}] must be an int address, got {type(a).__name__}")
        out.append(tensor_at(a, shape, dtype, device))
    return out
