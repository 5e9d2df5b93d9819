"""A stand-in for Ascend's ``torch_npu`` over the fake device of ``../fake_npu.cpp``.

Put ``tests/fake_npu`` on the path and ``import torch`` loads it, as it loads torch_npu:
torch_npu's wheel declares the entry point ``torch_npu = torch_npu:_autoload`` in the
``torch.backends`` group, which torch's ``_import_device_backends`` imports and calls at the
end of ``import torch`` (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); the
``torch_npu-*.dist-info`` next to this package declares the same.  Importing builds the
extension once (cached under ``$DATADIST_FAKE_NPU_BUILD``, else the user's cache directory).

What each stand-in mirrors in torch_npu (its sources: ``torch_npu/npu/utils.py``,
``torch_npu/npu/streams.py``, ``torch_npu/npu/memory.py``, ``torch_npu/csrc/npu/Module.cpp``,
``torch_npu/csrc/distributed/Init.cpp``):

* ``torch.npu`` (also ``torch_npu.npu``): ``is_available``, ``device_count`` (the devices
  ``ASCEND_RT_VISIBLE_DEVICES`` lists, else 8), ``current_device``, ``set_device`` (per
  thread, as ``aclrtSetDevice``), ``synchronize``, ``current_stream``, ``default_stream``,
  ``Stream`` (``synchronize``, ``wait_stream``, ``query``), the ``stream`` context, and
  ``memory_snapshot`` (the caching allocator's segments and blocks: ``address``,
  ``total_size``, ``device``, blocks with ``state`` ``active_allocated``).
* ``torch_npu._C._construct_storage_from_data_pointer(ptr, device, nbytes)`` and
  ``torch_npu._C._construct_NPU_Tensor_From_Storage_And_Metadata(meta, storage)``
  (``Module.cpp``): a tensor over device memory given by address, without owning it.
* ``torch_npu._C._distributed_c10d.ProcessGroupHCCL`` (:mod:`._hccl`).

Fake-only extras, for tests: ``torch.npu.calls`` (what was asked of the device),
``kernels_run``, ``regions``, ``set_async`` (the asynchronous stream mode, also on with
``FAKE_NPU_ASYNC=1``) and ``queued``.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import itertools
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.utils.cpp_extension

_SOURCE = Path(__file__).resolve().parents[1] / "fake_npu.cpp"
_NAME = "datadist_fake_npu"


def _build() -> Any:
    """The extension: imported straight from its build directory once built (every
    process imports torch, so a second build check per process would be waste)."""
    digest = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    root = os.environ.get("DATADIST_FAKE_NPU_BUILD") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "datadist-fake-npu")
    build = os.path.join(root, digest)
    built = os.path.join(build, f"{_NAME}.so")
    if os.path.exists(built):
        loader = importlib.machinery.ExtensionFileLoader(_NAME, built)
        spec = importlib.util.spec_from_loader(_NAME, loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    os.makedirs(build, exist_ok=True)
    return torch.utils.cpp_extension.load(name=_NAME, sources=[str(_SOURCE)], build_directory=build,
                                          extra_cflags=["-O1"], verbose=False)


def _visible_devices() -> int:
    """How many devices this process sees: those ``ASCEND_RT_VISIBLE_DEVICES`` lists (of
    the 8 the fake machine has), else all 8."""
    listed = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if listed is None:
        return 8
    ids = [int(x) for x in listed.split(",") if x.strip()]
    if any(i < 0 or i > 7 for i in ids) or len(set(ids)) != len(ids):
        raise RuntimeError(f"fake npu: ASCEND_RT_VISIBLE_DEVICES={listed!r} names devices other than 0..7")
    return len(ids)


def _index(device: Any = None) -> int:
    if device is None:
        return int(_ext.current_device())
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return int(_ext.current_device()) if device.index is None else int(device.index)
    if isinstance(device, Stream):
        return device.device_index
    return int(device)


_ids = itertools.count(1)


class Stream:
    """A stream of a device (``torch_npu.npu.Stream``): 0 is the device's default stream."""

    def __init__(self, device: Any = None, priority: int = 0, *, stream_id: Optional[int] = None) -> None:
        self.device_index = _index(device)
        self.stream_id = next(_ids) if stream_id is None else stream_id

    @property
    def device(self) -> torch.device:
        return torch.device("npu", self.device_index)

    def synchronize(self) -> None:
        _ext.synchronize_stream(self.device_index, self.stream_id)

    def wait_stream(self, other: "Stream") -> None:
        other.synchronize()  # the fake orders streams by running the other's work now

    def query(self) -> bool:
        return _ext.queued() == 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and (other.device_index, other.stream_id) == (self.device_index,
                                                                                        self.stream_id)

    def __hash__(self) -> int:
        return hash((self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch_npu.npu.Stream device=npu:{self.device_index} id={self.stream_id}>"


def _npu_module() -> types.ModuleType:
    npu = types.ModuleType("torch.npu")
    calls: list = []
    npu.calls = calls
    npu.Stream = Stream
    npu.is_available = lambda: _ext.regions() >= 0 and _count > 0
    npu.device_count = lambda: _count
    npu.is_initialized = lambda: True
    npu._is_in_bad_fork = lambda: False
    npu._lazy_init = lambda: None
    npu.manual_seed_all = lambda seed: None
    npu.current_device = lambda: int(_ext.current_device())

    def set_device(device: Any) -> None:
        index = _index(device)
        _ext.set_device(index)
        calls.append(("set_device", index, threading.current_thread().name))

    def synchronize(device: Any = None) -> None:
        calls.append(("synchronize", device))
        _ext.synchronize_device(_index(device))

    def current_stream(device: Any = None) -> Stream:
        index = _index(device)
        return Stream(index, stream_id=int(_ext.current_stream(index)))

    @contextlib.contextmanager
    def stream(s: Optional[Stream]) -> Iterator[None]:
        if s is None:
            yield
            return
        before = int(_ext.current_stream(s.device_index))
        _ext.set_stream(s.device_index, s.stream_id)
        try:
            yield
        finally:
            _ext.set_stream(s.device_index, before)

    def memory_snapshot(mempool_id: Any = None) -> list:
        return [{"device": dev, "address": addr, "total_size": mapped, "allocated_size": size,
                 "active_size": size, "segment_type": "large",
                 "blocks": [{"address": addr, "size": size, "state": "active_allocated"}]}
                for addr, mapped, size, dev in _ext.snapshot()]

    def memory_allocated(device: Any = None) -> int:
        index = _index(device)
        return sum(size for _, _, size, dev in _ext.snapshot() if dev == index)

    npu.set_device = set_device
    npu.synchronize = synchronize
    npu.current_stream = current_stream
    npu.default_stream = lambda device=None: Stream(_index(device), stream_id=0)
    npu.stream = stream
    npu.memory_snapshot = memory_snapshot
    npu.memory_allocated = memory_allocated
    npu.kernels_run = _ext.kernels_run
    npu.regions = _ext.regions
    npu.queued = _ext.queued
    npu.set_async = _ext.set_async
    return npu


def _c_module() -> types.ModuleType:
    c = types.ModuleType("torch_npu._C")

    def construct_storage_from_data_pointer(data_ptr: int, device: torch.device, size_bytes: int) -> Any:
        # A storage over device memory it does not own (torch_npu builds an NPUStorageImpl;
        # the fake's device needs no more than torch's own).
        return torch._C._construct_storage_from_data_pointer(int(data_ptr), torch.device(device), int(size_bytes))

    def construct_tensor(metadata: dict, storage: Any) -> torch.Tensor:
        t = torch.empty(0, dtype=metadata["dtype"], device=metadata["device"])
        return t.set_(storage, int(metadata.get("storage_offset", 0)), tuple(metadata["size"]),
                      tuple(metadata["stride"]))

    c._construct_storage_from_data_pointer = construct_storage_from_data_pointer
    c._construct_NPU_Tensor_From_Storage_And_Metadata = construct_tensor
    from . import _hccl

    dist = types.ModuleType("torch_npu._C._distributed_c10d")
    dist.ProcessGroupHCCL = _hccl.ProcessGroupHCCL
    c._distributed_c10d = dist
    return c


def _autoload() -> None:
    """torch's ``torch.backends`` entry point: importing this package did the work."""


_ext = _build()
_count = _visible_devices()
_ext.set_device_count(_count)
_ext.set_async(os.environ.get("FAKE_NPU_ASYNC") == "1")
torch.utils.rename_privateuse1_backend("npu")
npu = _npu_module()
torch._register_device_module("npu", npu)
torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
sys.modules["torch.npu"] = sys.modules["torch_npu.npu"] = npu
_C = _c_module()
sys.modules["torch_npu._C"] = _C
sys.modules["torch_npu._C._distributed_c10d"] = _C._distributed_c10d

__all__ = ["npu", "Stream"]
