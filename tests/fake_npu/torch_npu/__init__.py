"""A stand-in for Ascend's ``torch_npu`` over the fake device of ``../fake_npu.cpp``.

Importing it builds the extension (once; cached under ``$DATADIST_FAKE_NPU_BUILD`` or the
user's cache directory), renames torch's PrivateUse1 backend to ``npu`` and registers
``torch.npu`` with the calls datadist and ems make: ``is_available``, ``device_count``,
``current_device``, ``set_device``, ``synchronize``, ``current_stream``.  Tensors then
live on ``torch.device("npu", 0)``, in memory the host cannot read (see the C++ file).
Put ``tests/fake_npu`` on ``PYTHONPATH`` to make ``import torch_npu`` find it.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import types
from pathlib import Path

import torch
import torch.utils.cpp_extension

_SOURCE = Path(__file__).resolve().parents[1] / "fake_npu.cpp"


def _build():
    digest = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    root = os.environ.get("DATADIST_FAKE_NPU_BUILD") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "datadist-fake-npu")
    build = os.path.join(root, digest)
    os.makedirs(build, exist_ok=True)
    return torch.utils.cpp_extension.load(name="datadist_fake_npu", sources=[str(_SOURCE)], build_directory=build,
                                          extra_cflags=["-O1"], verbose=False)


class _Stream:
    """The device's one stream: work is synchronous, so synchronizing is a no-op."""

    def synchronize(self) -> None:
        return None

    def wait_stream(self, other: "_Stream") -> None:
        return None


def _module(ext) -> types.ModuleType:
    npu = types.ModuleType("torch.npu")
    npu.is_available = lambda: True
    npu.device_count = lambda: 1
    npu.current_device = lambda: 0
    npu.is_initialized = lambda: True
    npu._is_in_bad_fork = lambda: False
    npu.manual_seed_all = lambda seed: None

    def set_device(device) -> None:
        index = device.index if isinstance(device, torch.device) else int(device)
        if index not in (0, None):
            raise RuntimeError(f"fake npu: only device 0 exists, got {device}")
        calls.append(("set_device", 0 if index is None else index, threading.current_thread().name))

    def synchronize(device=None) -> None:
        calls.append(("synchronize", device))

    calls: list = []
    npu.set_device = set_device
    npu.synchronize = synchronize
    npu.current_stream = lambda device=None: _Stream()
    npu.Stream = _Stream
    npu.calls = calls              # what was asked of the device, for tests
    npu.kernels_run = ext.kernels_run
    npu.regions = ext.regions
    return npu


_ext = _build()
torch.utils.rename_privateuse1_backend("npu")
npu = _module(_ext)
torch._register_device_module("npu", npu)
torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
sys.modules["torch.npu"] = npu

__all__ = ["npu"]
