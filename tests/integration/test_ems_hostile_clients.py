"""Hostile clients at a live ``ems-server``, beyond the bad frames of test_ems_attacks.py:
strangers (no HELLO, no secret) and authenticated tenants that try to hold workers,
connection slots, reservations, the store lock or the key set, to make the daemon allocate
far more than they send, or to reach another tenant's values.  Each test ends with an
honest client (the project's own :class:`~ems.client.conn.Connection`) saving and loading a
value, bytes checked, within a short deadline.  Loopback only, bounded in count and time.
"""
from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
import shutil
import signal
import socket
import struct
import termios
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

from ems_helpers import RedisServer, daemon_factory, daemon_queues, free_port, need_redis  # noqa: F401
from tls_helpers import make_pki, require_openssl
from waiting import PACED, until

from datadist.engine.auth import Secret, load_secret
from datadist.engine.tls import TlsConfig
from ems._errors import EmsError
from ems.client.address import parse_address
from ems.client.conn import Connection
from ems.pool import wire
from ems.pool.checksum import checksum
from ems.server.session import MAX_KEY_CHARS

pytestmark = pytest.mark.timeout(90)

KEY_A, KEY_M = "A" * 40, "M" * 40
#: How long an honest request may take while the attack goes on (seconds).
HONEST_S = 2.0
RSS_GROWTH_LIMIT = 64 << 20


# ----------------------------------------------------------------------------- helpers

def _head(op: int, blen: int, alen: int = 0) -> bytes:
    return struct.pack("<4sBBHII", wire.MAGIC, wire.PROTOCOL_VERSION, int(op), 0, blen, alen)


