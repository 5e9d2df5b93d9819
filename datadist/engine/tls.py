"""TLS for link connections (optional): mutual TLS with one CA as the trust anchor, and
the payload path of a link whose sockets are TLS.

Both ends present a certificate and check the peer's chain against the configured CA;
host names are not checked, since engines address their peers by IP: any certificate the
CA signed is a valid peer.  Session tickets are off (no resumption), so nothing but the
link's own frames ever follows a handshake.

The C socket loops (:mod:`.native`) write and read raw descriptors, which would bypass
TLS.  A TLS link therefore moves a plan's runs through one contiguous staging buffer per
thread (:data:`STAGING_BYTES`): runs are gathered into it by the C copy loop and written
with one ``sendall`` per window; received windows are read into it with ``recv_into`` and
scattered by the same loop.  Plans are cut into windows with numpy, never run by run in
Python, and no payload byte passes through a ``bytes`` object.  Every read and write is
bounded by the caller's deadline.

An ``SSLSocket`` may hold decrypted bytes that ``poll`` on its descriptor does not show:
whoever waits for a link socket to become readable asks :func:`buffered` first.
"""
from __future__ import annotations

import os
import selectors
import socket
import ssl
import threading
import time
from typing import Optional, Sequence, Tuple

import numpy as np

from . import native
from .layout import Plan, U64Array

__all__ = ["STAGING_BYTES", "TlsConfig", "TlsFileError", "from_settings", "buffered", "handshake_step", "recv_exact", "send_plan",
           "recv_plan", "discard"]

#: Size of the per-thread staging buffer of TLS payloads.
STAGING_BYTES = 4 << 20
#: How often a long read sets its socket's timeout to the time left (see ``_recv_into``).
_REARM_S = 0.01
_U64 = np.uint64
_ZERO = np.zeros(1, dtype=_U64)
#: What each file must contain (checked before OpenSSL reads it, for a message that names
#: the right file).
_CERT_PEM = b"-----BEGIN CERTIFICATE-----"
_KEY_PEM = b"PRIVATE KEY-----"
_PEM_LIMIT = 1 << 20


class TlsFileError(ValueError):
    """A TLS file that cannot be used: which one (``role``: ``"cert"``, ``"key"`` or
    ``"ca"``), its path and why.  Never quotes the file's contents."""

    def __init__(self, role: str, path: str, why: str) -> None:
        super().__init__(f"{role} file {path!r} {why}")
        self.role, self.path, self.why = role, path, why


def _check_pem(role: str, path: str, marker: bytes, what: str) -> None:
    try:
        with open(path, "rb") as f:
            data = f.read(_PEM_LIMIT)
    except OSError as exc:
        raise TlsFileError(role, path, f"cannot be read: {exc.strerror or type(exc).__name__}") from None
    if marker not in data:
        raise TlsFileError(role, path, f"holds no PEM {what}")


def _no_password() -> bytes:
    # An encrypted key fails to load instead of OpenSSL prompting on the terminal.
    return b""


