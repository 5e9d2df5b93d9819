"""One connection to the pool daemon, and the client's mapping of the tenant's arena.

Fork and thread rules: a :class:`Connection` is used by one thread at a time (the pool
hands it out and takes it back); a forked child must not use its parent's connections or
mapping (``PoolClient`` checks the pid and starts over).
"""
from __future__ import annotations

import os
import socket
import ssl
import time
from typing import Any, List, Optional, Tuple, Type, TypeVar, overload

import numpy as np

from datadist.engine.auth import Secret
from datadist.engine.handshake import ClientAuth
from datadist.engine.memory import SharedMapping
from datadist.engine.tls import TlsConfig

from .._errors import PoolDisconnected, PoolRejected, PoolTimeout, PoolUnreachable, ProtocolError
from ..pool import wire
from ..pool.keyset import KeySetView
from .address import Address, parse_address

__all__ = ["Connection", "MappedArena", "probe"]

R = TypeVar("R", bound=wire.Message)


class MappedArena(SharedMapping):
    """The tenant's arena memfd, mapped here: ``base`` is its address in this process,
    ``array`` the same bytes as numpy (``None`` once closed)."""

    def __init__(self, fd: int, size: int, instance: str) -> None:
        super().__init__(fd, size)
        self.instance = instance
        self.array: Optional[np.ndarray] = np.frombuffer(self.view(), dtype=np.uint8)

    def close(self) -> None:
        self.array = None  # a view: it would keep the mapping alive
        super().close()


class Connection:
    """A socket to the daemon after a successful HELLO."""

    def __init__(self, address: Address, hello: wire.Hello, deadline: float,
                 secret: Optional[Secret] = None, tls: Optional[TlsConfig] = None) -> None:
        self.address = address
        self.broken = False
        self.fds: List[int] = []  # from HELLO: the arena, then the key set
        self.arena: Optional[MappedArena] = None  # set by the pool (shared per daemon)
        self.keys: Optional[KeySetView] = None
        self._closed = False
        self.sock = _connect(address, deadline, tls)
        reply, fds = self._handshake(hello, secret, deadline)
        self.info = self._welcome(reply, fds)

    def _handshake(self, hello: wire.Hello, secret: Optional[Secret],
                   deadline: float) -> Tuple[wire.Message, List[int]]:
        """Send HELLO (after the pool secret's exchange, with a secret); the reply and the
        descriptors that came with it.  Closes the connection if that fails."""
        try:
            hello.shm = self.address.kind == "unix"
            if secret is not None:
                self._authenticate(self.sock, hello, secret, deadline)
            try:
                wire.send_msg(self.sock, hello, deadline)
            except PoolDisconnected:
                pass  # a daemon that refuses (busy) closes at once; its reason is still readable
            return wire.recv_msg(self.sock, deadline, want_fds=2 if hello.shm else 0)
        except PoolTimeout as exc:
            self.close()
            raise PoolTimeout(f"the EMS pool at {self.address} did not answer the handshake in time: {exc}") from None
        except (PoolDisconnected, ProtocolError) as exc:
            self.close()
            raise PoolUnreachable(f"the EMS pool at {self.address} did not complete the handshake: {exc}") from None
        except BaseException:
            self.close()
            raise

    def _welcome(self, reply: wire.Message, fds: List[int]) -> wire.HelloReply:
        """The HELLO reply, its descriptors kept (with shared memory: the arena and the key
        set); a refusal or anything else closes the connection and raises."""
        if not isinstance(reply, wire.HelloReply) or not reply.shm:
            for fd in fds:
                os.close(fd)
            fds = []
        if isinstance(reply, wire.Error):
            self.close()
            if reply.kind == wire.ErrorKind.AUTH:
                raise PoolRejected(f"the EMS pool at {self.address} rejected the credentials: {reply.message}")
            raise PoolUnreachable(f"the EMS pool at {self.address} refused the connection: {reply.message}")
        if not isinstance(reply, wire.HelloReply):
            self.close()
            raise PoolUnreachable(f"the EMS pool at {self.address} answered HELLO with {type(reply).__name__}")
        self.fds = fds
        if reply.shm and len(fds) != 2:
            self.close()
            raise PoolUnreachable(f"the EMS pool at {self.address} did not pass its arena and key set")
        return reply

    def _authenticate(self, sock: socket.socket, hello: wire.Hello, secret: Secret, deadline: float) -> None:
        """Prove to the pool, and have it prove, that both hold the secret, before the
        credentials and the arena are exchanged (:mod:`datadist.engine.handshake`)."""
        state = ClientAuth(secret, f"ems-client:{hello.access_id or ''}".encode(), b"ems-server")
        wire.send_msg(sock, wire.Hello(access_id=hello.access_id, nonce=state.nonce_hex), deadline)
        challenge, fds = wire.recv_msg(sock, deadline, want_fds=2)
        for fd in fds:  # a pool without the secret must not hand out memory; never keep any
            os.close(fd)
        proof = state.answer(challenge.nonce, challenge.proof) if isinstance(challenge, wire.Challenge) else None
        if proof is None:
            raise PoolRejected(f"the EMS pool at {self.address} did not prove it holds the pool secret "
                               "(wrong secret, or a pool without one)")
        hello.nonce, hello.proof = state.nonce_hex, proof

    @property
    def instance(self) -> str:
        return self.info.instance

    def take_fds(self) -> List[int]:
        """The descriptors from HELLO, arena then key set (the caller maps and closes them);
        empty without shared memory."""
        fds, self.fds = self.fds, []
        return fds

    @overload
    def call(self, msg: wire.Message, deadline: Optional[float]) -> wire.Message: ...

    @overload
    def call(self, msg: wire.Message, deadline: Optional[float], reply_type: Type[R]) -> R: ...

    def call(self, msg: wire.Message, deadline: Optional[float],
             reply_type: Type[wire.Message] = wire.Message) -> wire.Message:
        """Request/reply: the reply, a ``reply_type``.  A broken or timed-out connection, or
        one that answers with another type, is marked and must be closed."""
        try:
            wire.send_msg(self.sock, msg, deadline)
            reply, _ = wire.recv_msg(self.sock, deadline)
        except (PoolDisconnected, PoolTimeout, ProtocolError):
            self.broken = True
            raise
        if isinstance(reply, wire.Error):
            if reply.kind == wire.ErrorKind.INVALID:
                raise PoolRejected(f"the pool rejected {type(msg).__name__}: {reply.message}")
            raise PoolDisconnected(f"the pool failed {type(msg).__name__}: {reply.message}")
        if not isinstance(reply, reply_type):
            self.broken = True
            raise ProtocolError(f"the pool answered {type(msg).__name__} with {type(reply).__name__}")
        return reply

    def send(self, msg: wire.Message, deadline: Optional[float]) -> None:
        """One-way message (RELEASE, ABORT, WRITE)."""
        try:
            wire.send_msg(self.sock, msg, deadline)
        except (PoolDisconnected, PoolTimeout):
            self.broken = True
            raise

    def interrupt(self) -> None:
        """Shut the socket both ways from another thread: a wait on it ends at once (a
        ``close`` would not wake it); the thread using it then closes it."""
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the plain socket's, under TLS too
        except OSError:  # already closed or never connected: nothing waits on it
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        for fd in self.take_fds():
            os.close(fd)
        if not self._closed:
            self._closed = True
            self.sock.close()


