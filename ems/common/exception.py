"""The contract's exception: ``EmsException`` with an ``EmsErrorCode``.

Internally the package raises the typed errors of :mod:`ems._errors`; they become an
``EmsException`` in one place (:func:`ems._errors.to_ems`), so no call site builds its own.
"""
from __future__ import annotations

from enum import IntEnum

__all__ = ["EmsErrorCode", "EmsException"]


class EmsErrorCode(IntEnum):
    """Status codes of :class:`EmsException` (vendor SDK 25.7, section 9.1, and one of
    newer SDKs)."""

    EMS_INVALID_ARGUMENT = 1
    """A request argument is invalid: fix it and retry."""
    EMS_IO_ERROR = 2
    """The pool is down or the connection to it broke: isolate EMS until check_health passes."""
    EMS_IO_TIMEOUT = 3
    """The call's deadline (``CcKvOption.timeout``) passed: retry with a longer timeout."""
    EMS_INTERNAL_ERROR = 4
    """An SDK fault (or device memory could not be accessed)."""
    EMS_RECOVERD_ERROR = 5
    """Newer vendor SDKs' code (their spelling) for an ``init`` that may succeed once the
    pool recovers.  Defined so that clients which test for it run; never raised here: a
    pool that does not answer at ``init`` is ``EMS_IO_ERROR``."""

    def __str__(self) -> str:  # f"{code}" reads as the name, as in the vendor's messages
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)


class EmsException(Exception):
    """Raised by every public call; ``status_code()`` and ``message()`` are methods."""

    def __init__(self, status_code: EmsErrorCode, message: str = "") -> None:
        super().__init__(status_code, message)
        self._code = EmsErrorCode(status_code)
        self._message = str(message)

    def status_code(self) -> EmsErrorCode:
        """The :class:`EmsErrorCode` of this failure."""
        return self._code

    def message(self) -> str:
        """A human-readable account of the failure (argument name, address, deadline...)."""
        return self._message

    def __str__(self) -> str:
        return f"{self._code.name}: {self._message}"

    def __repr__(self) -> str:
        return f"EmsException({self._code.name}, {self._message!r})"

    def __reduce__(self) -> tuple[type[EmsException], tuple[int, str]]:
        return (EmsException, (int(self._code), self._message))
