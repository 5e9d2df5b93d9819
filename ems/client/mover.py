"""How a value's bytes travel between this process and the pool, by transport.

On a unix socket the daemon passed the tenant's arena at HELLO: :class:`ArenaMover` copies
straight between the caller's memory and the mapped arena, summing the checksum during the
copy.  Over ``tcp://`` there is no shared memory: :class:`SocketMover` streams the same
plans through the connection (after a WRITE frame, or after the daemon's READ reply),
summing what it sends and receives; the daemon sums what it received and commits a value
only when the two sums agree, so a byte changed between client and daemon is caught on
either way.  :func:`mover_for` picks one for a connection, so the
calls above it never ask which transport they are on.
"""
from __future__ import annotations

from typing import Optional, Protocol

from datadist.engine.checksum import StreamSum

from .._errors import PoolDisconnected, PoolTimeout, ProtocolError, invalid
from ..kvcache import Copier, DeviceCopier, HostCopier, ValuePlan
from ..pool import payload, wire
from ..pool.checksum import BLOCK, checksum, from_block_sums
from .conn import Connection, MappedArena

__all__ = ["Mover", "ArenaMover", "SocketMover", "mover_for"]


class Mover(Protocol):
    """Moves one value at a time, for one call on one connection."""

    def save(self, vp: ValuePlan, off: int, deadline: Optional[float]) -> int:
        """Write the value ``vp`` describes into its reservation at ``off``; the checksum
        of the bytes it wrote (the daemon checks it against what it received, over TCP)."""

    def load(self, vp: ValuePlan, off: int, crc: int, deadline: Optional[float]) -> bool:
        """Read the leased value at ``off`` into the memory ``vp`` describes; False when it
        failed its checksum ``crc`` (a miss: the caller drops it)."""


class ArenaMover:
    """Copies through the mapped arena (``copier``: host or device memory); a load checks
    the checksum when ``verify``."""

    def __init__(self, copier: Copier, arena: MappedArena, verify: bool) -> None:
        array = arena.array
        if array is None:
            raise PoolDisconnected("the pool's arena is no longer mapped")
        self._copier = copier
        self._base = arena.base
        self._array = array
        self._verify = verify

    def save(self, vp: ValuePlan, off: int, deadline: Optional[float]) -> int:
        return self._move(vp, self._inside(vp, off), save=True)

    def load(self, vp: ValuePlan, off: int, crc: int, deadline: Optional[float]) -> bool:
        if not self._verify:
            self._copier.load(vp, self._base + self._inside(vp, off))
            return True
        return self._move(vp, self._inside(vp, off), save=False) == crc

    def _inside(self, vp: ValuePlan, off: int) -> int:
        """``off`` if the value's bytes there lie inside the arena: the daemon says where
        (RESERVE, GET), and no answer of another process moves bytes outside the mapping."""
        if not 0 <= off <= self._array.shape[0] - vp.size:
            raise ProtocolError(f"the pool placed a value of {vp.size} bytes at offset {off}, outside its arena "
                                f"of {self._array.shape[0]} bytes")
        return off

    def _move(self, vp: ValuePlan, off: int, *, save: bool) -> int:
        """Copy one value into (``save``) or out of the arena at ``off``; the checksum of
        the bytes moved (summed during the copy when the memory is the host's)."""
        copier = self._copier
        if isinstance(copier, HostCopier):
            sums = (copier.save_summed if save else copier.load_summed)(vp, self._base + off)
            return from_block_sums(sums, self._array[off + vp.size - vp.size % BLOCK:off + vp.size], vp.size)
        (copier.save if save else copier.load)(vp, self._base + off)
        return checksum(self._array[off:off + vp.size])


class SocketMover:
    """Streams the plans through the connection's socket (host memory only), summing what
    it sends and receives (:mod:`ems.pool.payload`); a load checks the checksum when
    ``verify``."""

    def __init__(self, conn: Connection, verify: bool) -> None:
        self._conn = conn
        self._verify = verify

    def save(self, vp: ValuePlan, off: int, deadline: Optional[float]) -> int:
        conn = self._conn
        conn.send(wire.Write(off, vp.size), deadline)
        summed = StreamSum(vp.size)
        try:
            for plan in vp.plans:
                payload.send_plan(conn.sock, plan, deadline, summed)
        except (PoolDisconnected, PoolTimeout):
            conn.broken = True
            raise
        return summed.checksum()

    def load(self, vp: ValuePlan, off: int, crc: int, deadline: Optional[float]) -> bool:
        conn = self._conn
        conn.send(wire.Read(off, vp.size), deadline)
        summed = StreamSum(vp.size) if self._verify else None
        try:
            head, _ = wire.recv_msg(conn.sock, deadline)
            if not isinstance(head, wire.ReadReply) or head.size != vp.size:
                raise PoolDisconnected("the pool answered READ unexpectedly")
            for plan in vp.plans:
                payload.recv_plan(conn.sock, plan.swapped(), deadline, summed)
        except (PoolDisconnected, PoolTimeout, ProtocolError):
            conn.broken = True
            raise
        return summed is None or summed.checksum() == crc


def mover_for(conn: Connection, copier: Copier, verify: bool, what: str) -> Mover:
    """The mover of ``conn``'s transport; device memory (``copier``) needs the arena, else
    ``InvalidArgument`` naming ``what`` (the argument that holds the memory)."""
    if conn.arena is not None:
        return ArenaMover(copier, conn.arena, verify)
    if isinstance(copier, DeviceCopier) and copier.device != "cpu":
        raise invalid(what, "device tensors need the shared-memory pool (unix socket), not a tcp:// address")
    return SocketMover(conn, verify)
