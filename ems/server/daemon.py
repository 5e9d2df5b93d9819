"""``ems-server``: the node-local pool daemon.

One listening unix socket (``DIR/ems.sock``, optionally a TCP port too), one
:class:`~ems.server.store.Store`, and a few threads for any number of connections
(:mod:`ems.server.dispatch`: idle connections cost no thread), each a
:class:`~ems.server.session.Session` (HELLO, then requests).

At most ``max_connections`` are open at once (the next one is told so and closed); a
connection idle for ``idle_timeout`` is closed; refusals are logged at a bounded rate.  An
accept that fails (out of descriptors) is retried: the daemon never stops listening.

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
import socket
import threading
import time
from typing import Any, Dict, List, Optional

from .._errors import EmsError
from ..pool import wire
from ..pool.wire import Error
from datadist.engine.incoming import RateLimitedLog

from .access import access_of
from .config import DEFAULT_DIR, ServerConfig
from .dispatch import Dispatcher
from .metrics import Endpoint, ServerMetrics, serve_metrics
from .session import Session
from .store import Store
from .tiers import make_tier
from .tiers.disk import DiskTier

__all__ = ["ServerConfig", "Daemon", "AlreadyRunning", "SOCKET_NAME", "DEFAULT_DIR"]

log = logging.getLogger("ems.server")

SOCKET_NAME = "ems.sock"
LOCK_NAME = "ems.lock"


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
        self._sessions: Dict[int, Session] = {}
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
        self.store = Store(self.cfg.capacity, disk=disk, remote=remote, reserve_timeout=self.cfg.reserve_timeout)
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
            # shutdown first: a listener another thread polls stays open until that poll
            # returns (the poll holds the file), and meanwhile connections would queue in
            # its backlog, never to be served; shut down, it refuses them at once and wakes
            # the accept loop.
            try:
                lsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            lsock.close()
        self._listeners = []
        log.info("stopping: new connections are refused; the requests in flight finish (--drain-timeout %gs)",
                 self.cfg.drain_timeout)
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
            except OSError as exc:
                if self.stopped.is_set() or lsock.fileno() < 0:
                    return
                # Out of descriptors (EMFILE): the connection waits in the backlog; never stop here
                self.refusals.warning("accepting a connection failed: %s; retrying", exc)
                self.stopped.wait(_ACCEPT_BACKOFF_S)
                continue
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

    def session_ended(self, session: Session, aborted: int) -> None:
        """``session`` is over; it gave back ``aborted`` reservations (pending puts, counted
        as aborted when the daemon is stopping)."""
        with self._sessions_lock:
            if self.stopped.is_set():
                self.aborted += aborted
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


#: How long the accept loop waits after a failed accept (out of descriptors) before the next.
_ACCEPT_BACKOFF_S = 0.05
