"""One client connection of ``ems-server``: HELLO (version, then credentials, or a pool
secret's challenge first), then requests answered in order until it closes.

Every peer byte is hostile until HELLO succeeds: a frame before it is at most
:data:`PRE_HELLO_FRAME` bytes and must arrive whole within ``read_timeout``; the
dispatcher (:mod:`.dispatch`) hands a session to a worker only once its request has
arrived (:meth:`Session.request_waiting`), and shuts down one that has not said HELLO
within ``read_timeout``.  On the unix socket the HELLO reply carries the tenant's arena
memfd and key set (read-only for the client), so afterwards only small control messages
cross the socket.
"""
from __future__ import annotations

import logging
import os
import socket
import ssl
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from .._errors import EmsError, PoolDisconnected, PoolTimeout, ProtocolError
from ..pool import payload, wire
from ..pool.wire import (Abort, Ack, Challenge, Commit, CommitReply, Drop, Error, Exists, ExistsReply, Get,
                         GetReply, Hello, HelloReply, Ping, Pong, Read, ReadReply, Release, Reserve,
                         ReserveReply, Shutdown, Stats, StatsReply, Write)
from datadist.engine.auth import Secret
from datadist.engine.codec import HEADER_SIZE
from datadist.engine import native, tls
from datadist.engine.handshake import REFUSAL, ServerAuth
from datadist.engine.incoming import RateLimitedLog

from .config import ServerConfig
from .inbox import Inbox
from .metrics import ServerMetrics
from .store import Owner, Store, TenantSpace
from .tenants import AuthError, Tenants

__all__ = ["Session", "SessionHost", "PRE_HELLO_FRAME", "MAX_KEY_CHARS"]

log = logging.getLogger("ems.server")

#: A request's answer: a message, or None when none is sent (one-way requests).
Reply = Optional[wire.Message]
#: Longest key a request may name: a stored key then costs at most about what its value's
#: smallest page does, so what keys hold stays in proportion to ``--capacity``.
MAX_KEY_CHARS = 4096


class SessionHost(Protocol):
    """What a session uses of its daemon (:class:`~.daemon.Daemon`)."""

    @property
    def cfg(self) -> ServerConfig: ...

    @property
    def store(self) -> Optional[Store]: ...

    @property
    def tenants(self) -> Tenants: ...

    @property
    def secret(self) -> Optional[Secret]: ...

    @property
    def instance(self) -> str: ...

    @property
    def metrics(self) -> ServerMetrics: ...

    @property
    def refusals(self) -> RateLimitedLog: ...

    @property
    def stopped(self) -> threading.Event: ...

    def stop(self) -> None: ...

    def stats(self) -> Dict[str, Any]: ...

    def session_ended(self, session: "Session", aborted: int) -> None: ...


#: Largest frame accepted before HELLO succeeds (a HELLO is a few hundred bytes).
PRE_HELLO_FRAME = 64 << 10


#: Frames up to this size are dispatched only once whole (a socket buffer holds them);
#: larger ones (long key lists of authenticated tenants) once their header is in.  Every
#: frame allowed before HELLO fits: a stranger's request never holds a worker waiting.
_WHOLE_FRAME_MAX = PRE_HELLO_FRAME + HEADER_SIZE


