"""The client side of the pool protocol: addresses, connections, the connection pool, the
auto-started daemon and the movers of value bytes (:mod:`ems.client.mover`).  Users never
import this package; ``ems.ContextCaching`` does."""
from .address import Address, parse_address
from .conn import Connection, MappedArena, probe
from .pool import PoolClient

__all__ = ["Address", "parse_address", "Connection", "MappedArena", "probe", "PoolClient"]