def _context(server: bool, cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if server:
        ctx.num_tickets = 0
    else:
        ctx.check_hostname = False  # peers are addressed by IP; the CA is the trust anchor
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (ssl.SSLError, OSError) as exc:
        raise TlsFileError("ca", ca_file, f"holds no usable CA certificate ({_reason(exc)})") from None
    try:
        ctx.load_cert_chain(cert_file, key_file, password=_no_password)
    except (ssl.SSLError, OSError) as exc:
        raise TlsFileError("key", key_file, f"cannot be used with the certificate {cert_file!r} (the "
                                            f"certificate's own key, unencrypted, is needed: {_reason(exc)})") from None
    return ctx


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    return getattr(exc, "strerror", None) or type(exc).__name__


class TlsConfig:
    """The certificate, key and CA files of an engine, and the server and client contexts
    built from them.  Building one reads and checks every file; :class:`TlsFileError` names
    the file that is unusable.  Shows and pickles its paths only."""

    __slots__ = ("cert_file", "key_file", "ca_file", "server", "client")

    def __init__(self, cert_file: str, key_file: str, ca_file: str) -> None:
        self.cert_file, self.key_file, self.ca_file = cert_file, key_file, ca_file
        _check_pem("cert", cert_file, _CERT_PEM, "certificate")
        _check_pem("key", key_file, _KEY_PEM, "private key")
        _check_pem("ca", ca_file, _CERT_PEM, "certificate")
        self.server = _context(True, cert_file, key_file, ca_file)
        self.client = _context(False, cert_file, key_file, ca_file)

    def _paths(self) -> tuple[str, str, str]:
        return self.cert_file, self.key_file, self.ca_file

    def __repr__(self) -> str:
        return f"TlsConfig(cert_file={self.cert_file!r}, key_file={self.key_file!r}, ca_file={self.ca_file!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TlsConfig) and self._paths() == other._paths()

    def __hash__(self) -> int:
        return hash(self._paths())

    def __reduce__(self) -> tuple[type["TlsConfig"], tuple[str, str, str]]:
        return TlsConfig, self._paths()

    def connect(self, sock: socket.socket) -> ssl.SSLSocket:
        """The client side over a connected socket, handshake done within the socket's
        timeout (``ssl.SSLError``, an ``OSError``, if it fails; the socket is closed then)."""
        return self.client.wrap_socket(sock)

    def accept(self, sock: socket.socket) -> ssl.SSLSocket:
        """The server side over an accepted non-blocking socket; the handshake is left to
        :func:`handshake_step`."""
        return self.server.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)


def from_settings(given: Sequence[Tuple[str, Optional[str]]],
                  environment: Sequence[str]) -> Optional[TlsConfig]:
    """TLS from the certificate, key and CA settings ``given`` (in that order, each
    ``(its name in messages, path or None)``), all or none; when none is given, from the
    environment variables named by ``environment`` (same order), all or none.  None when
    neither gives any.  An incomplete set or an unusable file is a ``ValueError`` naming
    the setting (or variable) and the path, never a file's contents."""
    named = list(given) if any(path for _, path in given) else \
        [(f"environment variable {env}", os.environ.get(env) or None) for env in environment]
    if not any(path for _, path in named):
        return None
    missing = [name for name, path in named if not path]
    if missing:
        raise ValueError(f"TLS needs a certificate, its key and a CA file: {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set (set all three, or none)")
    try:
        return TlsConfig(*(str(path) for _, path in named))
    except TlsFileError as exc:
        name = named[("cert", "key", "ca").index(exc.role)][0]
        raise ValueError(f"{name} = {exc.path!r} is invalid: the file {exc.why}") from None


def handshake_step(sock: ssl.SSLSocket) -> int:
    """Advance a non-blocking handshake: 0 once it is done, else the selector events to
    wait for.  Raises ``ssl.SSLError`` (a refused certificate, a peer that does not speak
    TLS) or ``OSError``."""
    try:
        sock.do_handshake()
    except ssl.SSLWantReadError:
        return selectors.EVENT_READ
    except ssl.SSLWantWriteError:
        return selectors.EVENT_WRITE
    return 0


def buffered(sock: Optional[socket.socket]) -> bool:
    """Whether ``sock`` is a TLS socket holding decrypted bytes not read yet (a poll on
    its descriptor does not show them)."""
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0


# -- the payload path ----------------------------------------------------------------------
class _Staging(threading.local):
    """One staging buffer per thread that moves TLS payloads (the agent's, each caller's)."""

    buf: Optional[np.ndarray] = None
    got: tuple[memoryview, int] = (memoryview(b""), 0)

    def get(self) -> tuple[memoryview, int]:
        """The buffer and its address (allocated on first use, kept for the thread's life)."""
        if self.buf is None or self.buf.shape[0] < STAGING_BYTES:
            self.buf = np.empty(STAGING_BYTES, dtype=np.uint8)
            self.got = (self.buf.data, int(self.buf.ctypes.data))
        return self.got


