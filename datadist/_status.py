"""Status codes and the one exception type of the public API (SPEC-datadist section 1).

Every failure of a library call is an :class:`LLMException` carrying an
:class:`LLMStatusCode`; argument *type* errors are plain ``TypeError``. Out-of-domain values
raise :class:`ParamInvalidError`, which is both an ``LLMException(LLM_PARAM_INVALID)`` and a
``ValueError``, so code written against either ``llm_datadist`` (``ValueError``) or the
SPEC (``LLMException``) catches it.

Library code raises through :func:`raise_error`; :func:`status_of` maps any exception back
to a status code (per-cluster results, async task results).  The engine raises its own
:class:`~datadist.engine.errors.EngineError`; this module is the one place that turns an
engine fault into a status code (:func:`status_code_of_fault`) and an engine error into
the contract's exception (:func:`translated`, :func:`api_errors`).
"""
from __future__ import annotations

import functools
from enum import IntEnum
from typing import Any, Callable, NoReturn, ParamSpec, TypeVar, Union

from .engine.errors import EngineError, Fault

__all__ = [
    "LLMStatusCode",
    "LLMException",
    "ParamInvalidError",
    "Status",
    "raise_error",
    "status_of",
    "to_status_code",
    "status_code_of_fault",
    "translated",
    "api_errors",
    "api_class",
]

_BASE = 0x5010B000


class LLMStatusCode(IntEnum):
    """Status codes, with the values (and member order) of CANN's ``llm_datadist``.

    ``LLM_DEVICE_MEM_ERROR`` and ``LLM_SUSPECT_REMOTE_ERROR`` are the ACL runtime's
    ``ACL_ERROR_RT_DEVICE_MEM_ERROR`` (507053) and ``ACL_ERROR_RT_SUSPECT_REMOTE_ERROR``
    (507057), which CANN passes through; this library does not raise them itself.
    ``str()`` (and an f-string) of a member is ``"LLMStatusCode.NAME"``, as in CANN.
    """

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_PARAM_INVALID = _BASE + 5
    LLM_WAIT_PROCESS_TIMEOUT = _BASE + 1
    LLM_KV_CACHE_NOT_EXIST = _BASE + 2
    LLM_REPEAT_REQUEST = _BASE + 3
    LLM_REQUEST_ALREADY_COMPLETED = _BASE + 4
    LLM_ENGINE_FINALIZED = _BASE + 6
    LLM_NOT_YET_LINK = _BASE + 7
    LLM_ALREADY_LINK = _BASE + 8
    LLM_LINK_FAILED = _BASE + 9
    LLM_UNLINK_FAILED = _BASE + 10
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _BASE + 11
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _BASE + 12
    LLM_PROCESSING_LINK = _BASE + 13
    LLM_DEVICE_OUT_OF_MEMORY = _BASE + 14
    LLM_PREFIX_ALREADY_EXIST = _BASE + 15
    LLM_PREFIX_NOT_EXIST = _BASE + 16
    LLM_SEQ_LENOVERLIMIT = _BASE + 17
    LLM_NO_FREE_BLOCK = _BASE + 18
    LLM_BLOCKS_OUT_OF_MEMORY = _BASE + 19
    LLM_EXIST_LINK = _BASE + 24
    LLM_FEATURE_NOT_ENABLED = _BASE + 25
    LLM_TIMEOUT = _BASE + 26
    LLM_LINK_BUSY = _BASE + 27
    LLM_OUT_OF_MEMORY = _BASE + 28
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


def to_status_code(value: Union[int, LLMStatusCode]) -> LLMStatusCode:
    """The status code with this integer value; an unknown value is ``LLM_FAILED``
    (as CANN maps codes it does not know). ``TypeError`` for a non-int."""
    if isinstance(value, LLMStatusCode):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"status code must be an int or LLMStatusCode, got {type(value).__name__}")
    try:
        return LLMStatusCode(value)
    except ValueError:
        return LLMStatusCode.LLM_FAILED


class LLMException(RuntimeError):
    """A failed library call. ``status_code`` says why.  The library always gives one; an
    exception made without it reports ``LLM_SUCCESS``, CANN's default."""

    def __init__(self, *args: object, status_code: Union[int, LLMStatusCode] = LLMStatusCode.LLM_SUCCESS):
        super().__init__(*args)
        self._status_code = to_status_code(status_code)

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def __reduce__(self) -> Any:
        # The keyword-only status code is not in self.args, so the default exception
        # pickling (cls(*args)) would lose it; exceptions cross process boundaries in
        # multiprocess deployments and tests.
        return (_restore_exception, (type(self), self.args, int(self._status_code)), self.__dict__ or None)


class ParamInvalidError(LLMException, ValueError):
    """An out-of-domain argument or option value: ``LLMException(LLM_PARAM_INVALID)`` that
    is also a ``ValueError``."""

    def __init__(self, *args: object, status_code: Union[int, LLMStatusCode] = LLMStatusCode.LLM_PARAM_INVALID):
        super().__init__(*args, status_code=status_code)


