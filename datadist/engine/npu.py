"""NPU device memory, reached through torch_npu's tensors (never as host memory).

torch offers no way to wrap a bare NPU address in a tensor, so every NPU byte datadist
moves belongs to a tensor it knows: the engine's ``mem_pool_cfg`` pool (one allocation on
the device) and the tensors of registered caches.  :func:`track` records such a tensor's
address range (holding it weakly: whoever owns the tensor decides how long it lives);
:func:`view` turns an address range inside a live one back into a ``uint8`` view of that
tensor (``narrow``, no copy), which is what the torch executor copies with.  An address
outside every live tracked tensor is an error, never a host read.

torch_npu is imported only by engines configured for the NPU; :func:`set_device` makes the
engine's device current on the calling thread (the engine's own threads, never the
caller's).
"""
from __future__ import annotations

import bisect
import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional

from .errors import Fault, fail

if TYPE_CHECKING:
    import torch

    from .cuda import IpcRegion

__all__ = ["NpuArena", "track", "covers", "view", "set_device", "synchronize"]

_lock = threading.Lock()
_starts: list[int] = []                   # sorted bases of tracked tensors
_tensors: dict[int, tuple[int, Any]] = {}  # base -> (bytes, weak reference to the tensor)


def _flat(tensor: Any) -> Any:
    """A flat ``uint8`` view of a contiguous tensor's bytes."""
    import torch

    if not tensor.is_contiguous():
        fail(Fault.PARAM_INVALID, f"NPU tensor of shape {tuple(tensor.shape)} is not contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


def track(tensor: Any) -> int:
    """Remember ``tensor``'s memory (contiguous, on an NPU) while the tensor lives; returns
    its address."""
    flat = _flat(tensor)
    base = int(flat.data_ptr())
    with _lock:
        for dead in [b for b, (_, ref) in _tensors.items() if ref() is None]:
            del _tensors[dead]
            _starts.remove(dead)
        if base not in _tensors:
            bisect.insort(_starts, base)
        _tensors[base] = (int(flat.numel()), weakref.ref(tensor))
    return base


def _find(addr: int) -> tuple[int, int, Any]:
    """(base, bytes, tensor or None) of the tracked tensor that may hold ``addr``."""
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        base = _starts[i] if i >= 0 else 0
        size, ref = _tensors.get(base, (0, lambda: None))
    return base, size, ref()


def covers(addr: int, nbytes: int) -> bool:
    """Whether one live tracked tensor holds all ``nbytes`` at ``addr``."""
    base, size, tensor = _find(addr)
    return tensor is not None and addr + nbytes <= base + size


def view(addr: int, nbytes: int, device: str) -> Any:
    """A ``uint8`` tensor over ``nbytes`` at ``addr`` of a live tracked NPU tensor."""
    base, size, tensor = _find(addr)
    if tensor is None or addr + nbytes > base + size:
        fail(Fault.PARAM_INVALID,
                    f"{nbytes} bytes at {addr:#x} are not inside an NPU tensor this engine knows (its pool or a "
                    "registered cache); NPU memory is reached through its tensors only")
    return _flat(tensor).narrow(0, addr - base, nbytes)


def _npu() -> Any:
    """``torch.npu``, registered by importing torch_npu."""
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu  # type: ignore[attr-defined]  # torch_npu adds it at import; torch declares no such module


def set_device(device: str) -> None:
    """Make ``device`` (``"npu:N"``) current on the calling thread."""
    _npu().set_device(int(device.partition(":")[2] or 0))


def synchronize(device: str) -> None:
    _npu().synchronize(device)


class NpuArena:
    """``size`` bytes of NPU memory for the ``mem_pool_cfg`` pool: one tensor, tracked."""

    regions: tuple[IpcRegion, ...] = ()  # no IPC regions: same-host peers reach it through the agent

    def __init__(self, device: str, size: int) -> None:
        import torch

        _npu()
        try:
            self._tensor: Optional[torch.Tensor] = torch.empty(int(size), dtype=torch.uint8, device=device)
        except RuntimeError as exc:
            fail(Fault.DEVICE_OUT_OF_MEMORY,
                        f"mem_pool_cfg memory_size = {size} bytes does not fit on {device}: {exc}")
        self.base = track(self._tensor)
        self.size = int(size)
        self.device = device

    def close(self) -> None:
        self._tensor = None  # its views end with it
