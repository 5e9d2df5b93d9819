"""Internal error hierarchy and its single mapping to the contract's ``EmsException``.

Modules below the public surface raise these (or ``OSError`` / ``TimeoutError`` from the
operating system); :func:`to_ems` turns any of them into an ``EmsException`` at the edge.
"""
from __future__ import annotations

import socket

from datadist.engine.codec import WireError

from .common.exception import EmsErrorCode, EmsException

__all__ = [
    "EmsError", "InvalidArgument", "PoolUnreachable", "PoolDisconnected", "PoolTimeout",
    "PoolRejected", "ProtocolError", "to_ems", "invalid",
]


class EmsError(Exception):
    """Base of the package's internal errors."""

    code = EmsErrorCode.EMS_INTERNAL_ERROR


class InvalidArgument(EmsError, ValueError):
    """A caller's argument is invalid; the message names the argument."""

    code = EmsErrorCode.EMS_INVALID_ARGUMENT


class PoolUnreachable(EmsError):
    """No pool daemon answers at the configured address."""

    code = EmsErrorCode.EMS_IO_ERROR


class PoolDisconnected(EmsError):
    """The connection to the pool broke in the middle of a call."""

    code = EmsErrorCode.EMS_IO_ERROR


class PoolTimeout(EmsError):
    """A call's deadline passed while it waited on the pool."""

    code = EmsErrorCode.EMS_IO_TIMEOUT


class PoolRejected(EmsError):
    """The pool refused the request (unknown tenant, wrong key, bad request)."""

    code = EmsErrorCode.EMS_INVALID_ARGUMENT


class ProtocolError(EmsError, WireError):
    """The peer spoke another protocol version or sent a malformed message (the pool
    protocol's :class:`~datadist.engine.codec.WireError`: every decoding failure of
    :mod:`ems.pool.wire` raises it)."""

    code = EmsErrorCode.EMS_IO_ERROR


def invalid(name: str, why: str) -> InvalidArgument:
    """An :class:`InvalidArgument` whose message starts with the argument's name."""
    return InvalidArgument(f"invalid argument '{name}': {why}")


def to_ems(exc: BaseException) -> EmsException:
    """The contract's exception for any failure raised below the public surface."""
    if isinstance(exc, EmsException):
        return exc
    if isinstance(exc, EmsError):
        return EmsException(exc.code, str(exc))
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return EmsException(EmsErrorCode.EMS_IO_TIMEOUT, f"pool call timed out: {exc}")
    if isinstance(exc, (ConnectionError, EOFError, OSError)):
        return EmsException(EmsErrorCode.EMS_IO_ERROR, f"pool I/O failed: {exc}")
    return EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
