"""``ems-server``: the node-local pool daemon.

One listening unix socket (``DIR/ems.sock``, optionally a TCP port too), one
:class:`~ems.server.store.Store`, and a few threads for any number of connections
(:mod:`ems.server.dispatch`: idle connections cost no thread).  A connection starts with
HELLO (version check, then credentials); on a unix socket the reply carries the tenant's
arena memfd, so afterwards only small control messages cross the socket.

Every peer byte is hostile until HELLO succeeds: a frame before it is at most 64 KiB, each
request must arrive whole within ``read_timeout``, a connection idle for ``idle_timeout`` is
closed, and at most ``max_connections`` are open at once (the next one is told so and
closed).  Refusals are logged at a bounded rate.

Single instance per directory: ``DIR/ems.lock`` is held (flock) for the daemon's life;
a second daemon on the same directory exits with :class:`AlreadyRunning`.  Because arenas
are anonymous memfds, a killed daemon leaves no shared memory behind; the stale socket file
is replaced at the next start.
"""
from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .._errors import EmsError, PoolDisconnected, PoolTimeout, ProtocolError
from ..pool import payload, wire
from ..pool.wire import (Abort, Ack, Challenge, Commit, CommitReply, Drop, Error, Exists, ExistsReply, Get,
                         GetReply, Hello, HelloReply, Ping, Pong, Read, ReadReply, Release, Reserve,
                         ReserveReply, Shutdown, Stats, StatsReply, Write)
from datadist.engine.checksum import StreamSum
from datadist.engine.codec import HEADER_SIZE
from datadist.engine import tls
from datadist.engine.handshake import REFUSAL, ServerAuth
from datadist.engine.incoming import RateLimitedLog

from .access import access_of
from .config import DEFAULT_DIR, ServerConfig
from .dispatch import Dispatcher
from .metrics import Endpoint, ServerMetrics, serve_metrics
from .store import Owner, Store, TenantSpace
from .tenants import AuthError
from .tiers import make_tier
from .tiers.disk import DiskTier

__all__ = ["ServerConfig", "Daemon", "AlreadyRunning", "SOCKET_NAME", "DEFAULT_DIR"]

log = logging.getLogger("ems.server")

SOCKET_NAME = "ems.sock"
LOCK_NAME = "ems.lock"

#: A request's answer: a message, or None when none is sent (one-way requests).
Reply = Optional[wire.Message]


class AlreadyRunning(RuntimeError):
    """Another daemon holds the directory's lock."""


