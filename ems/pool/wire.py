"""The control protocol between clients and ``ems-server``: typed, versioned, one codec.

Frames are those of :mod:`datadist.engine.codec` (the link protocol's codec): a 16-byte
header (magic ``EMSP``, :data:`PROTOCOL_VERSION`, the :class:`Op`, body length) checked
against the op's size limit before anything is allocated, then a binary body derived from
the message's dataclass fields: numbers and flags in one struct, strings length-prefixed,
``List[int]`` / ``List[U64]`` / ``List[bool]`` packed, and a key list (a ``List[str]``
field) as its count, a separator no key holds and the keys joined by it: no per-key
values and no escaping of the keys' NULs, so both sides handle a list in a few C calls.
Every message is a dataclass with an :class:`Op`; :func:`encode` / :func:`decode` are the
only codec, every malformed frame raises :class:`~ems._errors.ProtocolError` (a
:class:`~datadist.engine.codec.WireError`), and the HELLO exchange checks
:data:`PROTOCOL_VERSION` too (the header already carries it).  An :class:`Error` names its
cause by :class:`ErrorKind`.  Value bytes never go through the codec: on a unix socket
they move through the shared arena (the HELLO reply carries the arena's memfd by
SCM_RIGHTS); on TCP they follow a WRITE frame or a READ reply as raw bytes.

A key on the wire is ``distribute_part + "\\0" + attribute_part`` (see :mod:`ems.keys`).
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from datadist.engine.codec import HEADER_SIZE, U64, Buffer, FrameFormat

from .._errors import PoolDisconnected, PoolTimeout, ProtocolError

__all__ = [
    "PROTOCOL_VERSION", "frame_size", "Op", "Message", "encode", "decode", "send_msg", "recv_msg",
    "recv_exact", "Hello", "HelloReply", "Ping", "Pong", "Stats", "StatsReply", "Reserve",
    "ReserveReply", "Commit", "CommitReply", "Abort", "Get", "GetReply", "Release", "Drop",
    "Exists", "ExistsReply", "Write", "Read", "ReadReply", "Error", "ErrorKind", "Shutdown", "Ack", "Challenge",
    "SKIPPED", "NO_SPACE", "MAX_FRAME", "SMALL_FRAME", "MAX_KEYS", "FORMAT",
]

PROTOCOL_VERSION = 7
MAGIC = b"EMSP"
#: Largest control frame either side accepts (header excluded).
MAX_FRAME = 64 << 20
#: Largest frame of a request that carries no list (HELLO, PING, READ, ...).
SMALL_FRAME = 64 << 10
#: Most entries of one list in a frame (keys, offsets, ...): a decoded key costs a string
#: object (~50 bytes for a key of one character), so without this bound a 64 MiB frame of
#: short keys would cost the daemon gigabytes.  Clients send longer lists in batches.
MAX_KEYS = 1 << 16
#: Reserve reply offsets: the key already holds a value (nothing to write) / no room.
SKIPPED = -2
NO_SPACE = -1


class Op(IntEnum):
    """Message types; a reply type follows its request."""

    HELLO = 1
    HELLO_REPLY = 2
    PING = 3
    PONG = 4
    STATS = 5
    STATS_REPLY = 6
    RESERVE = 7
    RESERVE_REPLY = 8
    COMMIT = 9
    COMMIT_REPLY = 10
    ABORT = 11
    GET = 12
    GET_REPLY = 13
    RELEASE = 14
    DROP = 15
    EXISTS = 16
    EXISTS_REPLY = 17
    WRITE = 18
    READ = 19
    READ_REPLY = 20
    SHUTDOWN = 21
    ACK = 22
    CHALLENGE = 23
    ERROR = 99


class ErrorKind(IntEnum):
    """Why a request failed (:class:`Error`); the client maps ``AUTH`` at HELLO and
    ``INVALID`` later to a rejection, anything else to a broken pool."""

    INVALID = 1    # a malformed or out-of-place request
    AUTH = 2       # credentials or pool secret refused, or an operator-only request
    VERSION = 3    # another PROTOCOL_VERSION
    INTERNAL = 4   # the daemon failed (or is shutting down)
    BUSY = 5       # --max-connections reached


#: The pool protocol on the frame codec; every :class:`Message` subclass registers itself.
FORMAT: FrameFormat["Message"] = FrameFormat("ems pool", MAGIC, PROTOCOL_VERSION, Op, error=ProtocolError,
                                              max_items=MAX_KEYS)


class Message:
    """Base of all messages; subclasses are dataclasses with a class-level ``OP`` (and a
    ``LIMIT``: the largest body a receiver accepts, before allocating it)."""

    OP: ClassVar[Op]
    LIMIT: ClassVar[int] = MAX_FRAME

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        FORMAT.register(cls, cls.__dict__["OP"], cls.LIMIT)  # TypeError for an op registered twice


@dataclass
class Hello(Message):
    """First message on a connection: protocol version and tenant credentials."""

    OP = Op.HELLO
    LIMIT = SMALL_FRAME
    version: int = PROTOCOL_VERSION
    access_id: Optional[str] = None
    access_key: Optional[str] = None
    pid: int = 0
    shm: bool = True
    # With a pool secret (datadist.engine.handshake): the client's nonce, and its proof in
    # the second HELLO.  The first carries no credentials.
    nonce: str = ""
    proof: str = ""


@dataclass
class HelloReply(Message):
    """With ``shm``, two descriptors travel with it: the tenant's arena and its published
    key set (``keyset_size`` bytes, see :mod:`ems.pool.keyset`).  ``disk`` / ``remote``:
    which tiers below memory the daemon has (exists asks it about keys memory lacks)."""

    OP = Op.HELLO_REPLY
    instance: str = ""
    tenant: str = ""
    arena_size: int = 0
    capacity: int = 0
    shm: bool = False
    keyset_size: int = 0
    disk: bool = False
    remote: bool = False


@dataclass
class Ping(Message):
    OP = Op.PING
    LIMIT = SMALL_FRAME


@dataclass
class Pong(Message):
    OP = Op.PONG
    instance: str = ""


@dataclass
class Stats(Message):
    OP = Op.STATS
    LIMIT = SMALL_FRAME


@dataclass
class StatsReply(Message):
    OP = Op.STATS_REPLY
    stats: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Reserve(Message):
    """Phase one of a put: room for each value, invisible until committed."""

    OP = Op.RESERVE
    keys: List[str] = field(default_factory=list)
    sizes: List[int] = field(default_factory=list)
    skip_existing: bool = False


@dataclass
class ReserveReply(Message):
    OP = Op.RESERVE_REPLY
    offsets: List[int] = field(default_factory=list)


@dataclass
class Commit(Message):
    """Phase two: publish the written reservations (all-or-nothing per key)."""

    OP = Op.COMMIT
    keys: List[str] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)
    #: One per key (over TCP the daemon compares each with what it received), or none: the
    #: daemon takes those it summed receiving the WRITEs.
    checksums: List[U64] = field(default_factory=list)
    keep_local: bool = True


@dataclass
class CommitReply(Message):
    OP = Op.COMMIT_REPLY
    stored: List[bool] = field(default_factory=list)


@dataclass
class Abort(Message):
    """One-way: give reservations back unwritten."""

    OP = Op.ABORT
    offsets: List[int] = field(default_factory=list)


@dataclass
class Get(Message):
    """Pin the leading present keys for reading; the reply holds them under a lease."""

    OP = Op.GET
    keys: List[str] = field(default_factory=list)
    local_only: bool = False


@dataclass
class GetReply(Message):
    OP = Op.GET_REPLY
    lease: int = 0
    offsets: List[int] = field(default_factory=list)
    sizes: List[int] = field(default_factory=list)
    checksums: List[U64] = field(default_factory=list)


@dataclass
class Release(Message):
    """One-way: end a lease."""

    OP = Op.RELEASE
    LIMIT = SMALL_FRAME
    lease: int = 0


@dataclass
class Drop(Message):
    """These values failed their checksum at the reader; forget them.  Answered (ACK), so
    the reader's next ``exists``, answered from the published key set, no longer sees them."""

    OP = Op.DROP
    keys: List[str] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)