def _dial(address: Address, timeout_s: float, tls: Optional[TlsConfig] = None) -> socket.socket:
    """A socket connected to ``address`` within ``timeout_s`` (``OSError`` if not; a
    ``TimeoutError`` when something listens but does not accept in time); over TCP with
    ``tls``, a TLS socket whose handshake is done (``ssl.SSLError``, an ``OSError``, when
    the daemon's certificate is not of the CA, or it refused ours)."""
    endpoint = address.endpoint()
    if isinstance(endpoint, tuple):
        sock = socket.create_connection(endpoint, timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is None:
            return sock
        try:
            return tls.connect(sock)
        except BaseException:
            sock.close()
            raise
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(endpoint)
    except BaseException:
        sock.close()
        raise
    return sock


def _connect(address: Address, deadline: float, tls: Optional[TlsConfig] = None) -> socket.socket:
    """:func:`_dial` before ``deadline``, its failures as the client's errors."""
    try:
        return _dial(address, max(0.001, deadline - time.monotonic()), tls)
    except (TimeoutError, socket.timeout) as exc:
        # Something listens but does not accept in time (a stalled daemon): a timeout,
        # which the vendor's retry sample retries, not an absent pool.
        raise PoolTimeout(f"the EMS pool at {address} did not accept a connection in time: {exc}") from None
    except ssl.SSLError as exc:
        raise PoolUnreachable(f"the EMS pool at {address} failed the TLS handshake ({exc.reason or exc}): "
                              "a daemon without TLS, or certificates of another CA") from None
    except OSError as exc:
        raise PoolUnreachable(f"no EMS pool answers at {address}: {exc}") from None


def probe(address: str, what: str = "ping", timeout_s: float = 3.0,
          access_id: Optional[str] = None, access_key: Optional[str] = None,
          tls: Optional[TlsConfig] = None) -> Any:
    """Ask a daemon for ``ping`` (its instance), ``stats`` (a dict) or ``shutdown``
    (over TCP with ``tls`` for a daemon with TLS).

    Needs no credentials: these requests are answered before HELLO.
    """
    addr = parse_address(address)
    deadline = time.monotonic() + timeout_s
    sock = _connect(addr, deadline, tls)
    try:
        msg = {"ping": wire.Ping(), "stats": wire.Stats(), "shutdown": wire.Shutdown()}[what]
        wire.send_msg(sock, msg, deadline)
        reply, _ = wire.recv_msg(sock, deadline)
    finally:
        sock.close()
    if isinstance(reply, wire.Error):
        raise PoolRejected(reply.message)
    if isinstance(reply, wire.StatsReply):
        return reply.stats
    if isinstance(reply, wire.Pong):
        return reply.instance
    return True


