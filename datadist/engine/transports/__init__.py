"""Transports: how the bytes of a planned transfer move over one link.

Each module is one transport, both halves: the connect half (a :class:`~.base.Transport`
the initiating end runs) and the serve half (what the peer's agent runs for a request that
arrives by it).  They talk to the peer through the link's :class:`~.base.Channel`.
:func:`load` imports a transport's module the first time it is named, so a process that
never uses a collective backend never imports ``torch.distributed``'s side of it.
"""
from __future__ import annotations

import importlib

from .base import Channel, RemoteCache, Transport

__all__ = ["Channel", "RemoteCache", "Transport", "NAMES", "load"]

#: Transport name -> ``module:class`` in this package.
_REGISTRY = {
    "local": "local:LocalTransport",
    "shm": "shm:ShmTransport",
    "tcp": "tcp:TcpTransport",
    "collective": "collective:CollectiveTransport",
}
NAMES = tuple(_REGISTRY)


def load(name: str) -> type[Transport]:
    """The transport class called ``name`` (one of :data:`NAMES`); ``KeyError`` otherwise."""
    module, cls = _REGISTRY[name].split(":")
    found: type[Transport] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    return found
