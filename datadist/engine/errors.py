"""The engine's own errors: what went wrong, as a :class:`Fault`, with a message.

The engine knows nothing of the public API's status codes or exception types: it raises
:class:`EngineError`, and the API layer turns each fault into its status code in one place
(``datadist._status``).  A fault's value is also what a status field of the link protocol
carries (:mod:`datadist.engine.wire`); those numbers are CANN's status codes, so a value
read from a peer maps onto a fault without a table, and an unknown one is ``FAILED``.
"""
from __future__ import annotations

from enum import IntEnum
from typing import NoReturn

__all__ = ["Fault", "EngineError", "fail"]

_BASE = 0x5010B000


class Fault(IntEnum):
    """Why an engine operation failed (``OK``: it did not)."""

    OK = 0
    FAILED = 0xFFFFFFFF
    CACHE_NOT_FOUND = _BASE + 2
    PARAM_INVALID = _BASE + 5
    NOT_LINKED = _BASE + 7
    ALREADY_LINKED = _BASE + 8
    LINK_FAILED = _BASE + 9
    DEVICE_OUT_OF_MEMORY = _BASE + 14
    FEATURE_NOT_ENABLED = _BASE + 25
    TIMEOUT = _BASE + 26
    LINK_BUSY = _BASE + 27
    OUT_OF_MEMORY = _BASE + 28

    @classmethod
    def of(cls, value: int) -> "Fault":
        """The fault a peer's status field names; a value this side does not know is
        ``FAILED``."""
        try:
            return cls(value)
        except ValueError:
            return cls.FAILED


class EngineError(RuntimeError):
    """An engine operation failed: ``fault`` says why, the message says with what."""

    def __init__(self, fault: Fault, message: str) -> None:
        super().__init__(message)
        self.fault = fault

    def __reduce__(self) -> tuple[type["EngineError"], tuple[Fault, str]]:
        return (type(self), (self.fault, str(self)))


def fail(fault: Fault, message: str) -> NoReturn:
    """Raise :class:`EngineError` for ``fault``."""
    raise EngineError(fault, message)

