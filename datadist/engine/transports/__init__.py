"""Transports execute a planned transfer over one link; see :mod:`.base` for the interface."""
from .base import RemoteCache, Transport
from .local import LocalTransport
from .shm import ShmTransport
from .tcp import TcpTransport

__all__ = ["RemoteCache", "Transport", "LocalTransport", "ShmTransport", "TcpTransport"]