class Session:
    """One client connection: HELLO, then requests answered in order until it closes.
    The dispatcher calls :meth:`serve_one` whenever a request starts to arrive."""

    def __init__(self, daemon: SessionHost, sock: socket.socket, unix: bool) -> None:
        self.d = daemon
        self.sock = sock
        self.unix = unix
        #: When the connection was taken (a stranger has ``read_timeout`` from then to say HELLO).
        self.accepted = time.monotonic()
        self.space: Optional[TenantSpace] = None
        self.owner: Optional[Owner] = None
        self._fds: Tuple[int, ...] = ()  # descriptors to pass with the next reply
        self._done = False
        self._end_lock = threading.Lock()
        self._auth: Optional[ServerAuth] = None  # a pool secret's challenge, once sent
        #: A TLS session whose handshake is not done yet.
        self.handshaking = isinstance(sock, ssl.SSLSocket)
        self._inbox = Inbox()
        #: A WRITE whose bytes are still arriving, and what publishes them once they have.
        self._arriving: Optional[Tuple[payload.Arriving, Callable[[], None]]] = None
        #: An answer (a READ's value behind it) that the client has not taken all of yet.
        self._leaving: Optional[payload.Leaving] = None

    @property
    def greeted(self) -> bool:
        return self.space is not None

    def kick(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    @property
    def receiving(self) -> bool:
        """Whether a WRITE's bytes have stopped arriving for now, or an answer's stopped
        leaving (set aside until they move again: :meth:`request_waiting` says when)."""
        return self._arriving is not None or self._leaving is not None

    @property
    def answering(self) -> bool:
        """Whether an answer has stopped leaving for now (the client has not read it all)."""
        return self._leaving is not None

    def settle(self, until: float) -> None:
        """Send the rest of an answer set aside, waiting for the client to take it, at most
        until ``until`` (a stopping daemon lets the answers in flight finish)."""
        while self._leaving is not None and self._leaving.wait(until):
            if not self.serve_one():
                return

    def serve_one(self) -> bool:
        """Read and answer one request, or move more of a WRITE's or an answer's bytes;
        False when the session is over."""
        if self._arriving is not None or self._leaving is not None:
            try:
                if self._arriving is not None:
                    self._take_payload()
                else:
                    self._give()
            except (OSError, PoolDisconnected, PoolTimeout):
                return False
            return True
        msg = self._receive()
        if msg is None:
            return False
        try:
            reply = self._answer(msg)
        except (OSError, PoolDisconnected, PoolTimeout):  # payload stopped flowing (peer gone, read_timeout)
            return False
        if reply is None:
            return True
        fds, self._fds = self._fds, ()
        sent = self._reply(reply, fds)
        if isinstance(msg, Shutdown) and isinstance(reply, Ack):
            self.d.stop()  # after the answer: the caller must never see its stop as a failure
        # No second try at HELLO on this connection.
        return sent and not (self.space is None and isinstance(reply, Error))

    def request_waiting(self) -> Optional[bool]:
        """Whether the next request has arrived whole, so a worker that takes it never
        waits on the peer; False while part of it has, None when nothing has.  True too
        for an end of stream or a header :meth:`_receive` refuses (it ends the session
        then).  A frame the socket's buffer shows whole stays there for :meth:`_receive`;
        a larger one, and every frame of a TLS session (after its handshake, taken here a
        step at a time), is gathered by the session's :class:`~.inbox.Inbox` as it arrives."""
        if self._arriving is not None:
            return self._arriving[0].waiting()
        if self._leaving is not None:
            return self._leaving.waiting()
        max_frame = wire.MAX_FRAME if self.greeted else PRE_HELLO_FRAME
        if isinstance(self.sock, ssl.SSLSocket):
            if self.handshaking and not self._handshake_done():
                return False
            return self._inbox.gather(self.sock, max_frame)
        if self._inbox.started:
            return self._inbox.gather(self.sock, max_frame)
        # In C: this runs before every request (two Python peeks, each with its poll and
        # GIL hand-off, were the daemon's dearest calls per small request).
        state = native.frame_arrived(self.sock.fileno(), _WHOLE_FRAME_MAX)
        if state == native.FRAME_LARGE:
            return self._inbox.gather(self.sock, max_frame)
        if state == native.FRAME_PART:
            return self._refused_header(max_frame)
        return None if state == native.FRAME_NONE else True

    def _refused_header(self, max_frame: int) -> bool:
        """Whether the frame of which part has arrived has a header :meth:`_receive` would
        refuse (a stranger's bad frame is answered at once, not after ``read_timeout``)."""
        try:
            head = self.sock.recv(HEADER_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            if len(head) == HEADER_SIZE:
                wire.frame_size(head, max_frame)
            return False
        except BlockingIOError:
            return False
        except (OSError, ProtocolError):
            return True

    def _handshake_done(self) -> bool:
        """One step of the TLS handshake: True once it is over (done, or failed: the
        session ends at its next request)."""
        assert isinstance(self.sock, ssl.SSLSocket)
        try:
            if tls.handshake_step(self.sock):
                return False
        except OSError as exc:  # ssl.SSLError: no certificate, one of another CA, not TLS
            self.d.refusals.warning("refused a TLS connection: %s", exc)
            self._inbox.broken = exc
        self.handshaking = False
        return True

    def _receive(self) -> Optional[wire.Message]:
        """The next request, or None when the session is over (a bad frame is answered
        first): gathered already, or read whole (it is in the socket's buffer; within
        ``read_timeout`` all the same)."""
        try:
            if self._inbox.broken is not None:
                raise self._inbox.broken
            if self._inbox.started or isinstance(self.sock, ssl.SSLSocket):
                return self._inbox.take()
            msg, _ = wire.recv_msg(self.sock, time.monotonic() + self.d.cfg.read_timeout,
                                   max_frame=wire.MAX_FRAME if self.greeted else PRE_HELLO_FRAME)
            return msg
        except ProtocolError as exc:
            self.d.refusals.warning("closed a connection that sent a bad frame: %s", exc)
            self.d.metrics.refused("bad_frame")
            self._reply(Error(wire.ErrorKind.INVALID, str(exc)))
        except (OSError, PoolDisconnected, PoolTimeout):
            pass
        return None

    def _answer(self, msg: wire.Message) -> Reply:
        """:meth:`_reply_to`, counted by operation and outcome (``ok``, the kind of the
        error answered, or ``disconnected`` when the payload stopped flowing)."""
        start = time.monotonic()
        outcome = "disconnected"
        try:
            reply = self._reply_to(msg)
            outcome = wire.ErrorKind(reply.kind).name.lower() if isinstance(reply, Error) else "ok"
            return reply
        finally:
            self.d.metrics.request(type(msg).__name__.lower(), outcome, start)

    def _reply_to(self, msg: wire.Message) -> Reply:
        """:meth:`_handle`, with a failed request answered by an :class:`Error` (a payload
        that stopped flowing still raises: the session is over)."""
        try:
            return self._handle(msg)
        except (OSError, PoolDisconnected, PoolTimeout):
            raise
        except (EmsError, ValueError, TypeError, KeyError) as exc:
            return Error(wire.ErrorKind.INVALID, f"{type(msg).__name__}: {exc}")
        except Exception as exc:  # a bug must not take the daemon down; it is logged
            log.exception("request %s failed", type(msg).__name__)
            return Error(wire.ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")

    def end(self) -> None:
        """Release the session's leases and reservations and close it (idempotent)."""
        with self._end_lock:
            if self._done:
                return
            self._done = True
        store, aborted = self.d.store, 0
        if self.owner is not None and store is not None:
            aborted = len(self.owner.reservations)
            store.close_owner(self.owner)
        try:
            self.sock.close()
        except OSError:
            pass
        self.d.session_ended(self, aborted)

    def _reply(self, msg: wire.Message, fds: Sequence[int] = ()) -> bool:
        """Send an answer (``fds`` with its first bytes); False when the connection broke.
        One that the client does not take at once is left to :meth:`_give` (the session
        is set aside meanwhile)."""
        try:
            self._send([wire.encode(msg)], fds)
            return True
        except (OSError, PoolDisconnected, PoolTimeout):
            return False

    def _send(self, parts: "list[bytes | memoryview]", fds: Sequence[int] = ()) -> None:
        """Send ``parts`` within ``read_timeout``, as far as the client takes them now; the
        rest is left to :meth:`_give`."""
        self._leaving = payload.Leaving(self.sock, parts, time.monotonic() + self.d.cfg.read_timeout, fds)
        self._give()

    def _give(self) -> None:
        assert self._leaving is not None
        if self._leaving.give():
            self._leaving = None

    def _operator(self) -> bool:
        """Whether the peer is the daemon's own user or root, on the unix socket (the
        kernel's SO_PEERCRED says who connected; TCP peers are never operators)."""
        if not self.unix:
            return False
        creds = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid in (0, os.getuid())

    def _handle(self, msg: wire.Message) -> Reply:
        """The answer to ``msg`` (None: none is sent): HELLO, a session-level request
        (:data:`_SESSION_OPS`), or one of the tenant's once HELLO has admitted it
        (:data:`_TENANT_OPS`)."""
        store = self.d.store
        if store is None:
            return Error(wire.ErrorKind.INTERNAL, "shutting down")
        if isinstance(msg, Hello):
            return self._hello(msg)
        if self.d.secret is not None and self.space is None and not self._operator():
            return Error(wire.ErrorKind.AUTH, REFUSAL)  # with a secret, strangers get nothing, not even a ping
        session_op = _SESSION_OPS.get(type(msg))
        if session_op is not None:
            return session_op(self, msg)
        if self.space is None or self.owner is None:  # set together by HELLO
            raise ProtocolError("HELLO first")
        handler = _TENANT_OPS.get(type(msg))
        if handler is None:
            raise ProtocolError(f"unexpected {type(msg).__name__}")
        return handler(self, store, self.owner, self.space, msg)

    # -- session-level requests (before HELLO too), one method each -------------------------
    def _ping(self, msg: Ping) -> Reply:
        return Pong(self.d.instance)

    def _stats(self, msg: Stats) -> Reply:
        if not self.d.tenants.open and not self._operator():
            return Error(wire.ErrorKind.AUTH, "with tenant credentials, statistics are for the daemon's own user "
                                                 "on its unix socket")
        return StatsReply(self.d.stats())

    def _shutdown(self, msg: Shutdown) -> Reply:
        if not self._operator():
            return Error(wire.ErrorKind.AUTH, "shutdown is accepted only from the daemon's own user (or root) "
                                                 "on its unix socket")
        return Ack()  # the daemon stops once this answer is out (serve_one)

    # -- the tenant's requests (after HELLO), one method each ------------------------------
    def _exists(self, store: Store, owner: Owner, ts: TenantSpace, msg: Exists) -> Reply:
        return ExistsReply(store.exists(ts, _keys(msg.keys), bool(msg.local_only)))

    def _get(self, store: Store, owner: Owner, ts: TenantSpace, msg: Get) -> Reply:
        lease, entries = store.get(owner, ts, _keys(msg.keys), bool(msg.local_only))
        return GetReply(lease, [e.off for e in entries], [e.size for e in entries], [e.checksum for e in entries])

    def _release(self, store: Store, owner: Owner, ts: TenantSpace, msg: Release) -> Reply:
        store.release(owner, int(msg.lease))
        return None

    def _reserve(self, store: Store, owner: Owner, ts: TenantSpace, msg: Reserve) -> Reply:
        keys, sizes = _keys(msg.keys), [int(s) for s in msg.sizes]
        if len(sizes) != len(keys) or any(s < 0 for s in sizes):
            raise ValueError("sizes must be one int >= 0 per key")
        return ReserveReply(store.reserve(owner, ts, keys, sizes, bool(msg.skip_existing)))

    def _commit(self, store: Store, owner: Owner, ts: TenantSpace, msg: Commit) -> Reply:
        keys, offs = _keys(msg.keys), [int(o) for o in msg.offsets]
        # No checksums: the store takes those it summed receiving the bytes (a WRITE).
        crcs: List[Optional[int]] = list(msg.checksums) if msg.checksums else [None] * len(keys)
        if not (len(keys) == len(offs) == len(crcs)):
            raise ValueError("keys, offsets and checksums differ in length")
        return CommitReply(store.commit(owner, ts, keys, offs, crcs, bool(msg.keep_local), mapped=self.unix))

    def _abort(self, store: Store, owner: Owner, ts: TenantSpace, msg: Abort) -> Reply:
        store.abort(owner, ts, [int(o) for o in msg.offsets])
        return None

    def _drop(self, store: Store, owner: Owner, ts: TenantSpace, msg: Drop) -> Reply:
        store.drop(ts, _keys(msg.keys), [int(o) for o in msg.offsets])
        return Ack()

    def _write(self, store: Store, owner: Owner, ts: TenantSpace, msg: Write) -> Reply:
        off, size = int(msg.offset), int(msg.size)
        if not store.writing(owner, ts, off, size):
            return Error(wire.ErrorKind.INVALID, "WRITE outside this connection's reservations")
        # Summed as it arrives: COMMIT then only compares.  Bytes that stop arriving set
        # the session aside (no worker waits for them) until more do.
        arriving = payload.Arriving(self.sock, ts.arena.view(off, size), time.monotonic() + self.d.cfg.read_timeout)
        self._arriving = arriving, lambda: store.received(owner, ts, off, arriving.summed.checksum())
        self._take_payload()
        return None

    def _take_payload(self) -> None:
        assert self._arriving is not None
        arriving, publish = self._arriving
        if arriving.take():
            self._arriving = None
            publish()

    def _read(self, store: Store, owner: Owner, ts: TenantSpace, msg: Read) -> Reply:
        off, size = int(msg.offset), int(msg.size)
        if not store.leased(owner, ts, off, size):
            return Error(wire.ErrorKind.INVALID, "READ outside this connection's leases")
        # No worker waits for a reader that stops reading; one that has not read it all
        # within read_timeout is cut off.
        self._send([wire.encode(ReadReply(size)), ts.arena.view(off, size)])
        return None

    # -- HELLO ------------------------------------------------------------------------------
    def _hello(self, msg: Hello) -> Reply:
        if msg.version != wire.PROTOCOL_VERSION:
            return Error(wire.ErrorKind.VERSION, f"protocol version {msg.version} is not {wire.PROTOCOL_VERSION}")
        if self.space is not None:
            return Error(wire.ErrorKind.INVALID, "HELLO twice")
        pending = self._prove(msg)
        if pending is not None:
            return pending
        return self._admit(msg)

    def _prove(self, msg: Hello) -> Reply:
        """The pool secret's exchange: None once it is settled (the client proved that it
        holds the pool's secret, or neither side has one), else what to answer now: the
        challenge to an opening HELLO, or a refusal."""
        secret = self.d.secret
        opening = bool(msg.nonce) and not msg.proof
        if secret is None:
            # A client that asks for a secret this pool does not hold is refused.
            return Error(wire.ErrorKind.AUTH, REFUSAL) if opening else None
        if self._auth is None:
            self._auth = ServerAuth.start(secret, msg.nonce, _client_id(msg), b"ems-server") if opening else None
            if self._auth is None:
                return Error(wire.ErrorKind.AUTH, REFUSAL)
            nonce, proof = self._auth.challenge()
            return Challenge(nonce, proof)
        if _client_id(msg) != self._auth.ids[0] or not self._auth.check(msg.nonce, msg.proof):
            return Error(wire.ErrorKind.AUTH, REFUSAL)
        return None

    def _admit(self, msg: Hello) -> Reply:
        """Check the credentials; the tenant's space for this session, and the HELLO reply
        (with the arena's and the key set's descriptors, on a unix socket that asks)."""
        try:
            tenant = self.d.tenants.authenticate(msg.access_id, msg.access_key)
        except AuthError as exc:
            return Error(wire.ErrorKind.AUTH, str(exc))
        store = self.d.store
        assert store is not None
        self.space = store.space(tenant)
        self.owner = store.new_owner()
        shm = bool(msg.shm) and self.unix
        reply = HelloReply(self.d.instance, tenant, store.arena_size, store.capacity, shm,
                           self.space.keys.size, store.disk is not None, store.remote is not None)
        if shm:
            self._fds = (self.space.arena.fd, self.space.keys.fd)
        return reply


def _client_id(msg: Hello) -> bytes:
    """The client's identity in a pool proof: its tenant id."""
    return f"ems-client:{msg.access_id or ''}".encode()


def _keys(keys: object) -> List[str]:
    if not isinstance(keys, list) or not set(map(type, keys)) <= {str}:
        raise ValueError("keys must be a list of str")
    longest = max(map(len, keys), default=0)
    if longest > MAX_KEY_CHARS:
        raise ValueError(f"a key of {longest} characters is longer than {MAX_KEY_CHARS}")
    return keys


#: Requests any connection may make (before HELLO too): message type -> the session's
#: handler (message).
_SESSION_OPS: Dict[type, Callable[..., Reply]] = {
    Ping: Session._ping, Stats: Session._stats, Shutdown: Session._shutdown,
}

#: The tenant's requests: message type -> the session's handler (store, owner, space, message).
_TENANT_OPS: Dict[type, Callable[..., Reply]] = {
    Exists: Session._exists, Get: Session._get, Release: Session._release, Reserve: Session._reserve,
    Commit: Session._commit, Abort: Session._abort, Drop: Session._drop, Write: Session._write,
    Read: Session._read,
}
