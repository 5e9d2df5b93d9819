"""The client side of the pool protocol: addresses, connections, the connection pool and
the auto-started daemon.  Users never import this package; ``ems.ContextCaching`` does."""
from .address import Address, parse_address
from .conn import Connection, MappedArena, probe
from .pool import PoolClient

__all__ = ["Address", "parse_address", "Connection", "MappedArena", "probe", "PoolClient"]
