"""CUDA memory through the driver API (``libcuda.so.1``), loaded only when an engine uses
a CUDA device.

Why the driver API and not torch: a copy plan of thousands of runs must not cost a Python
call per run, and the C executor (``_native.call_plan``) can call ``cuMemcpyAsync``
through its address without linking against any CUDA library at build time.  The same
library gives the IPC handles that let a same-host peer map this process's device memory
(``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle``), and pins host memory
(``cuMemHostRegister``) so host <-> device copies run at DMA speed.  torch uses the
device's primary context, and so does this module: pointers from either are valid in
the other.

Ordering: copies are issued on the legacy default stream (stream 0) of the primary
context and waited for before a call returns.  Work the caller queued on torch's
default stream therefore completes before a copy reads the memory.  torch's other streams
(``torch.cuda.Stream()``, side streams of frameworks) are non-blocking, so work on them is
the caller's to synchronize first, as with ``llm_datadist``, whose transfers also read
the memory as it is when called.

Contexts: each driver call here runs with the device's primary context pushed on the
calling thread and popped after, so a thread whose torch device is another GPU keeps it.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, SupportsInt

from .errors import Fault, fail
from . import _native
from .memory import IpcRegion, PeerSpan

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

    import torch

    from .layout import Plan

    #: What a driver function's argument types are made of here.
    _CArg = type[ctypes._SimpleCData[Any]] | type[ctypes._Pointer[Any]] | type[ctypes.Structure]

__all__ = ["CudaDevice", "CudaError", "DeviceArena", "IpcRegion", "PeerDeviceRegion", "active", "available",
           "copy_plan", "cuda_tensor", "device", "driver_present", "export_regions", "is_device_memory", "pin", "unpin"]

log = logging.getLogger("datadist")

_IPC_HANDLE_SIZE = 64
_CU_MEMORYTYPE_DEVICE = 2
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CU_MEMHOSTREGISTER_PORTABLE = 1
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class CudaError(RuntimeError):
    """A driver call failed; ``code`` is its ``CUresult``."""

    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: CUDA error {code} ({text})")
        self.code = code


class _IpcHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array field reads back cut at the first NUL byte.
    _fields_ = [("reserved", ctypes.c_ubyte * _IPC_HANDLE_SIZE)]

    def raw(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), _IPC_HANDLE_SIZE)

    @classmethod
    def of(cls, raw: bytes) -> "_IpcHandle":
        if len(raw) != _IPC_HANDLE_SIZE:
            raise ValueError(f"a CUDA IPC handle has {_IPC_HANDLE_SIZE} bytes, got {len(raw)}")
        handle = cls()
        ctypes.memmove(ctypes.addressof(handle), raw, _IPC_HANDLE_SIZE)
        return handle


class _Driver:
    """The driver functions this package uses, with argument types set once."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._lib = lib
        u64, size_t, vp, c_int, c_uint = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        self.cuInit = self._fn(("cuInit",), c_uint)
        self.cuDeviceGet = self._fn(("cuDeviceGet",), ctypes.POINTER(c_int), c_int)
        self.cuDeviceGetCount = self._fn(("cuDeviceGetCount",), ctypes.POINTER(c_int))
        self.cuDevicePrimaryCtxRetain = self._fn(("cuDevicePrimaryCtxRetain",), ctypes.POINTER(vp), c_int)
        self.cuCtxPushCurrent = self._fn(("cuCtxPushCurrent_v2",), vp)
        self.cuCtxPopCurrent = self._fn(("cuCtxPopCurrent_v2",), ctypes.POINTER(vp))
        self.cuMemGetAddressRange = self._fn(("cuMemGetAddressRange_v2",), ctypes.POINTER(u64),
                                             ctypes.POINTER(size_t), u64)
        self.cuPointerGetAttribute = self._fn(("cuPointerGetAttribute",), vp, c_int, u64)
        self.cuIpcGetMemHandle = self._fn(("cuIpcGetMemHandle",), ctypes.POINTER(_IpcHandle), u64)
        self.cuIpcOpenMemHandle = self._fn(("cuIpcOpenMemHandle_v2",), ctypes.POINTER(u64), _IpcHandle, c_uint)
        self.cuIpcCloseMemHandle = self._fn(("cuIpcCloseMemHandle",), u64)
        self.cuMemHostRegister = self._fn(("cuMemHostRegister_v2",), vp, size_t, c_uint)
        self.cuMemHostUnregister = self._fn(("cuMemHostUnregister",), vp)
        self.cuStreamSynchronize = self._fn(("cuStreamSynchronize",), vp)
        self._error_string = lib.cuGetErrorString
        self._error_string.argtypes = [c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._error_string.restype = c_int
        #: Address of ``cuMemcpyAsync(dst, src, bytes, stream)`` for the C plan executor.
        memcpy_async = ctypes.cast(lib.cuMemcpyAsync, vp).value
        if memcpy_async is None:  # a symbol the library resolved always has an address
            raise OSError("libcuda.so.1 gives no address for cuMemcpyAsync")
        self.memcpy_async: int = memcpy_async
        self.check("cuInit", self.cuInit(0))

    def _fn(self, names: tuple[str, ...], *argtypes: _CArg) -> CFuncPtr:
        # Exactly the names cuda.h maps the calls to: an older version of a call may take
        # other argument types (cuMemGetAddressRange v1 has 32-bit sizes).
        for name in names:
            fn: Optional[CFuncPtr] = getattr(self._lib, name, None)
            if fn is not None:
                fn.argtypes = list(argtypes)
                fn.restype = ctypes.c_int
                return fn
        raise OSError(f"libcuda.so.1 has none of {names}")

    def check(self, call: str, code: int) -> None:
        if code:
            text = ctypes.c_char_p()
            self._error_string(code, ctypes.byref(text))
            raise CudaError(call, code, (text.value or b"unknown").decode(errors="replace"))


_driver: Optional[_Driver] = None
_driver_lock = threading.Lock()


def _drv() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def driver_present() -> bool:
    """Whether the CUDA driver library loads: a cheap first test (no torch import) that
    tells CPU-only machines apart."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def available() -> bool:
    """Whether torch sees a CUDA device and the driver library loads."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        _drv()
    except (ImportError, OSError, CudaError):
        return False
    return True


class CudaDevice:
    """One CUDA device's primary context, pushed on whichever thread makes a call.

    Engine threads (the caller's, the agent's, ``transfer_cache_async`` workers) all copy;
    :meth:`entered` pushes the context for the calls and pops it after, leaving the
    thread's own current device (torch's) as it was."""

    def __init__(self, index: int) -> None:
        import torch

        drv = _drv()
        count = ctypes.c_int()
        drv.check("cuDeviceGetCount", drv.cuDeviceGetCount(ctypes.byref(count)))
        if not 0 <= index < count.value:
            fail(Fault.PARAM_INVALID,
                        f"device_id = {index}, but this machine has {count.value} CUDA device(s)")
        # torch's runtime on the same primary context (torch leaves ``init`` unannotated)
        torch.cuda.init()  # type: ignore[no-untyped-call]
        dev = ctypes.c_int()
        drv.check("cuDeviceGet", drv.cuDeviceGet(ctypes.byref(dev), index))
        ctx = ctypes.c_void_p()
        drv.check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        self.index = index
        self.name = f"cuda:{index}"
        self._ctx = ctx

    @contextlib.contextmanager
    def entered(self) -> Iterator[_Driver]:
        """The driver, with this device's context current on the calling thread."""
        drv = _drv()
        drv.check("cuCtxPushCurrent", drv.cuCtxPushCurrent(self._ctx))
        try:
            yield drv
        finally:
            drv.cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p()))