@dataclass
class Exists(Message):
    OP = Op.EXISTS
    keys: List[str] = field(default_factory=list)
    local_only: bool = False


@dataclass
class ExistsReply(Message):
    OP = Op.EXISTS_REPLY
    hits: int = 0


@dataclass
class Write(Message):
    """TCP only: ``size`` raw bytes for a reservation at ``offset`` follow the frame."""

    OP = Op.WRITE
    LIMIT = SMALL_FRAME
    offset: int = 0
    size: int = 0


@dataclass
class Read(Message):
    """TCP only: send ``size`` bytes of a leased value at ``offset``."""

    OP = Op.READ
    LIMIT = SMALL_FRAME
    offset: int = 0
    size: int = 0


@dataclass
class ReadReply(Message):
    """Followed by ``size`` raw bytes."""

    OP = Op.READ_REPLY
    size: int = 0


@dataclass
class Ack(Message):
    OP = Op.ACK


@dataclass
class Challenge(Message):
    """A pool with a secret answers an opening HELLO with its nonce and proof."""

    OP = Op.CHALLENGE
    nonce: str = ""
    proof: str = ""


@dataclass
class Shutdown(Message):
    OP = Op.SHUTDOWN
    LIMIT = SMALL_FRAME


@dataclass
class Error(Message):
    """The request failed, for the reason ``kind`` names."""

    OP = Op.ERROR
    kind: ErrorKind = ErrorKind.INTERNAL
    message: str = ""