_staging = _Staging()


class _Stream:
    """One side of a plan as a byte stream: its runs in execution order, and the plan
    between a window ``[lo, hi)`` of that stream and staging memory."""

    __slots__ = ("addrs", "lens", "starts", "ends", "total")

    def __init__(self, addrs: U64Array, lens: U64Array) -> None:
        self.addrs, self.lens = addrs, lens
        self.ends = np.cumsum(lens, dtype=_U64)
        self.starts = self.ends - lens
        self.total = int(self.ends[-1]) if lens.shape[0] else 0

    def window(self, lo: int, hi: int, staging: int, gather: bool) -> Plan:
        """The copy between stream bytes ``[lo, hi)`` and staging memory at ``staging``
        (``gather``: runs -> staging)."""
        first = int(np.searchsorted(self.ends, _U64(lo), side="right"))
        last = int(np.searchsorted(self.starts, _U64(hi), side="left"))
        starts = self.starts[first:last]
        begin = np.maximum(starts, _U64(lo))
        lens = np.minimum(self.ends[first:last], _U64(hi)) - begin
        mem = self.addrs[first:last] + (begin - starts)
        packed = (begin - _U64(lo)) + _U64(staging)
        if gather:
            return Plan(_ZERO, _ZERO, mem, packed, lens)
        return Plan(_ZERO, _ZERO, packed, mem, lens)


def _packed(half_bases: U64Array, half_offs: U64Array, lens: U64Array, staging: int,
            gather: bool) -> Plan:
    """The copy between one side of a whole plan and staging memory at ``staging``, its
    runs packed back to back in execution order (tensor-major)."""
    if lens.shape[0] == 1 and half_bases.shape[0] == 1:  # one run: the common small call
        bases, offs = np.array([staging], dtype=_U64), _ZERO
    else:
        offs = np.zeros(lens.shape[0], dtype=_U64)
        if lens.shape[0] > 1:
            np.cumsum(lens[:-1], out=offs[1:])
        per_tensor = int(lens.sum())
        bases = np.arange(half_bases.shape[0], dtype=_U64) * _U64(per_tensor) + _U64(staging)
    if gather:
        return Plan(half_bases, bases, half_offs, offs, lens)
    return Plan(bases, half_bases, offs, half_offs, lens)