def _restore_exception(cls: type[LLMException], args: tuple[object, ...], code: int) -> LLMException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc._status_code = to_status_code(code)
    return exc


class Status:
    """Result of an operation that reports instead of raising."""

    __slots__ = ("_status_code",)

    def __init__(self, status_code: Union[int, LLMStatusCode] = LLMStatusCode.LLM_SUCCESS):
        self._status_code = to_status_code(status_code)

    def is_ok(self) -> bool:
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Status):
            return self._status_code == other._status_code
        return NotImplemented

    def __hash__(self) -> int:
        return hash((Status, self._status_code))

    def __repr__(self) -> str:
        return f"Status({self._status_code.name})"


def raise_error(code: Union[int, LLMStatusCode], message: str) -> NoReturn:
    """Raise the contract's exception for ``code``: :class:`ParamInvalidError` for
    ``LLM_PARAM_INVALID``, :class:`LLMException` otherwise. ``message`` should say what was
    wrong and with which values."""
    code = to_status_code(code)
    if code == LLMStatusCode.LLM_PARAM_INVALID:
        raise ParamInvalidError(message)
    raise LLMException(message, status_code=code)


def status_of(exc: BaseException) -> LLMStatusCode:
    """The status code that reports ``exc``: its own for an :class:`LLMException`,
    ``LLM_TIMEOUT`` for a ``TimeoutError``, ``LLM_OUT_OF_MEMORY`` for a ``MemoryError``,
    ``LLM_PARAM_INVALID`` for ``TypeError``/``ValueError``, else ``LLM_FAILED``."""
    if isinstance(exc, LLMException):
        return exc.status_code
    if isinstance(exc, EngineError):
        return status_code_of_fault(exc.fault)
    if isinstance(exc, TimeoutError):
        return LLMStatusCode.LLM_TIMEOUT
    if isinstance(exc, MemoryError):
        return LLMStatusCode.LLM_OUT_OF_MEMORY
    if isinstance(exc, (TypeError, ValueError)):
        return LLMStatusCode.LLM_PARAM_INVALID
    return LLMStatusCode.LLM_FAILED


_FAULTS: dict[Fault, LLMStatusCode] = {
    Fault.OK: LLMStatusCode.LLM_SUCCESS,
    Fault.FAILED: LLMStatusCode.LLM_FAILED,
    Fault.CACHE_NOT_FOUND: LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    Fault.PARAM_INVALID: LLMStatusCode.LLM_PARAM_INVALID,
    Fault.NOT_LINKED: LLMStatusCode.LLM_NOT_YET_LINK,
    Fault.ALREADY_LINKED: LLMStatusCode.LLM_ALREADY_LINK,
    Fault.LINK_FAILED: LLMStatusCode.LLM_LINK_FAILED,
    Fault.DEVICE_OUT_OF_MEMORY: LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
    Fault.FEATURE_NOT_ENABLED: LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
    Fault.TIMEOUT: LLMStatusCode.LLM_TIMEOUT,
    Fault.LINK_BUSY: LLMStatusCode.LLM_LINK_BUSY,
    Fault.OUT_OF_MEMORY: LLMStatusCode.LLM_OUT_OF_MEMORY,
}


def status_code_of_fault(fault: Fault) -> LLMStatusCode:
    """The status code that reports an engine fault."""
    return _FAULTS[fault]


def translated(exc: EngineError) -> LLMException:
    """The contract's exception for an engine error, with its message and traceback."""
    code = _FAULTS[exc.fault]
    cls = ParamInvalidError if code == LLMStatusCode.LLM_PARAM_INVALID else LLMException
    return cls(str(exc), status_code=code).with_traceback(exc.__traceback__)


_P = ParamSpec("_P")
_R = TypeVar("_R")
_C = TypeVar("_C", bound=type)


def api_errors(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a public entry point: an :class:`EngineError` escaping it surfaces as the
    contract's exception (:func:`translated`)."""

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except EngineError as exc:
            raise translated(exc) from None

    return call


def api_class(cls: _C) -> _C:
    """Apply :func:`api_errors` to every public method ``cls`` defines: the boundary
    between the API layer and the engine, declared once per class."""
    for name, attr in list(vars(cls).items()):
        if name.startswith("_") or isinstance(attr, type):
            continue
        if isinstance(attr, (staticmethod, classmethod)):
            setattr(cls, name, type(attr)(api_errors(attr.__func__)))
        elif isinstance(attr, property):
            setattr(cls, name, property(attr.fget and api_errors(attr.fget), attr.fset and api_errors(attr.fset),
                                        attr.fdel, attr.__doc__))
        elif callable(attr):
            setattr(cls, name, api_errors(attr))
    return cls
