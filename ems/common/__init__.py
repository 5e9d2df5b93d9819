"""Pieces of the client API shared by every module: the contract's exception and codes."""
from .exception import EmsErrorCode, EmsException

__all__ = ["EmsErrorCode", "EmsException"]
