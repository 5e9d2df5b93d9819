"""NPU device memory, reached through torch_npu's tensors (never as host memory).

Every NPU byte datadist moves belongs to a tensor it knows: the engine's ``mem_pool_cfg``
pool (one allocation on the device), the tensors of registered caches, and tensors over
registered bare addresses.  :func:`track` records such a tensor's address range (holding
it weakly: whoever owns the tensor decides how long it lives); :func:`view` turns an
address range inside a live one back into a ``uint8`` view of that tensor (``narrow``, no
copy), which is what the torch executor copies with.

A bare address (``tensor.data_ptr()``, as CANN's samples, vllm-ascend and MindIE register
caches) is resolved by :func:`adopt` the way torch_npu's own NPU graph trees rebuild
tensors: the allocation it lies in is looked up among torch_npu's caching-allocator blocks
(``torch.npu.memory_snapshot()``: segments of ``address``/``total_size`` on a ``device``,
blocks with a ``state``), and that block is wrapped without being owned
(``torch_npu._C._construct_storage_from_data_pointer`` and
``_construct_NPU_Tensor_From_Storage_And_Metadata``, ``torch_npu/csrc/npu/Module.cpp``).
An address in no live allocation of the engine's device is an error, never a host read.

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

    from .memory import IpcRegion

__all__ = ["NpuArena", "track", "covers", "view", "adopt", "set_device", "synchronize"]

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
        tensor = adopt([addr], nbytes, device)[0]  # a live allocation of the device, or an error
        base, size = int(tensor.data_ptr()), int(tensor.numel())
    return _flat(tensor).narrow(0, addr - base, nbytes)


def _allocations(device: str) -> list[tuple[int, int]]:
    """``(address, bytes)`` of the live blocks torch_npu's caching allocator holds on
    ``device``, sorted."""
    index = int(device.partition(":")[2] or 0)
    blocks = []
    for segment in _npu().memory_snapshot():
        if int(segment.get("device", -1)) != index:
            continue
        blocks += [(int(b["address"]), int(b["size"])) for b in segment.get("blocks", ())
                   if b.get("state") == "active_allocated"]
    return sorted(blocks)


def adopt(addrs: list[int], nbytes: int, device: str) -> list[Any]:
    """For each of ``addrs``: a flat ``uint8`` tensor over the whole torch_npu allocation
    on ``device`` that holds ``nbytes`` at that address (not owning it: the caller keeps
    the memory alive, as with ``llm_datadist``), tracked.  ``PARAM_INVALID`` for an address
    whose bytes do not all lie in one live allocation of ``device``."""
    import torch
    import torch_npu

    blocks = _allocations(device)
    starts = [b for b, _ in blocks]
    out = []
    for i, addr in enumerate(addrs):
        k = bisect.bisect_right(starts, addr) - 1
        if k < 0 or addr + nbytes > blocks[k][0] + blocks[k][1]:
            fail(Fault.PARAM_INVALID,
                 f"addrs[{i}] = {addr:#x} ({nbytes} bytes) is not inside a live torch_npu allocation on {device} "
                 f"({len(blocks)} there); register NPU memory of this engine's device_id, held while registered")
        base, size = blocks[k]
        storage = torch_npu._C._construct_storage_from_data_pointer(base, torch.device(device), size)
        meta = {"dtype": torch.uint8, "device": torch.device(device), "size": (size,), "stride": (1,),
                "storage_offset": 0}
        tensor = torch_npu._C._construct_NPU_Tensor_From_Storage_And_Metadata(meta, storage)
        track(tensor)
        out.append(tensor)
    return out


def _npu() -> Any:
    """``torch.npu``, registered by importing torch_npu."""
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu  # type: ignore[attr-defined]  # torch_npu adds it at import; torch declares no such module


def set_device(device: str) -> None:
    """Make ``device`` (``"npu:N"``) current on the calling thread, one of the engine's own
    (an NPU's current device is per thread; HCCL forms a communicator on it); a no-op for
    any other device, which has no current one here."""
    if device.startswith("npu"):
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