_active: Optional[CudaDevice] = None


def device(index: int) -> CudaDevice:
    """The device this process's engine copies with (one engine per process)."""
    global _active
    if _active is None or _active.index != index:
        _active = CudaDevice(index)
    return _active


def active() -> Optional[CudaDevice]:
    """The device set up by :func:`device`, or None in a process without CUDA caches."""
    return _active


def _current() -> CudaDevice:
    if _active is None:
        fail(Fault.FEATURE_NOT_ENABLED,
                    "a copy involves CUDA memory, but this engine was not initialized with device_type cuda")
    return _active


def copy_plan(plan: Plan) -> int:
    """Execute a plan with one side (or both) in CUDA memory: one ``cuMemcpyAsync`` per
    run from C, on the legacy default stream, then wait for it.  Returns the bytes."""
    with _current().entered() as drv:
        nbytes, status = _native.call_plan(drv.memcpy_async, 0, plan.src_bases, plan.dst_bases, plan.src_offs,
                                           plan.dst_offs, plan.lens)
        sync: int = drv.cuStreamSynchronize(None)  # even after a failed run: earlier runs are in flight
    drv.check("cuMemcpyAsync", status)
    drv.check("cuStreamSynchronize", sync)
    return nbytes


def is_device_memory(addr: int) -> bool:
    """Whether ``addr`` points into CUDA device memory (not host, not unregistered)."""
    kind = ctypes.c_uint(0)
    with _current().entered() as drv:
        code = drv.cuPointerGetAttribute(ctypes.byref(kind), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)
    return code == 0 and kind.value == _CU_MEMORYTYPE_DEVICE


