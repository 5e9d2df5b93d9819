"""Small value types of the client API: options, results, buffers, keys."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Union

from ._errors import invalid, to_ems

__all__ = ["CcKvOption", "CcResult", "KvBufferWrapper", "PrimaryKey", "MAX_KEY_CHARS", "NO_TIMEOUT_BOUND_MS",
           "call_deadline"]

#: A key (a V0 ``str`` key, or either part of a ``PrimaryKey``) is shorter than this.
MAX_KEY_CHARS = 128

#: What ``option.timeout = 0`` (the vendor's "no timeout") allows a call, in ms: a bound
#: far above any healthy call, so that a stalled daemon never holds a call, nor the
#: process's exit, forever.
NO_TIMEOUT_BOUND_MS = 10 * 60 * 1000


def call_deadline(timeout_ms: int) -> float:
    """When a call of ``option.timeout`` = ``timeout_ms`` must have ended
    (``time.monotonic``); 0 allows :data:`NO_TIMEOUT_BOUND_MS`."""
    return time.monotonic() + (timeout_ms or NO_TIMEOUT_BOUND_MS) / 1000.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CcKvOption:
    """Options of one save / load / exists call.

    Args:
        write_rcache: also keep a saved value in the node-local pool (default True).
        read_local_only: loads and exists consult only the node-local pool (default False).
        timeout: deadline of the whole call in milliseconds, ``>= 0``; 0 means none of the
            caller's: the call is then bounded by :data:`NO_TIMEOUT_BOUND_MS` (10 minutes).
    Raises:
        EmsException(EMS_INVALID_ARGUMENT) naming the field.  Fields may be reassigned
        (the vendor's retry sample raises ``option.timeout``); they are checked again at use.
    """

    __slots__ = ("write_rcache", "read_local_only", "timeout")

    def __init__(self, write_rcache: bool = True, read_local_only: bool = False,
                 timeout: int = 5000) -> None:
        self.write_rcache = write_rcache
        self.read_local_only = read_local_only
        self.timeout = timeout
        self.validate()

    def validate(self, name: str = "option") -> "CcKvOption":
        """Check the fields (they are public and mutable); returns self."""
        try:
            if not isinstance(self.write_rcache, bool):
                raise invalid(f"{name}.write_rcache", f"must be a bool, got {self.write_rcache!r}")
            if not isinstance(self.read_local_only, bool):
                raise invalid(f"{name}.read_local_only",
                              f"must be a bool, got {self.read_local_only!r}")
            if not _is_int(self.timeout) or self.timeout < 0:
                raise invalid(f"{name}.timeout", f"must be an int >= 0 (ms), got {self.timeout!r}")
        except Exception as exc:
            raise to_ems(exc) from None
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CcKvOption):
            return NotImplemented
        return (self.write_rcache, self.read_local_only, self.timeout) == (
            other.write_rcache, other.read_local_only, other.timeout)

    def __repr__(self) -> str:
        return (f"CcKvOption(write_rcache={self.write_rcache}, "
                f"read_local_only={self.read_local_only}, timeout={self.timeout})")


@dataclass(frozen=True)
class CcResult:
    """Outcome of a batch: ``success`` keys, counted from the first, succeeded in a row,
    out of ``total`` keys in the request."""

    success: int
    total: int

    def __str__(self) -> str:
        return f"CcResult(success={self.success}, total={self.total})"


DataPtr = Union[int, Callable[[], int]]


def _npu_process() -> bool:
    """Whether this process uses torch_npu with a device (never imports it)."""
    import sys

    if "torch_npu" not in sys.modules:
        return False
    try:
        return bool(sys.modules["torch"].npu.is_available())
    except Exception:  # a broken adapter: as careful as a working one
        return True


def _cuda_device_memory(addr: int) -> bool:
    """Whether the CUDA driver (where one is loaded by this process already) calls ``addr``
    device memory; never loads CUDA on a machine that has not used it."""
    import sys

    cuda = sys.modules.get("datadist.engine.cuda")
    if cuda is None or "torch" not in sys.modules or not sys.modules["torch"].cuda.is_initialized():
        return False
    try:
        return bool(cuda.is_device_memory(addr))
    except Exception:  # no usable driver: not device memory we could know of
        return False


def _is_tensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (never imports torch: a tensor exists only
    where torch was imported already)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


class _Tensor(Protocol):
    """What :meth:`KvBufferWrapper.locate` uses of the tensor whose bound ``data_ptr`` was
    given (a ``torch.Tensor``; torch is not imported here)."""

    @property
    def device(self) -> Any: ...

    def numel(self) -> int: ...

    def element_size(self) -> int: ...

    def is_contiguous(self) -> bool: ...

    @property
    def shape(self) -> Any: ...

    def stride(self) -> Any: ...

    def data_ptr(self) -> int: ...


class KvBufferWrapper:
    """A contiguous buffer of ``length`` bytes at ``data_ptr``.

    ``data_ptr`` is an address, or a callable returning one (the vendor sample passes the
    bound method ``tensor.data_ptr``); it is resolved when the buffer is used.
    """

    __slots__ = ("data_ptr", "length")

    def __init__(self, data_ptr: DataPtr, length: int) -> None:
        try:
            if not (callable(data_ptr) or (_is_int(data_ptr) and data_ptr > 0)):
                raise invalid("data_ptr", f"must be an address > 0 or tensor.data_ptr, got {data_ptr!r}")
            if not _is_int(length) or length <= 0:
                raise invalid("length", f"must be an int > 0, got {length!r}")
        except Exception as exc:
            raise to_ems(exc) from None
        self.data_ptr = data_ptr
        self.length = length

    def locate(self) -> tuple[int, str]:
        """The buffer's address (calls ``data_ptr`` if it is a method) and the memory it is
        in: ``"cpu"``, or the device of the tensor whose bound ``data_ptr`` was given
        (``cuda:N``, ``npu:N``; then copied to and from the pool by the torch executor).

        The tensor of a bound ``tensor.data_ptr`` (on any device, CPU included) bounds the
        buffer: ``length`` over its bytes, or a tensor that is not contiguous, is refused
        (``EMS_INVALID_ARGUMENT``), since a load would write past it or between its
        elements.  A bare address is host memory: on a CUDA machine one the driver reports
        as device memory, and in a process that uses an NPU any, are refused
        (``EMS_INVALID_ARGUMENT``) rather than read as host memory: pass the device
        tensor's ``data_ptr`` method instead."""
        owner: Optional[_Tensor] = getattr(self.data_ptr, "__self__", None)
        device = getattr(owner, "device", None)
        if owner is not None and _is_tensor(owner):
            self._check_tensor(owner)
        if owner is not None and device is not None and getattr(device, "type", "cpu") != "cpu":
            if device.type not in ("cuda", "npu"):
                raise invalid("data_ptr", f"is memory of {device}; this build moves host, CUDA and NPU buffers")
            if device.type == "npu":
                from datadist.engine import npu

                npu.track(owner)  # the torch executor reaches NPU memory through its tensors
            return int(owner.data_ptr()), str(device)
        ptr = self._resolve()
        if _cuda_device_memory(ptr):
            raise invalid("data_ptr", f"{ptr:#x} is a bare address of CUDA device memory; pass the tensor's "
                                      "data_ptr method (tensor.data_ptr) so its device is known")
        if not callable(self.data_ptr) and _npu_process():
            raise invalid("data_ptr", f"{ptr:#x} is a bare address in a process that uses an NPU, where it may be "
                                      "device memory; pass the tensor's data_ptr method (tensor.data_ptr)")
        return ptr, "cpu"

    def _check_tensor(self, owner: _Tensor) -> None:
        """The buffer lies within ``owner``, the tensor whose ``data_ptr`` was given:
        contiguous, and at least ``length`` bytes."""
        nbytes = owner.numel() * owner.element_size()
        if self.length > nbytes:
            raise invalid("length", f"{self.length} exceeds the {nbytes} bytes of the {owner.device} tensor "
                                    "whose data_ptr was given")
        if not owner.is_contiguous():
            raise invalid("data_ptr", f"is the data_ptr of a tensor that is not contiguous (shape "
                                      f"{tuple(owner.shape)}, stride {owner.stride()}): its bytes are "
                                      "not one buffer; pass tensor.contiguous()'s")

    def _resolve(self) -> int:
        """``data_ptr`` as an address > 0 (called if it is a callable)."""
        if callable(self.data_ptr):
            try:
                ptr = self.data_ptr()
            except Exception as exc:  # the caller's callable: its failure is a bad argument
                raise invalid("data_ptr", f"raised {type(exc).__name__}: {exc}") from None
        else:
            ptr = self.data_ptr
        if not _is_int(ptr) or ptr <= 0:
            raise invalid("data_ptr", f"resolved to {ptr!r}, not an address > 0")
        return ptr

    def __repr__(self) -> str:
        return f"KvBufferWrapper(data_ptr={self.data_ptr!r}, length={self.length})"


def check_key_text(name: str, value: object) -> str:
    """A key part: a non-empty ``str`` shorter than :data:`MAX_KEY_CHARS`, without NUL."""
    if not isinstance(value, str):
        raise invalid(name, f"must be a str, got {type(value).__name__}")
    if not 0 < len(value) < MAX_KEY_CHARS:
        raise invalid(name, f"must have 1..{MAX_KEY_CHARS - 1} characters, got {len(value)}")
    if "\x00" in value:
        raise invalid(name, "must not contain NUL")
    return value


class PrimaryKey:
    """A V0 key: values with the same ``distribute_key`` live on the same pool node."""

    __slots__ = ("distribute_key", "attribute_key")

    def __init__(self, distribute_key: str, attribute_key: str) -> None:
        try:
            check_key_text("distribute_key", distribute_key)
            check_key_text("attribute_key", attribute_key)
        except Exception as exc:
            raise to_ems(exc) from None
        self.distribute_key = distribute_key
        self.attribute_key = attribute_key

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PrimaryKey):
            return NotImplemented
        return (self.distribute_key, self.attribute_key) == (other.distribute_key, other.attribute_key)

    def __hash__(self) -> int:
        return hash((self.distribute_key, self.attribute_key))

    def __repr__(self) -> str:
        return f"PrimaryKey({self.distribute_key!r}, {self.attribute_key!r})"