def _nbytes(plan: Plan) -> int:
    """``plan.nbytes``, a little faster for the one-run plans of small calls."""
    if plan.lens.shape[0] == 1:
        return int(plan.lens[0]) * int(plan.src_bases.shape[0])
    return plan.nbytes


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _read(sock: socket.socket, view: memoryview) -> int:
    """One read; 0 at end of stream, also when the peer ended it without TLS's goodbye
    (a process that exits or closes without ``unwrap``: every peer, here)."""
    try:
        return sock.recv_into(view)
    except ssl.SSLEOFError:
        return 0


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` before ``deadline``.  A TLS read returns one record (16 KiB) at most,
    so this loops many times per window; the socket's timeout (a system call to set) is
    set to the time left only every :data:`_REARM_S`, and the clock is checked after each
    read: no read ends more than :data:`_REARM_S` past the deadline."""
    got, want = 0, len(view)
    armed = 0.0
    while got < want:
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError("deadline passed")
        if now - armed >= _REARM_S:
            sock.settimeout(deadline - now)
            armed = now
        n = _read(sock, view[got:])
        if not n:
            raise ConnectionResetError("the peer closed the connection")
        got += n


def _send(sock: socket.socket, view: memoryview, deadline: float) -> None:
    # One write call honours the whole timeout as a deadline (the ssl module waits for
    # each retry with what is left of it); the windows are what sendall loops over.
    sock.settimeout(_left(deadline))
    sock.sendall(view)


def recv_exact(sock: socket.socket, buf: bytearray, timeout: Optional[float]) -> None:
    """Fill ``buf`` from the TLS socket within ``timeout`` seconds (None: the socket's
    blocking mode).  Raises ``TimeoutError`` or ``ConnectionResetError`` (end of stream).
    The first read runs under the socket's own timeout: a frame that is there already
    (the common case) costs one call."""
    view = memoryview(buf)
    if not view:
        return
    start = time.monotonic()
    got = _read(sock, view)
    if got == len(view):
        return
    if not got:
        raise ConnectionResetError("the peer closed the connection")
    before = sock.gettimeout()
    try:
        _recv_into(sock, view[got:], start + (1e9 if timeout is None else timeout))
    finally:
        sock.settimeout(before)


def send_plan(sock: socket.socket, plan: Plan, deadline: float, head: bytes = b"",
              summed: Optional[native.StreamSums] = None) -> None:
    """Write ``head`` (a frame) and then the plan's source runs (host memory), in order,
    through the thread's staging buffer, before ``deadline`` (``TimeoutError``).  A plan
    that fits the buffer with its frame is one copy and one write.  With ``summed``, the
    staged runs are added to its block sums (see :func:`.native.sock_send`)."""
    view, addr = _staging.get()
    total, fill = _nbytes(plan), len(head)
    before = sock.gettimeout()
    try:
        if fill + total <= STAGING_BYTES:
            view[:fill] = head
            if total:
                native.copy_plan(_packed(plan.src_bases, plan.src_offs, plan.lens, addr + fill, gather=True))
                if summed is not None:
                    native.sum_stream(view[fill:fill + total], summed)
            _send(sock, view[:fill + total], deadline)
            return
        if fill > STAGING_BYTES // 2:
            _send(sock, memoryview(head), deadline)
            fill = 0
        else:
            view[:fill] = head
        stream, pos = _Stream(*plan.src_runs()), 0
        while pos < total:
            take = min(STAGING_BYTES - fill, total - pos)
            native.copy_plan(stream.window(pos, pos + take, addr + fill, gather=True))
            if summed is not None:
                native.sum_stream(view[fill:fill + take], summed)
            _send(sock, view[:fill + take], deadline)
            pos, fill = pos + take, 0
    finally:
        sock.settimeout(before)


def recv_plan(sock: socket.socket, plan: Plan, deadline: float, summed: Optional[native.StreamSums] = None) -> None:
    """Read the plan's destination runs (host memory), in order, from the TLS socket
    through the thread's staging buffer, before ``deadline`` (with ``summed``: adding the
    staged bytes to its block sums).  Raises ``TimeoutError``, ``ConnectionResetError``
    (end of stream) or ``ssl.SSLError``."""
    total = _nbytes(plan)
    if not total:
        return
    view, addr = _staging.get()
    before = sock.gettimeout()
    try:
        if total <= STAGING_BYTES:
            _recv_into(sock, view[:total], deadline)
            if summed is not None:
                native.sum_stream(view[:total], summed)
            native.copy_plan(_packed(plan.dst_bases, plan.dst_offs, plan.lens, addr, gather=False))
            return
        stream, pos = _Stream(*plan.dst_runs()), 0
        while pos < total:
            take = min(STAGING_BYTES, total - pos)
            _recv_into(sock, view[:take], deadline)
            if summed is not None:
                native.sum_stream(view[:take], summed)
            native.copy_plan(stream.window(pos, pos + take, addr, gather=False))
            pos += take
    finally:
        sock.settimeout(before)


def discard(sock: socket.socket, nbytes: int, deadline: float) -> None:
    """Read and drop ``nbytes`` from the TLS socket (a refused push's payload)."""
    view, _ = _staging.get()
    before = sock.gettimeout()
    try:
        while nbytes > 0:
            take = min(STAGING_BYTES, nbytes)
            _recv_into(sock, view[:take], deadline)
            nbytes -= take
    finally:
        sock.settimeout(before)