def export_regions(addrs: Iterable[SupportsInt], nbytes: int) -> tuple[IpcRegion, ...]:
    """IPC regions covering ``[a, a + nbytes)`` for every address in ``addrs`` (one per
    distinct allocation).  Empty if the memory cannot be exported (an allocator that maps
    memory with the virtual memory API, say): peers then go through the socket path."""
    regions: dict[int, IpcRegion] = {}
    try:
        with _current().entered() as drv:
            for a in sorted({int(x) for x in addrs}):
                if any(r.base <= a and a + nbytes <= r.base + r.size for r in regions.values()):
                    continue
                base, size = ctypes.c_uint64(), ctypes.c_size_t()
                drv.check("cuMemGetAddressRange",
                          drv.cuMemGetAddressRange(ctypes.byref(base), ctypes.byref(size), a))
                handle = _IpcHandle()
                drv.check("cuIpcGetMemHandle", drv.cuIpcGetMemHandle(ctypes.byref(handle), base.value))
                regions[base.value] = IpcRegion(handle.raw(), base.value, size.value)
    except CudaError as exc:
        log.info("device memory cannot be shared by CUDA IPC (%s); same-host peers use the socket path", exc)
        return ()
    return tuple(regions.values())


@dataclass
class PeerDeviceRegion(PeerSpan):
    """A same-host peer's device allocation opened here by CUDA IPC."""

    @classmethod
    def open(cls, region: IpcRegion) -> "PeerDeviceRegion":
        """Map a peer's exported allocation; raises :class:`CudaError` if it cannot."""
        local = ctypes.c_uint64()
        handle = _IpcHandle.of(region.handle)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with _current().entered() as drv:
            drv.check("cuIpcOpenMemHandle",
                      drv.cuIpcOpenMemHandle(ctypes.byref(local), handle, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
            code = drv.cuMemGetAddressRange(ctypes.byref(base), ctypes.byref(size), local.value)
            if code:
                drv.cuIpcCloseMemHandle(local.value)
                drv.check("cuMemGetAddressRange", code)
        # The peer announces its allocation's size; what the driver mapped here bounds every
        # copy through this region (a larger announcement would reach past the mapping).
        mapped = base.value + size.value - local.value
        return cls(region.base, local.value, max(0, min(region.size, mapped)))

    def close(self) -> None:
        if self.local_base:
            with _current().entered() as drv:
                code = drv.cuIpcCloseMemHandle(self.local_base)
            if code:
                log.debug("cuIpcCloseMemHandle: CUDA error %d", code)
            self.local_base = 0


class DeviceArena:
    """``size`` bytes of device memory for the ``mem_pool_cfg`` pool (a torch allocation,
    so torch's allocator accounts for it), with the IPC region that peers map."""

    def __init__(self, dev: CudaDevice, size: int) -> None:
        import torch

        try:
            self._tensor: Optional[torch.Tensor] = torch.empty(int(size), dtype=torch.uint8, device=dev.name)
        except torch.cuda.OutOfMemoryError as exc:
            fail(Fault.DEVICE_OUT_OF_MEMORY,
                        f"mem_pool_cfg memory_size = {size} bytes does not fit on {dev.name}: {exc}")
        self.base = self._tensor.data_ptr()
        self.size = int(size)
        self.device = dev.name
        self.regions = export_regions([self.base], self.size)

    def close(self) -> None:
        self._tensor = None


def pin(addr: int, size: int) -> bool:
    """Page-lock host memory (a pool arena) for fast copies.  True if this call pinned it
    (the caller then unpins it); False if the driver refused or someone else pinned it."""
    with _current().entered() as drv:
        code: int = drv.cuMemHostRegister(addr, size, _CU_MEMHOSTREGISTER_PORTABLE)
    if code and code != _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
        log.info("cuMemHostRegister of %d bytes failed (CUDA error %d); host copies stay pageable", size, code)
    return code == 0


def unpin(addr: int) -> None:
    with _current().entered() as drv:
        drv.cuMemHostUnregister(addr)


class _CudaBytes:
    """``nbytes`` of device memory at ``addr`` in the CUDA array interface (no copy)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (int(addr), False),
                                         "version": 3, "strides": None, "stream": None}


def cuda_tensor(addr: int, nbytes: int, device_name: str) -> torch.Tensor:
    """A ``uint8`` torch tensor over ``nbytes`` of device memory at ``addr`` (a view: the
    memory must outlive it)."""
    import torch

    t = torch.as_tensor(_CudaBytes(addr, nbytes), device=device_name)
    if t.data_ptr() != int(addr):  # torch copied instead of viewing: never hand that out
        fail(Fault.PARAM_INVALID, f"address {addr:#x} is not device memory of {device_name}")
    return t