class Daemon:
    """The pool daemon; ``start()`` binds and serves in threads, ``stop()`` shuts down."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.instance = secrets.token_hex(8)
        self.tenants, self.secret, self.tls = access_of(cfg)
        self.socket_path = os.path.join(cfg.directory, SOCKET_NAME)
        self.stopped = threading.Event()
        self.started_at = time.time()
        self._lock_fd: Optional[int] = None
        self._listeners: List[socket.socket] = []
        self._sessions: Dict[int, "Session"] = {}
        self._sessions_lock = threading.Lock()
        self._idle_since = time.monotonic()
        self.tcp_address: Optional[str] = None
        self.store: Optional[Store] = None
        self.dispatcher: Optional[Dispatcher] = None
        self.refusals = RateLimitedLog(log)
        self.metrics = ServerMetrics()
        self._metrics_server: Optional[Endpoint] = None
        #: Reservations given back by sessions that ended while stopping (pending puts aborted).
        self.aborted = 0

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Take the directory's lock, open the store and its tiers, listen and accept."""
        self._lock_directory()
        disk = DiskTier(self.cfg.disk_dir, self.cfg.disk_capacity) if self.cfg.disk_dir else None
        try:
            remote = make_tier(self.cfg.remote) if self.cfg.remote else None
        except (ValueError, ImportError) as exc:
            raise ValueError(f"--remote {self.cfg.remote}: {exc}") from None
        self.store = Store(self.cfg.capacity, disk=disk, remote=remote)
        self.dispatcher = Dispatcher(self.cfg.workers, self.cfg.idle_timeout, self.cfg.read_timeout)
        self._listeners.append(self._listen_unix())
        if self.cfg.tcp:
            self._listeners.append(self._listen_tcp(self.cfg.tcp))
        if self.cfg.metrics:
            self._metrics_server = serve_metrics(self, self.cfg.metrics)
        for lsock in self._listeners:
            threading.Thread(target=self._accept_loop, args=(lsock,), name="ems-accept",
                             daemon=True).start()
        log.info("ems-server %s serving %s (capacity %d bytes%s%s%s)", self.instance, self.socket_path,
                 self.cfg.capacity, f", disk {self.cfg.disk_dir}" if disk else "",
                 f", remote {self.cfg.remote}" if remote else "",
                 f", tcp {self.tcp_address}" if self.tcp_address else "")

    def _lock_directory(self) -> None:
        """Hold ``DIR/ems.lock`` (with our pid in it) for the daemon's life, or raise
        :class:`AlreadyRunning`."""
        os.makedirs(self.cfg.directory, exist_ok=True)
        fd = os.open(os.path.join(self.cfg.directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(f"another ems-server serves {self.cfg.directory}") from None
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())

    def _listen_unix(self) -> socket.socket:
        try:
            os.unlink(self.socket_path)  # a previous daemon's (we hold the lock, so it is dead)
        except FileNotFoundError:
            pass
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(self.socket_path)
        os.chmod(self.socket_path, self.cfg.socket_mode)
        unix.listen(1024)  # bursts of clients connecting at once (a unix connect fails, not waits, when full)
        return unix

    def _listen_tcp(self, address: str) -> socket.socket:
        """Listen on ``HOST:PORT`` (``--tcp``); sets :attr:`tcp_address`."""
        host, _, port = address.rpartition(":")
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            tcp.bind((host or "127.0.0.1", int(port)))
        except (OSError, ValueError, OverflowError) as exc:
            tcp.close()
            raise ValueError(f"--tcp {address}: expected HOST:PORT this host can listen on ({exc})") from None
        tcp.listen(1024)
        self.tcp_address = "tcp://%s:%d" % tcp.getsockname()[:2]
        if self.secret is None and self.tls is None and not ipaddress.ip_address(tcp.getsockname()[0]).is_loopback:
            log.warning("listening on %s without a pool secret: any host that reaches it may use the pool "
                        "(credentials only); start with --secret-file and give clients EmsConfig.secret",
                        self.tcp_address)
        return tcp

    def serve_forever(self) -> None:
        """Block until :meth:`stop` (or the idle period passes), then shut down."""
        while not self.stopped.wait(0.5):
            if self.cfg.idle_exit > 0:
                with self._sessions_lock:
                    idle = not self._sessions and time.monotonic() - self._idle_since > self.cfg.idle_exit
                if idle:
                    log.info("no client for %.0fs: exiting", self.cfg.idle_exit)
                    break
        self.close()

    def stop(self) -> None:
        self.stopped.set()

    def close(self) -> None:
        """Stop gracefully (idempotent): stop accepting (new connections are refused),
        take no new request, let the requests in flight finish and be answered (for up to
        ``drain_timeout``, then cut them), end every session (reservations not committed
        are given back: pending puts are aborted), spill memory to disk, free everything."""
        self.stopped.set()
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        for lsock in self._listeners:
            try:
                lsock.close()
            except OSError:
                pass
        self._listeners = []
        if self.dispatcher is not None:
            cut = self.dispatcher.close(self.cfg.drain_timeout, self._kick_all)
            if cut:
                log.warning("stopping: cut %d requests still in flight after %.1fs (--drain-timeout)",
                            cut, self.cfg.drain_timeout)
            self.dispatcher = None
        with self._sessions_lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            s.end()
        if self.aborted:
            log.warning("stopping: aborted %d puts reserved but not committed", self.aborted)
        if self.store is not None:
            self.store.close(spill=self.cfg.spill_on_exit)
            self.store = None
        if self._lock_fd is not None:
            try:
                if os.path.exists(self.socket_path):
                    os.unlink(self.socket_path)
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None

    def _kick_all(self) -> None:
        with self._sessions_lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            s.kick()

    def _accept_loop(self, lsock: socket.socket) -> None:
        lsock.settimeout(0.5)  # wakes to notice stop(); accept itself needs no deadline
        while not self.stopped.is_set():
            try:
                conn, _addr = lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._sessions_lock:
                full = len(self._sessions) >= self.cfg.max_connections
            if full:
                self._refuse_busy(conn)
                continue
            unix = lsock.family == socket.AF_UNIX
            if self.tls is not None and not unix:
                conn.setblocking(False)  # its handshake advances in the dispatcher (Session.request_waiting)
                conn = self.tls.accept(conn)
            session = Session(self, conn, unix)
            with self._sessions_lock:
                self._sessions[id(session)] = session
            assert self.dispatcher is not None
            self.dispatcher.watch(session)

    def _refuse_busy(self, conn: socket.socket) -> None:
        """Tell a connection over the cap why it is closed (briefly: it is not served)."""
        self.refusals.warning("refused a connection: %d connections are open (--max-connections)",
                              self.cfg.max_connections)
        self.metrics.refused("max_connections")
        try:
            wire.send_msg(conn, Error(wire.ErrorKind.BUSY, f"ems-server has {self.cfg.max_connections} connections open, "
                                                             "its --max-connections; retry later or raise the limit"),
                          time.monotonic() + 0.2)
        except EmsError:
            pass
        conn.close()

    def _ended(self, session: "Session") -> None:
        with self._sessions_lock:
            self._sessions.pop(id(session), None)
            if not self._sessions:
                self._idle_since = time.monotonic()

    def connections(self) -> int:
        with self._sessions_lock:
            return len(self._sessions)

    def stats(self) -> Dict[str, Any]:
        assert self.store is not None
        clients = self.connections()
        return {"instance": self.instance, "pid": os.getpid(), "socket": self.socket_path,
                "tcp": self.tcp_address, "uptime_s": round(time.time() - self.started_at, 3),
                "clients": clients, "tenancy": "open" if self.tenants.open else "credentials",
                **self.store.stats()}


#: Largest frame accepted before HELLO succeeds (a HELLO is a few hundred bytes).
PRE_HELLO_FRAME = 64 << 10


#: Frames up to this size are dispatched only once whole (a socket buffer holds them);
#: larger ones (long key lists of authenticated tenants) once their header is in.
_WHOLE_FRAME_MAX = 64 << 10


class Session:
    """One client connection: HELLO, then requests answered in order until it closes.
    The dispatcher calls :meth:`serve_one` whenever a request starts to arrive."""

    def __init__(self, daemon: Daemon, sock: socket.socket, unix: bool) -> None:
        self.d = daemon
        self.sock = sock
        self.unix = unix
        self.space: Optional[TenantSpace] = None
        self.owner: Optional[Owner] = None
        self._fds: Tuple[int, ...] = ()  # descriptors to pass with the next reply
        self._done = False
        self._end_lock = threading.Lock()
        self._auth: Optional[ServerAuth] = None  # a pool secret's challenge, once sent
        #: A TLS session whose handshake is not done yet.
        self.handshaking = isinstance(sock, ssl.SSLSocket)

    def kick(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def serve_one(self) -> bool:
        """Read and answer one request; False when the session is over."""
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
        waits on the peer: the whole frame, or for a frame larger than a socket buffer
        holds, its header; None when nothing has arrived.  True too for an end of stream
        or a header :meth:`_receive` refuses (it ends the session then).  A TLS session
        takes its handshake here first, a step at a time (None once it is done with
        nothing to read yet: an idle connection); then any bytes count (TLS cannot be
        peeked into, and the peer has shown a certificate of the CA)."""
        if isinstance(self.sock, ssl.SSLSocket):
            return self._tls_waiting(self.sock)
        try:
            head = self.sock.recv(HEADER_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            if len(head) < HEADER_SIZE:
                return not head  # b"": the peer closed
            size = wire.frame_size(head, wire.MAX_FRAME if self.space is not None else PRE_HELLO_FRAME)
            if size > _WHOLE_FRAME_MAX:
                return True
            return len(self.sock.recv(size, socket.MSG_PEEK | socket.MSG_DONTWAIT)) >= size
        except BlockingIOError:  # only the first look can find nothing: an idle connection
            return None
        except (OSError, ProtocolError):
            return True

    def _tls_waiting(self, sock: ssl.SSLSocket) -> Optional[bool]:
        if self.handshaking:
            try:
                if tls.handshake_step(sock):
                    return False
            except OSError as exc:  # ssl.SSLError: no certificate, one of another CA, not TLS
                self.d.refusals.warning("refused a TLS connection: %s", exc)
                return True  # _receive reads the end of it
            self.handshaking = False
        if sock.pending() or select.select([sock], [], [], 0)[0]:
            return True
        return None

    def _receive(self) -> Optional[wire.Message]:
        """The next request, or None when the session is over (a bad frame is answered
        first); it must arrive whole within ``read_timeout``."""
        deadline = time.monotonic() + self.d.cfg.read_timeout
        try:
            msg, _ = wire.recv_msg(self.sock, deadline,
                                   max_frame=wire.MAX_FRAME if self.space is not None else PRE_HELLO_FRAME)
        except (PoolDisconnected, PoolTimeout):
            return None
        except ProtocolError as exc:
            self.d.refusals.warning("closed a connection that sent a bad frame: %s", exc)
            self.d.metrics.refused("bad_frame")
            self._reply(Error(wire.ErrorKind.INVALID, str(exc)))
            return None
        return msg

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
        store = self.d.store
        if self.owner is not None and store is not None:
            if self.d.stopped.is_set():
                with self.d._sessions_lock:
                    self.d.aborted += len(self.owner.reservations)
            store.close_owner(self.owner)
        try:
            self.sock.close()
        except OSError:
            pass
        self.d._ended(self)

    def _reply(self, msg: wire.Message, fds: Sequence[int] = ()) -> bool:
        try:
            wire.send_msg(self.sock, msg, time.monotonic() + self.d.cfg.read_timeout, fds=fds)
            return True
        except (PoolDisconnected, PoolTimeout):
            return False

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
        return CommitReply(store.commit(owner, ts, keys, offs, crcs, bool(msg.keep_local)))

    def _abort(self, store: Store, owner: Owner, ts: TenantSpace, msg: Abort) -> Reply:
        store.abort(owner, ts, [int(o) for o in msg.offsets])
        return None

    def _drop(self, store: Store, owner: Owner, ts: TenantSpace, msg: Drop) -> Reply:
        store.drop(ts, _keys(msg.keys), [int(o) for o in msg.offsets])
        return Ack()

    def _write(self, store: Store, owner: Owner, ts: TenantSpace, msg: Write) -> Reply:
        off, size = int(msg.offset), int(msg.size)
        res = store.reservation(owner, ts, off)
        if res is None or size != res.size:
            return Error(wire.ErrorKind.INVALID, "WRITE outside this connection's reservations")
        # Summed as it arrives, on this session's thread: COMMIT then only compares.
        summed = StreamSum(size)
        payload.recv_into(self.sock, ts.arena.view(off, size), time.monotonic() + self.d.cfg.read_timeout, summed)
        store.received(owner, ts, off, summed.checksum())
        return None

    def _read(self, store: Store, owner: Owner, ts: TenantSpace, msg: Read) -> Reply:
        off, size = int(msg.offset), int(msg.size)
        if not store.leased(owner, ts, off, size):
            return Error(wire.ErrorKind.INVALID, "READ outside this connection's leases")
        self.sock.settimeout(self.d.cfg.read_timeout)  # a reader that stops reading is cut off
        self.sock.sendall(wire.encode(ReadReply(size)))
        self.sock.sendall(ts.arena.view(off, size))
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
