"""``CcFuture``: the handle async_save / async_load return."""
from __future__ import annotations

import concurrent.futures
from typing import Optional

from .common.exception import EmsErrorCode, EmsException
from .types import CcResult

__all__ = ["CcFuture"]


class CcFuture:
    """Completion of one async call; exceptions travel through it as ``EmsException``."""

    __slots__ = ("_fut",)

    def __init__(self, fut: "concurrent.futures.Future[CcResult]") -> None:
        self._fut = fut

    def done(self) -> bool:
        """Whether the call finished (successfully or not); never blocks."""
        return self._fut.done()

    def result(self, timeout: Optional[float] = None) -> CcResult:
        """The call's :class:`CcResult`, waiting up to ``timeout`` seconds (None: no limit).

        Raises:
            EmsException: the call's own failure, or EMS_IO_TIMEOUT if ``timeout`` passes.
        """
        try:
            return self._fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                               f"async call not finished within {timeout} s") from None
        except concurrent.futures.CancelledError:
            raise EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, "async call was cancelled") from None

    def __repr__(self) -> str:
        return f"<CcFuture {'done' if self._fut.done() else 'pending'}>"