FORMAT.compile()

#: One frame (header included) for a message; :class:`~datadist.engine.codec.EncodeError`
#: (a ``ValueError``) for one the format cannot carry.
encode = FORMAT.encode


def decode(frame: Buffer) -> Message:
    """The message in one whole frame (header included); raises :class:`ProtocolError` if
    it is malformed, truncated, oversized or not of this protocol and version."""
    return FORMAT.decode(frame)


def _timeout(sock: socket.socket, deadline: Optional[float]) -> None:
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise PoolTimeout("deadline passed")
    sock.settimeout(left)


def send_msg(sock: socket.socket, msg: Message, deadline: Optional[float] = None,
             fds: Sequence[int] = ()) -> None:
    """Send one frame (and file descriptors, on a unix socket) before ``deadline``."""
    frame = encode(msg)
    try:
        _timeout(sock, deadline)
        if fds:
            sent = socket.send_fds(sock, [frame], list(fds))
            if sent < len(frame):
                sock.sendall(frame[sent:])
        else:
            sock.sendall(frame)
    except socket.timeout:
        raise PoolTimeout("deadline passed while sending to the pool") from None
    except OSError as exc:
        raise PoolDisconnected(f"connection to the pool broke: {exc}") from None


def recv_exact(sock: socket.socket, view: memoryview, deadline: Optional[float]) -> None:
    """Fill ``view`` from ``sock`` before ``deadline``."""
    got, n = 0, len(view)
    try:
        while got < n:
            _timeout(sock, deadline)
            k = sock.recv_into(view[got:])
            if k == 0:
                raise PoolDisconnected("the pool closed the connection")
            got += k
    except socket.timeout:
        raise PoolTimeout("deadline passed while waiting for the pool") from None
    except (ConnectionError, OSError) as exc:
        if isinstance(exc, (PoolDisconnected, PoolTimeout)):
            raise
        raise PoolDisconnected(f"connection to the pool broke: {exc}") from None


def frame_size(head: Buffer, max_frame: int = MAX_FRAME) -> int:
    """The whole size (header included) of the frame whose header is ``head``; raises
    :class:`ProtocolError` for a header :func:`recv_msg` would refuse."""
    _cls, blen, alen = FORMAT.parse_header(head, max_frame=max_frame)
    return HEADER_SIZE + blen + alen


def recv_msg(sock: socket.socket, deadline: Optional[float] = None,
             want_fds: int = 0, max_frame: int = MAX_FRAME) -> Tuple[Message, List[int]]:
    """Receive one frame (and up to ``want_fds`` descriptors) before ``deadline``; a frame
    announced larger than ``max_frame`` is refused before anything is allocated."""
    fds: List[int] = []
    head = bytearray(HEADER_SIZE)
    got = 0
    if want_fds:
        try:
            _timeout(sock, deadline)
            data, fds, _flags, _addr = socket.recv_fds(sock, HEADER_SIZE, want_fds)
        except socket.timeout:
            raise PoolTimeout("deadline passed while waiting for the pool") from None
        except OSError as exc:
            raise PoolDisconnected(f"connection to the pool broke: {exc}") from None
        got = len(data)
        head[:got] = data
    try:
        if want_fds and not got:
            raise PoolDisconnected("the pool closed the connection")
        if got < HEADER_SIZE:
            recv_exact(sock, memoryview(head)[got:], deadline)
        cls, blen, alen = FORMAT.parse_header(head, max_frame=max_frame)
        body = bytearray(blen + alen)
        recv_exact(sock, memoryview(body), deadline)
        return FORMAT.decode_frame(cls, body, blen), fds
    except BaseException:
        for fd in fds:  # a frame refused or cut short: its descriptors are nobody's
            os.close(fd)
        raise