def _rss(pid: int, field: str = "VmRSS") -> int:
    """The process's resident memory now (``VmHWM``: its peak so far), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no {field}")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _tcp(daemon) -> Tuple[str, int]:
    host, port = daemon.tcp[len("tcp://"):].rsplit(":", 1)
    return host, int(port)


class Raw:
    """A hostile client speaking the wire protocol from a raw socket (the project's codec)."""

    def __init__(self, daemon, tcp: bool = False, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.unix = not tcp
        if tcp:
            self.sock = socket.create_connection(_tcp(daemon), timeout=timeout)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(os.path.join(daemon.dir, "ems.sock"))
        self.arena: Optional[mmap.mmap] = None
        self.keyset_fd: Optional[int] = None
        self.keyset_size = 0

    def hello(self, access_id: Optional[str] = None, access_key: Optional[str] = None) -> wire.Message:
        wire.send_msg(self.sock, wire.Hello(access_id=access_id, access_key=access_key, pid=os.getpid(),
                                            shm=self.unix), self._deadline())
        reply, fds = wire.recv_msg(self.sock, self._deadline(), want_fds=2 if self.unix else 0)
        if isinstance(reply, wire.HelloReply) and len(fds) == 2:
            self.arena = mmap.mmap(fds[0], reply.arena_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fds[0])
            self.keyset_fd, self.keyset_size = fds[1], reply.keyset_size
        assert isinstance(reply, wire.HelloReply), reply
        return reply

    def _deadline(self, timeout: Optional[float] = None) -> float:
        return time.monotonic() + (timeout or self.timeout)

    def send(self, msg: wire.Message) -> None:
        wire.send_msg(self.sock, msg, self._deadline())

    def recv(self, timeout: Optional[float] = None) -> wire.Message:
        return wire.recv_msg(self.sock, self._deadline(timeout))[0]

    def call(self, msg: wire.Message, timeout: Optional[float] = None) -> wire.Message:
        self.send(msg)
        return self.recv(timeout)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        if self.keyset_fd is not None:
            os.close(self.keyset_fd)
        self.sock.close()


def honest(daemon, access_id: Optional[str] = None, access_key: Optional[str] = None, tcp: bool = False,
           secret: Optional[Secret] = None, tls: Optional[TlsConfig] = None, timeout: float = HONEST_S,
           key: str = "honest\x00value", size: int = 3 * 4096 + 17) -> None:
    """Save a fresh random value and load it back, bytes checked, all within ``timeout``
    seconds, through the project's own client connection (shared memory on the unix
    socket; WRITE and READ over TCP)."""
    deadline = time.monotonic() + timeout
    address = parse_address(daemon.tcp if tcp else daemon.dir)
    conn = Connection(address, wire.Hello(access_id=access_id, access_key=access_key, pid=os.getpid()), deadline,
                      secret=secret, tls=tls)
    arena = None
    try:
        fds = conn.take_fds()
        if fds:
            arena = mmap.mmap(fds[0], conn.info.arena_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            for fd in fds:
                os.close(fd)
        data = os.urandom(size)
        off = conn.call(wire.Reserve([key], [size]), deadline, wire.ReserveReply).offsets[0]
        assert off >= 0, f"no room for the honest value ({off})"
        if arena is not None:
            arena[off:off + size] = data
        else:
            conn.send(wire.Write(off, size), deadline)
            conn.sock.sendall(data)
        stored = conn.call(wire.Commit([key], [off], [checksum(data)]), deadline, wire.CommitReply).stored
        assert stored == [True]
        got = conn.call(wire.Get([key]), deadline, wire.GetReply)
        assert got.sizes == [size]
        if arena is not None:
            back = bytes(arena[got.offsets[0]:got.offsets[0] + size])
        else:
            conn.send(wire.Read(got.offsets[0], size), deadline)
            head, _ = wire.recv_msg(conn.sock, deadline)
            assert isinstance(head, wire.ReadReply) and head.size == size
            buf = bytearray(size)
            wire.recv_exact(conn.sock, memoryview(buf), deadline)
            back = bytes(buf)
        assert back == data, "the honest client read other bytes than it saved"
        conn.send(wire.Release(got.lease), deadline)
    finally:
        if arena is not None:
            arena.close()
        conn.close()


def serves(daemon, **kwargs) -> None:
    """The honest round trip, three times (each within :data:`HONEST_S`)."""
    for i in range(3):
        honest(daemon, key=f"honest\x00{i}", **kwargs)


@pytest.fixture
def creds(tmp_path: Path) -> Path:
    path = tmp_path / "credentials"
    path.write_text(f"alice: {KEY_A}\nmallory: {KEY_M}\n")
    return path


@pytest.fixture
def closing() -> Iterator[List[socket.socket]]:
    """Sockets (and Raw clients) a test holds open; all closed at its end."""
    held: List = []
    yield held
    for s in held:
        try:
            s.close()
        except OSError:
            pass


# ----------------------------------------------------------------------------- strangers

def test_stranger_announcing_a_64k_hello_holds_no_worker(daemon_factory, tmp_path, closing) -> None:
    """A HELLO header announcing the largest body allowed before HELLO (64 KiB) makes a
    frame 16 bytes over _WHOLE_FRAME_MAX, which the dispatcher hands to a worker on its
    header alone; 16 such strangers (one per worker) must not stall an honest client."""
    (tmp_path / "secret").write_text("pool secret 0123456789")
    daemon = daemon_factory(tcp=True, extra=["--read-timeout", "10", "--drain-timeout", "1",
                                             "--secret-file", str(tmp_path / "secret")])
    secret = load_secret(None, str(tmp_path / "secret"))
    for _ in range(16):
        s = socket.create_connection(_tcp(daemon), timeout=5)
        s.sendall(_head(wire.Op.HELLO, wire.SMALL_FRAME))  # the header, never the body
        closing.append(s)
    serves(daemon, secret=secret)


def test_stranger_cannot_stop_the_accept_loop_by_exhausting_descriptors(daemon_factory, closing) -> None:
    """A stranger opens more connections than the daemon's RLIMIT_NOFILE (below the default
    --max-connections of 1024, as a 1024 soft limit is): accept() fails with EMFILE.  Once
    the stranger is gone, clients must be served again."""
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit")
    daemon = daemon_factory(launcher=["prlimit", "--nofile=128:128"], extra=["--read-timeout", "1"])
    for _ in range(200):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(os.path.join(daemon.dir, "ems.sock"))
        closing.append(s)
    until(lambda: _fds(daemon.pid) >= 100, 10, "the daemon accepted up to its descriptor limit", every=PACED)
    for s in closing:
        s.close()
    until(lambda: _fds(daemon.pid) < 50, 10, "the stranger's connections ended", every=PACED)
    serves(daemon)


def test_strangers_that_never_say_hello_do_not_keep_every_connection_slot(daemon_factory, tmp_path,
                                                                          closing) -> None:
    """Connections that never send HELLO hold a --max-connections slot until --idle-timeout
    (600 s by default), like authenticated idle clients; a stranger must not be able to
    lock every client out for that long: unauthenticated connections must end within a
    handshake deadline (here: --read-timeout 1)."""
    (tmp_path / "secret").write_text("pool secret 0123456789")
    secret = load_secret(None, str(tmp_path / "secret"))
    daemon = daemon_factory(tcp=True, extra=["--max-connections", "4", "--read-timeout", "1",
                                             "--secret-file", str(tmp_path / "secret")])
    for _ in range(4):
        closing.append(socket.create_connection(_tcp(daemon), timeout=5))

    def admitted() -> bool:
        try:
            honest(daemon, secret=secret)
            return True
        except EmsError:
            return False
    until(admitted, 6, "an honest client admitted while strangers idle before HELLO", every=0.2)


def test_strangers_that_keep_pinging_still_lose_their_slot(daemon_factory, creds, closing) -> None:
    """Without a pool secret a stranger may PING before HELLO; strangers pinging every
    0.3 s on every --max-connections slot must still be shut out once --read-timeout has
    passed since they connected, or they lock every tenant out for as long as they like."""
    daemon = daemon_factory(tcp=True, credentials=creds, extra=["--max-connections", "4", "--read-timeout", "1"])
    strangers = [socket.create_connection(_tcp(daemon), timeout=5) for _ in range(4)]
    closing.extend(strangers)
    stop = threading.Event()

    def ping(sock: socket.socket) -> None:
        with contextlib.suppress(OSError, EmsError):
            while not stop.wait(0.3):  # the stranger's own pace
                wire.send_msg(sock, wire.Ping(), time.monotonic() + 5)
                wire.recv_msg(sock, time.monotonic() + 5)

    pingers = [threading.Thread(target=ping, args=(s,), daemon=True) for s in strangers]
    for t in pingers:
        t.start()
    try:
        def admitted() -> bool:
            try:
                honest(daemon, access_id="alice", access_key=KEY_A, tcp=True)
                return True
            except EmsError:
                return False
        until(admitted, 6, "alice admitted while strangers ping before HELLO", every=0.2)
    finally:
        stop.set()
        for t in pingers:
            t.join(10)


def test_strangers_that_never_read_their_pongs_hold_no_worker(daemon_factory, creds, closing) -> None:
    """Strangers on the unix socket (open to all: --socket-mode 0666) pipeline PINGs on 16
    connections and never read the PONGs.  Once their buffers filled, each answer held a
    worker for --read-timeout; now an answer not taken waits aside, and a tenant is served."""
    daemon = daemon_factory(credentials=creds, extra=["--read-timeout", "30", "--socket-mode", "0666"])
    burst = wire.encode(wire.Ping()) * 20_000
    stuck = [threading.Event() for _ in range(16)]

    def flood(sock: socket.socket, done: threading.Event) -> None:
        """Send PINGs while the daemon takes them; done once it has taken none for 0.5 s."""
        with contextlib.suppress(OSError):
            while not done.is_set():
                if select.select([], [sock], [], 0.5)[1]:
                    sock.send(burst)
                else:
                    done.set()

    for flag in stuck:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(os.path.join(daemon.dir, "ems.sock"))
        s.setblocking(False)
        closing.append(s)
        threading.Thread(target=flood, args=(s, flag), daemon=True).start()
    until(lambda: all(flag.is_set() for flag in stuck), 20, "the daemon stopped taking every stranger's PINGs",
          every=PACED)
    serves(daemon, access_id="alice", access_key=KEY_A)


def test_a_hello_answer_behind_unread_pongs_holds_no_worker(daemon_factory, creds, closing) -> None:
    """16 tenants (one per worker) pipeline 150 PINGs and a HELLO asking for the arena's
    descriptors, then read nothing: the PONGs fill more than a quarter of the daemon's send
    buffer, and the HELLO answer, sent blocking because of its descriptors, held each worker
    for --read-timeout.  Now it waits aside like any answer, and a tenant is served."""
    daemon = daemon_factory(credentials=creds, extra=["--read-timeout", "30"])
    hello = wire.encode(wire.Hello(access_id="mallory", access_key=KEY_M, pid=os.getpid(), shm=True))
    held = []
    for _ in range(16):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(os.path.join(daemon.dir, "ems.sock"))
        closing.append(s)
        s.sendall(wire.encode(wire.Ping()) * 150 + hello)
        held.append(s)
    pongs = 150 * len(wire.encode(wire.Pong()))
    until(lambda: all(_fionread(s) >= pongs for s in held), 10, "every PONG answered (the HELLO next)", every=PACED)
    serves(daemon, access_id="alice", access_key=KEY_A)


def _fionread(sock: socket.socket) -> int:
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), "little")


# ----------------------------------------------------------------------------- tenants

def test_readers_that_stop_reading_hold_no_worker(daemon_factory, creds, closing) -> None:
    """Authenticated over TCP: 32 connections (twice the workers) each READ a 4 MiB value
    and never read the answer.  Sending it once held a worker for --read-timeout; now an
    answer the client does not take waits aside, and honest clients are served.  A
    stopping daemon cuts the stalled answers at --drain-timeout."""
    daemon = daemon_factory(tcp=True, capacity="64M", credentials=creds,
                            extra=["--read-timeout", "30", "--drain-timeout", "1"])
    size = 4 << 20
    writer = Raw(daemon, tcp=True)
    writer.hello("mallory", KEY_M)
    closing.append(writer)
    off = writer.call(wire.Reserve(["big"], [size])).offsets[0]
    writer.send(wire.Write(off, size))
    writer.sock.sendall(bytes(size))
    assert writer.call(wire.Commit(["big"], [off], [checksum(bytes(size))])).stored == [True]
    for _ in range(32):
        m = Raw(daemon, tcp=True, timeout=HONEST_S)
        m.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        m.hello("mallory", KEY_M)
        closing.append(m)
        got = m.call(wire.Get(["big"]))
        m.send(wire.Read(got.offsets[0], size))  # and never read the answer
    until(lambda: all(daemon_queues(m.sock)[0] > 0 for m in closing[1:]), 10, "every answer left unread",
          every=PACED)
    serves(daemon, access_id="alice", access_key=KEY_A, tcp=True)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(30) == 0
    assert "cut 32 requests still in flight" in daemon.log.read_text()


def test_tenant_cannot_hold_workers_with_a_big_frame_header_or_a_stalled_write(daemon_factory, creds,
                                                                              closing) -> None:
    """Authenticated: 16 connections announce a 1 MiB RESERVE and send no body (frames over
    64 KiB are dispatched on their header); 16 WRITE to a one-page reservation and send one
    byte of it.  Either kind takes all 16 workers for --read-timeout unless the daemon
    reads them without a worker."""
    daemon = daemon_factory(credentials=creds, extra=["--read-timeout", "10", "--drain-timeout", "1"])
    for i in range(32):  # each is answered within HONEST_S: no worker may be held by those before
        m = Raw(daemon, timeout=HONEST_S)
        m.hello("mallory", KEY_M)
        closing.append(m)
        if i % 2:
            m.sock.sendall(_head(wire.Op.RESERVE, 1 << 20))
        else:
            off = m.call(wire.Reserve([f"m{i}"], [4096])).offsets[0]
            m.send(wire.Write(off, 4096))
            m.sock.sendall(b"x")
    serves(daemon, access_id="alice", access_key=KEY_A)


def test_reservations_never_committed_do_not_lock_other_tenants_out(daemon_factory, creds, closing) -> None:
    """Mallory reserves the whole capacity and never commits, keeping its connection alive.
    Reservations older than --reserve-timeout are taken back when memory is short: alice
    stores, and mallory's late commit stores nothing."""
    daemon = daemon_factory(capacity="16M", credentials=creds, extra=["--reserve-timeout", "1"])
    m = Raw(daemon)
    m.hello("mallory", KEY_M)
    closing.append(m)
    keys = [f"m{i}" for i in range(4096)]
    reply = m.call(wire.Reserve(keys, [4096] * 4096))
    assert isinstance(reply, wire.ReserveReply) and all(o >= 0 for o in reply.offsets)

    def alice_stores() -> bool:
        assert isinstance(m.call(wire.Ping()), wire.Pong)  # mallory is alive and not idle
        try:
            honest(daemon, access_id="alice", access_key=KEY_A)
            return True
        except AssertionError as exc:
            if "no room" not in str(exc):
                raise
            return False
    until(alice_stores, 6, "alice stores while mallory holds uncommitted reservations", every=0.2)
    late = m.call(wire.Commit(keys[:1], reply.offsets[:1], [0]))
    assert isinstance(late, wire.CommitReply) and late.stored == [False], late


def test_scribbling_on_the_published_key_set_cannot_hang_the_daemon(daemon_factory, creds, closing) -> None:
    """The key set's memfd comes with HELLO; a client meant to map it read-only.  If it can
    map it writable and zero its magic, the daemon's key-set calls for that tenant fail
    inside the store, and an eviction of one of its values (for another tenant's room)
    must neither fail that tenant's request nor leave the store spinning under its lock."""
    daemon = daemon_factory(capacity="16M", credentials=creds, extra=["--drain-timeout", "1"])
    try:
        m = Raw(daemon)
        m.hello("mallory", KEY_M)
        closing.append(m)
        keys = [f"m{i}" for i in range(8)]
        offs = m.call(wire.Reserve(keys, [1 << 20] * 8)).offsets
        assert m.call(wire.Commit(keys, offs, [0] * 8)).stored == [True] * 8
        assert m.keyset_fd is not None
        try:
            table = mmap.mmap(m.keyset_fd, m.keyset_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            table = None  # read-only, as it should be
        if table is not None:
            table[0:8] = b"\0" * 8
            table.close()
        a = Raw(daemon, timeout=HONEST_S)
        a.hello("alice", KEY_A)
        closing.append(a)
        replies: List[object] = []
        for i in range(2):  # each needs mallory's values evicted
            try:
                reply = a.call(wire.Reserve([f"a{i}"], [12 << 20]))
            except EmsError as exc:
                reply = exc
            replies.append(reply)
            if isinstance(reply, wire.ReserveReply):
                a.send(wire.Abort(reply.offsets))
        serves(daemon, access_id="alice", access_key=KEY_A)
        assert all(isinstance(r, wire.ReserveReply) for r in replies), replies
    except BaseException:
        daemon.kill()  # a daemon spinning under its store lock would not stop on SIGTERM
        raise


def test_one_reserve_cannot_hold_the_store_lock_for_long(daemon_factory, creds, closing) -> None:
    """With capacity full of pinned values, every key of a RESERVE scans the whole LRU for
    a victim, under the store lock: one RESERVE of 30000 keys (of the 4M a frame may hold)
    must not stall other tenants' requests."""
    daemon = daemon_factory(capacity="16M", credentials=creds, extra=["--drain-timeout", "1"])
    a = Raw(daemon, timeout=HONEST_S)
    a.hello("alice", KEY_A)
    closing.append(a)
    data = os.urandom(8192)
    off = a.call(wire.Reserve(["a\x00pinned"], [len(data)])).offsets[0]
    a.arena[off:off + len(data)] = data
    assert a.call(wire.Commit(["a\x00pinned"], [off], [checksum(data)])).stored == [True]
    assert a.call(wire.Get(["a\x00pinned"])).offsets == [off]  # alice pins it: never evicted
    m = Raw(daemon, timeout=60)
    m.hello("mallory", KEY_M)
    closing.append(m)
    keys = [f"m{i}" for i in range(4096)]
    offs = [o for o in m.call(wire.Reserve(keys, [1] * 4096)).offsets]
    kept = [(k, o) for k, o in zip(keys, offs) if o >= 0]
    m.call(wire.Commit([k for k, _ in kept], [o for _, o in kept], [0] * len(kept)))
    assert len(m.call(wire.Get([k for k, _ in kept])).offsets) == len(kept)  # all pinned, lease kept
    n = 30000
    m.send(wire.Reserve(["r"] * n, [1] * n))
    start = time.monotonic()
    got = a.call(wire.Get(["a\x00pinned"]), HONEST_S)
    assert isinstance(got, wire.GetReply) and got.offsets == [off]
    assert bytes(a.arena[off:off + len(data)]) == data
    assert time.monotonic() - start < HONEST_S
    assert isinstance(m.recv(60), wire.ReserveReply)


def test_long_keys_do_not_grow_the_daemon_past_its_capacity(daemon_factory) -> None:
    """Keys have no bound but the frame's (64 MiB); each value stored keeps its key, while
    only its page counts against --capacity.  32 values with 4 MiB keys (128 MiB of keys
    for 128 KiB of values) must be refused or cost no such memory."""
    daemon = daemon_factory(capacity="16M")
    m = Raw(daemon, timeout=30)
    m.hello()
    base = _rss(daemon.pid)
    try:
        for i in range(32):
            key = f"{i:08d}" * (1 << 19)  # 4 MiB
            reply = m.call(wire.Reserve([key], [1]))
            if isinstance(reply, wire.ReserveReply) and reply.offsets[0] >= 0:
                m.call(wire.Commit([key], reply.offsets, [0]))
        growth = _rss(daemon.pid) - base
        assert growth < RSS_GROWTH_LIMIT, f"RSS grew by {growth >> 20} MiB for 128 KiB of values"
    finally:
        m.close()
    serves(daemon)


@pytest.mark.parametrize("op", [wire.Exists, wire.Get, wire.Drop])
def test_a_key_list_costs_the_daemon_about_what_it_weighs(daemon_factory, op) -> None:
    """Keys are decoded into strings: a frame of many two-character keys grows ~30x in the
    daemon (4 Mi keys in 12 MiB: 344 MiB for one request, on each of 16 workers at once).
    A list longer than a frame may hold (wire.MAX_KEYS) is refused before it is split, and
    the frame itself is held once, only while it is decoded: four such requests, which
    workers take in turn, raise the daemon's peak memory by less than two frames (a frame
    put together from its pieces, then kept by each worker's heap, cost 24-52 MiB here)."""
    daemon = daemon_factory()
    keys = [f"{i % 100:02d}" for i in range(wire.MAX_KEYS * 64)]
    frame = wire.encode(op(keys=keys))
    base = _rss(daemon.pid, "VmHWM")
    for _ in range(4):
        m = Raw(daemon, timeout=30)
        m.hello()
        m.sock.sendall(frame)
        try:
            reply = m.recv(30)
        except EmsError as exc:  # the daemon may close the connection behind its answer
            reply = exc
        m.close()
        assert isinstance(reply, (wire.Error, EmsError)), reply
    growth = _rss(daemon.pid, "VmHWM") - base
    assert growth < 2 * len(frame), f"peak RSS grew by {growth >> 20} MiB for {len(frame) >> 20} MiB frames"
    serves(daemon)


def test_tcp_commit_of_a_reservation_never_written_is_refused(daemon_factory) -> None:
    """Over TCP a client cannot write the arena itself: a COMMIT of a reservation that
    received no WRITE publishes whatever the reused pages held (a freed value)."""
    daemon = daemon_factory(capacity="16M", tcp=True)
    old = os.urandom(4096)
    a = Raw(daemon)
    a.hello()
    off = a.call(wire.Reserve(["old"], [4096])).offsets[0]
    a.arena[off:off + 4096] = old
    assert a.call(wire.Commit(["old"], [off], [checksum(old)])).stored == [True]
    lease = a.call(wire.Get(["old"])).lease
    a.call(wire.Drop(["old"], [off]))
    a.send(wire.Release(lease))
    a.close()
    m = Raw(daemon, tcp=True)
    m.hello()
    try:
        off = m.call(wire.Reserve(["new"], [4096])).offsets[0]
        assert m.call(wire.Commit(["new"], [off], [0])).stored == [False]
    finally:
        m.close()
    serves(daemon, tcp=True)


def test_tenants_cannot_touch_each_others_values_or_reservations(daemon_factory, creds, tmp_path,
                                                                 closing) -> None:
    """Mallory (over TCP) names alice's offsets and keys in every request: READ, WRITE,
    COMMIT, ABORT, DROP, GET, EXISTS; extreme integers; descriptors passed to the daemon;
    keys shaped like paths, spilled to the disk tier.  Alice's value stays hers and intact."""
    daemon = daemon_factory(capacity="16M", credentials=creds, tcp=True, disk_dir=tmp_path / "disk")
    a = Raw(daemon)
    a.hello("alice", KEY_A)
    closing.append(a)
    secret = os.urandom(9000)
    off = a.call(wire.Reserve(["s\x00k"], [len(secret)])).offsets[0]
    a.arena[off:off + len(secret)] = secret
    assert a.call(wire.Commit(["s\x00k"], [off], [checksum(secret)])).stored == [True]
    pending = a.call(wire.Reserve(["pending"], [4096])).offsets[0]
    m = Raw(daemon, tcp=True)
    m.hello("mallory", KEY_M)
    closing.append(m)
    assert m.call(wire.Get(["s\x00k"])).offsets == []
    assert m.call(wire.Exists(["s\x00k"])).hits == 0
    assert isinstance(m.call(wire.Read(off, len(secret))), wire.Error)
    assert isinstance(m.call(wire.Write(pending, 4096)), wire.Error)
    assert m.call(wire.Commit(["pending"], [pending], [0])).stored == [False]
    m.send(wire.Abort([pending, off, -1, 1 << 62]))
    assert isinstance(m.call(wire.Drop(["s\x00k"], [off])), wire.Ack)
    for msg in (wire.Reserve(["x"], [(1 << 63) - 1]), wire.Reserve(["x"], [-1]), wire.Write(-4096, 4096),
                wire.Write(1 << 62, 1 << 62), wire.Read(0, (1 << 63) - 1), wire.Read(-1, 1),
                wire.Commit(["x"], [-2], [1]), wire.GetReply(1, [1], [1], [1])):
        reply = m.call(msg)
        assert isinstance(reply, (wire.Error, wire.ReserveReply, wire.CommitReply)), reply
        if isinstance(reply, wire.ReserveReply):
            assert reply.offsets == [wire.NO_SPACE]
        if isinstance(reply, wire.CommitReply):
            assert reply.stored == [False]
    fds_before = _fds(daemon.pid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(os.path.join(daemon.dir, "ems.sock"))
    closing.append(s)
    nulls = [os.open("/dev/null", os.O_RDONLY) for _ in range(64)]
    try:
        socket.send_fds(s, [wire.encode(wire.Ping())], nulls)
        assert isinstance(wire.recv_msg(s, time.monotonic() + 5)[0], wire.Pong)
    finally:
        for fd in nulls:
            os.close(fd)
    assert _fds(daemon.pid) <= fds_before + 1, "descriptors passed by a client were kept"
    too_long = m.call(wire.Reserve(["k" * (MAX_KEY_CHARS + 1)], [4096]))
    assert isinstance(too_long, wire.Error) and str(MAX_KEY_CHARS) in too_long.message, too_long
    weird = ["../../../../escape", "/etc/passwd", "a/b\x00../c", "\x00" * 10, "k" * MAX_KEY_CHARS]
    for k in weird:
        r = m.call(wire.Reserve([k], [4096])).offsets[0]
        m.send(wire.Write(r, 4096))
        m.sock.sendall(b"W" * 4096)
        assert m.call(wire.Commit([k], [r], [])).stored == [True]
    fill = [f"fill{i}" for i in range(4)]
    offs = m.call(wire.Reserve(fill, [4 << 20] * 4)).offsets
    for o in offs:
        if o >= 0:
            m.send(wire.Write(o, 4 << 20))
            m.sock.sendall(b"F" * (4 << 20))
    m.call(wire.Commit(fill, offs, []))
    names = os.listdir(tmp_path / "disk")
    assert names and all(len(n) == 44 and n.endswith(".val") for n in names), names
    assert not os.path.exists(tmp_path / "escape") and not os.path.exists(tmp_path / "escape.val")
    assert a.call(wire.Exists(weird)).hits == 0
    got = a.call(wire.Get(["s\x00k"]))
    assert got.sizes == [len(secret)]
    assert bytes(a.arena[got.offsets[0]:got.offsets[0] + len(secret)]) == secret
    serves(daemon, access_id="alice", access_key=KEY_A)


# ----------------------------------------------------------------------------- TLS

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    require_openssl()
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls_flags(pki) -> List[str]:
    return ["--tls-cert-file", pki.cert("a"), "--tls-key-file", pki.key("a"), "--tls-ca-file", pki.ca("ca")]


def test_tls_port_refuses_plaintext_and_held_records(daemon_factory, pki, closing) -> None:
    """Plain HELLO on the TLS port gets no HELLO reply (no downgrade); clients with a
    certificate of the CA that send one byte of a TLS record (one per worker) must not
    stall an honest TLS client (any readable byte counts as a whole request today)."""
    daemon = daemon_factory(tcp=True, extra=_tls_flags(pki) + ["--read-timeout", "10", "--drain-timeout", "1"])
    tls = TlsConfig(pki.cert("b"), pki.key("b"), pki.ca("ca"))
    plain = socket.create_connection(_tcp(daemon), timeout=5)
    closing.append(plain)
    plain.sendall(wire.encode(wire.Hello(pid=1, shm=False)))
    try:
        answer = plain.recv(64)
    except OSError:
        answer = b""
    assert wire.MAGIC not in answer
    for _ in range(16):
        s = tls.connect(socket.create_connection(_tcp(daemon), timeout=5))
        closing.append(s)
        os.write(s.fileno(), b"\x17")  # the first byte of an application-data record
    serves(daemon, tcp=True, tls=tls)


@pytest.mark.parametrize("secure", [False, True], ids=["tcp", "tls"])
def test_writes_that_pause_hold_no_worker_and_arrive_whole(daemon_factory, pki, secure) -> None:
    """16 honest clients (one per worker) each send part of a 256 KiB WRITE and pause, as
    a sender descheduled or slowed by its network would: while they pause another client
    is served, and when each sends the rest its value is stored (the daemon's checksum of
    the bytes it received, in order, matches the sender's)."""
    daemon = daemon_factory(tcp=True, extra=_tls_flags(pki) if secure else [])
    tls = TlsConfig(pki.cert("b"), pki.key("b"), pki.ca("ca")) if secure else None
    deadline = time.monotonic() + 30
    paused = []
    for i in range(16):
        conn = Connection(parse_address(daemon.tcp), wire.Hello(pid=os.getpid()), deadline, tls=tls)
        data = os.urandom(256 << 10)
        off = conn.call(wire.Reserve([f"p{i}"], [len(data)]), deadline, wire.ReserveReply).offsets[0]
        conn.send(wire.Write(off, len(data)), deadline)
        conn.sock.sendall(data[:100_000])
        paused.append((conn, off, data))
    until(lambda: all(daemon_queues(c.sock)[1] == 0 for c, _, _ in paused), 10, "the daemon took what was sent",
          every=PACED)
    serves(daemon, tcp=True, tls=tls)
    for i, (conn, off, data) in enumerate(paused):
        for part in (data[100_000:200_000], data[200_000:]):
            conn.sock.sendall(part)
        commit = conn.call(wire.Commit([f"p{i}"], [off], [checksum(data)]), deadline, wire.CommitReply)
        assert commit.stored == [True], f"value {i} did not arrive whole"
        conn.close()


def test_tls_clients_are_served_with_descriptors_past_fd_setsize(daemon_factory, pki, closing) -> None:
    """Session._tls_waiting calls select.select(), which refuses descriptors >= 1024: with
    ~1030 connections open (the default --max-connections is 1024) TLS sessions on high
    descriptors are dropped, and when the keeper meets one it dies (read and idle
    timeouts are then never enforced again)."""
    daemon = daemon_factory(tcp=True, extra=_tls_flags(pki) + ["--max-connections", "2000",
                                                                "--read-timeout", "1", "--drain-timeout", "1"])
    tls = TlsConfig(pki.cert("b"), pki.key("b"), pki.ca("ca"))
    while _fds(daemon.pid) < 1040:
        closing.append(socket.create_connection(_tcp(daemon), timeout=5))
        if len(closing) % 100 == 0:
            until(lambda: _fds(daemon.pid) >= len(closing), 10, "the daemon accepted them", every=PACED)
    serves(daemon, tcp=True, tls=tls)
    # the keeper still cuts a request that does not arrive whole within --read-timeout
    partial = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    closing.append(partial)
    partial.connect(os.path.join(daemon.dir, "ems.sock"))
    partial.sendall(b"E")
    partial.settimeout(6)
    try:
        assert partial.recv(1) == b""
    except ConnectionResetError:
        pass
    except socket.timeout:
        pytest.fail("a partial request was not cut after --read-timeout: the keeper thread is gone")


# ----------------------------------------------------------------------------- Redis

def test_one_oversized_value_does_not_take_the_remote_tier_down_for_everyone(daemon_factory, tmp_path) -> None:
    """A value over Redis's proto-max-bulk-len (512 MiB) fails its write-through; the tier
    then counts as down for 5 s (RedisTier._fault) and skips every tenant's writes and
    reads.  An honest value committed right after must still reach Redis."""
    need_redis()
    import redis

    from ems.server.tiers.remote import redis_key
    port = free_port()
    server = RedisServer(tmp_path / "redis", port)
    try:
        daemon = daemon_factory(capacity="1G", remote=f"redis://127.0.0.1:{port}/0")
        m = Raw(daemon, timeout=60)
        m.hello()
        size = (512 << 20) + 4096
        off = m.call(wire.Reserve(["big"], [size])).offsets[0]
        assert off >= 0
        m.call(wire.Commit(["big"], [off], [0]), 60)
        m.close()
        key = "honest\x00after-big"
        honest(daemon, key=key, timeout=10)
        client = redis.Redis(port=port)
        try:
            assert client.exists(redis_key("", key)) == 1, "the honest value was not written through"
        finally:
            client.close()
        daemon.stop()
    finally:
        server.stop()
