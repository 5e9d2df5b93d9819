"""The client's connection pool to one daemon, and its mappings of the tenant's arena and
published key set.

Fork and thread rules: any thread may call :meth:`PoolClient.connection`; each gets a
connection of its own for the duration of the ``with`` block.  Connections are reused
while healthy; a connection that saw an error or a deadline is closed (the daemon then
releases its leases and reservations).  After ``fork`` the child opens its own connections
and mapping (inherited ones are dropped, never used).
"""
from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, List, Optional, Set

from datadist.engine.auth import Secret
from datadist.engine.tls import TlsConfig

from .._errors import PoolTimeout, PoolUnreachable
from ..pool import wire
from ..pool.keyset import KeySetView
from .address import Address, parse_address
from .autostart import start_daemon
from .conn import Connection, MappedArena

if TYPE_CHECKING:
    from ..forms import KeyQuery

__all__ = ["PoolClient"]

log = logging.getLogger("ems")


class PoolClient:
    """Connections to the daemon at ``server`` for one tenant."""

    def __init__(self, server: str, access_id: Optional[str], access_key: Optional[str],
                 connect_timeout_ms: int = 3000, max_idle: int = 8, secret: Optional[Secret] = None,
                 tls: Optional[TlsConfig] = None) -> None:
        self.address: Address = parse_address(server)
        self._access = (access_id, access_key)
        self._secret = secret
        self._tls = tls
        self.connect_timeout = connect_timeout_ms / 1000.0
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: List[Connection] = []
        self._busy: Set[Connection] = set()  # handed out by connection(), for interrupt()
        self._arena: Optional[MappedArena] = None
        self._keys: Optional[KeySetView] = None
        self._pid = os.getpid()
        self.instance: Optional[str] = None
        self.tenant: Optional[str] = None

    def open(self) -> None:
        """Connect once (starting a daemon for ``auto``); raises if the pool cannot be used."""
        deadline = time.monotonic() + self.connect_timeout
        try:
            conn = self._connect(deadline)
        except PoolUnreachable:
            directory = self.address.directory
            if not self.address.auto or directory is None:
                raise
            start_daemon(directory, time.monotonic() + max(self.connect_timeout, 10.0))
            conn = self._connect(time.monotonic() + self.connect_timeout)
        self._put(conn)

    def _connect(self, deadline: float) -> Connection:
        hello = wire.Hello(access_id=self._access[0], access_key=self._access[1], pid=os.getpid())
        conn = Connection(self.address, hello, deadline, self._secret, self._tls)
        fds = conn.take_fds()
        stale: List[Connection] = []
        try:
            with self._lock:
                if self.instance != conn.instance:
                    if self.instance is not None:
                        log.warning("the EMS pool at %s restarted: reconnected, values only its memory "
                                    "held are gone", self.address)
                    # A new daemon: forget the old one's connections, arena and key set.
                    stale, self._idle = self._idle, []
                    self._arena = None
                    self._keys = None
                    self.instance = conn.instance
                    self.tenant = conn.info.tenant
                if fds and self._arena is None:
                    try:  # (a daemon before sealed arenas: its arena could shrink under us)
                        arena = MappedArena(fds[0], conn.info.arena_size, conn.instance)
                    except (ValueError, OSError) as exc:
                        raise PoolUnreachable(f"the EMS pool at {self.address} passed an unusable "
                                              f"arena: {exc}") from None
                    self._arena = arena
                    try:
                        self._keys = KeySetView(fds[1], conn.info.keyset_size)
                    except (ValueError, OSError) as exc:
                        self._arena = None
                        raise PoolUnreachable(f"the EMS pool at {self.address} passed an unusable "
                                              f"key set: {exc}") from None
                conn.arena = self._arena if fds else None
                conn.keys = self._keys if fds else None
        except BaseException:
            conn.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        for c in stale:
            c.close()
        return conn

    def _put(self, conn: Connection) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle and conn.instance == self.instance:
                self._idle.append(conn)
                return
        conn.close()

    def _get(self, deadline: Optional[float]) -> Connection:
        self._after_fork()
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if not conn.closed and _alive(conn.sock):
                return conn
            conn.close()
        limit = time.monotonic() + self.connect_timeout
        if deadline is not None and deadline < limit:
            if deadline <= time.monotonic():
                raise PoolTimeout("deadline passed before a pool connection was available")
            limit = deadline
        return self._connect(limit)

    def _after_fork(self) -> None:
        if os.getpid() != self._pid:
            with self._lock:
                self._pid = os.getpid()
                self._idle = []  # the parent's sockets: never used, never closed here
                self._arena = None
                self._keys = None
                self.instance = None

    @contextmanager
    def connection(self, deadline: Optional[float]) -> Iterator[Connection]:
        """A connection for one call; closed instead of reused if the call failed."""
        conn = self._get(deadline)
        ok = False
        with self._lock:
            self._busy.add(conn)
        try:
            yield conn
            ok = not conn.broken
        finally:
            with self._lock:
                self._busy.discard(conn)
            if ok:
                self._put(conn)
            else:
                conn.close()

    def exists(self, keys: "KeyQuery", local_only: bool, deadline: Optional[float]) -> int:
        """How many leading ``keys`` the pool holds.  Memory's answer comes from the key set
        the daemon publishes (no round trip); the daemon is asked only when that set cannot
        answer, or about the keys memory lacks when it has tiers below memory."""
        with self.connection(deadline) as conn:  # taking it checks that the daemon is alive
            hits = keys.count_in(conn.keys) if conn.keys is not None else None
            if hits is not None:
                lower = conn.info.disk or (conn.info.remote and not local_only)
                if hits == len(keys) or not lower:
                    return hits
            else:
                hits = 0
            rest = keys.strings()[hits:]
            for start in range(0, len(rest), wire.MAX_KEYS):  # as many keys as one frame may list
                batch = rest[start:start + wire.MAX_KEYS]
                found = min(int(conn.call(wire.Exists(batch, local_only), deadline, wire.ExistsReply).hits),
                            len(batch))
                hits += found
                if found < len(batch):
                    break
            return hits

    def ping(self, timeout_s: float) -> bool:
        """Whether the daemon answers within ``timeout_s``."""
        try:
            deadline = time.monotonic() + timeout_s
            with self.connection(deadline) as conn:
                return isinstance(conn.call(wire.Ping(), deadline, wire.Pong), wire.Pong)
        except Exception:  # any failure means unhealthy; check_health never raises
            return False

    def interrupt(self) -> None:
        """Shut the connections calls are using: a call waiting on the daemon fails at once
        (shutdown, at process exit).  The calls close them."""
        with self._lock:
            busy = list(self._busy)
        for conn in busy:
            conn.interrupt()

    def close(self, unmap: bool = True) -> None:
        """Close every idle connection and (with ``unmap``; not while a call may still copy
        through it) drop the arena mapping (idempotent)."""
        with self._lock:
            idle, self._idle = self._idle, []
            arena, self._arena = (self._arena, None) if unmap else (None, self._arena)
            if unmap:
                self._keys = None
        for conn in idle:
            conn.close()
        if arena is not None:
            arena.close()


def _alive(sock: socket.socket) -> bool:
    """False if the daemon closed this idle connection (EOF or error pending)."""
    if isinstance(sock, ssl.SSLSocket):
        # No peeking through TLS: an idle connection has nothing to read, so anything
        # readable (the end, a TLS alert, stray bytes) means it is not reusable.
        return sock.pending() == 0 and not select.select([sock], [], [], 0)[0]
    try:
        sock.settimeout(0.0)  # with a timeout set, Python would wait on EAGAIN
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return bool(data)  # b"": EOF; unexpected bytes: out of sync, do not reuse
