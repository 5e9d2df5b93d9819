"""The control protocol between clients and ``ems-server``: typed, versioned, one codec.

Frame: 4-byte big-endian length, then the body: 4-byte big-endian length of the JSON
``[op, {fields}]`` that follows, then raw UTF-8 text.  A key list (a ``List[str]`` field)
is ``[count, separator, nbytes]`` in the JSON and its keys, joined by the separator, in
the text (fields in declaration order): no per-key JSON values and no escaping of the
keys' NULs, so both sides handle a list in a few C calls.  Every message is a
dataclass with an :class:`Op`; :func:`encode` / :func:`decode` are the only codec, and the
HELLO exchange checks :data:`PROTOCOL_VERSION` before anything else is decoded.  Value
bytes never go through the codec: on a unix socket they move through the shared arena
(the HELLO reply carries the arena's memfd by SCM_RIGHTS); on TCP they follow a WRITE
frame or a READ reply as raw bytes.

A key on the wire is ``distribute_part + "\\0" + attribute_part`` (see :mod:`ems.keys`).
"""
from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Type

from .._errors import PoolDisconnected, PoolTimeout, ProtocolError

__all__ = [
    "PROTOCOL_VERSION", "Op", "Message", "encode", "decode", "send_msg", "recv_msg",
    "recv_exact", "Hello", "HelloReply", "Ping", "Pong", "Stats", "StatsReply", "Reserve",
    "ReserveReply", "Commit", "CommitReply", "Abort", "Get", "GetReply", "Release", "Drop",
    "Exists", "ExistsReply", "Write", "Read", "ReadReply", "Error", "Shutdown", "Ack", "Challenge",
    "SKIPPED", "NO_SPACE", "MAX_FRAME",
]

PROTOCOL_VERSION = 5
#: Largest control frame either side accepts.
MAX_FRAME = 64 << 20
#: Reserve reply offsets: the key already holds a value (nothing to write) / no room.
SKIPPED = -2
NO_SPACE = -1

_LEN = struct.Struct("!I")


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


_REGISTRY: Dict[int, Type["Message"]] = {}
#: Per message class: its key-list fields (``List[str]``), which the codec joins.
_KEY_LISTS: Dict[Type["Message"], Tuple[str, ...]] = {}
#: Separators tried in order; the first that no key contains is used.
_SEPARATORS = "\x1e\x1f\x1d\x1c\n"


class Message:
    """Base of all messages; subclasses are dataclasses with a class-level ``OP``."""

    OP: ClassVar[Op]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        op = int(cls.__dict__["OP"])
        if op in _REGISTRY:
            raise TypeError(f"duplicate wire op {op} for {cls.__name__}")
        _REGISTRY[op] = cls
        _KEY_LISTS[cls] = tuple(name for name, hint in cls.__dict__.get("__annotations__", {}).items()
                                if hint == "List[str]")


@dataclass
class Hello(Message):
    """First message on a connection: protocol version and tenant credentials."""

    OP = Op.HELLO
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


@dataclass
class Pong(Message):
    OP = Op.PONG
    instance: str = ""


@dataclass
class Stats(Message):
    OP = Op.STATS


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
    checksums: List[int] = field(default_factory=list)
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
    checksums: List[int] = field(default_factory=list)


@dataclass
class Release(Message):
    """One-way: end a lease."""

    OP = Op.RELEASE
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
    offset: int = 0
    size: int = 0


@dataclass
class Read(Message):
    """TCP only: send ``size`` bytes of a leased value at ``offset``."""

    OP = Op.READ
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


@dataclass
class Error(Message):
    """The request failed; ``kind`` is ``invalid``, ``auth``, ``version`` or ``internal``."""

    OP = Op.ERROR
    kind: str = "internal"
    message: str = ""


def _join(keys: List[str]) -> Tuple[str, str]:
    """A separator no key contains, and the keys joined by it."""
    for sep in _SEPARATORS:
        joined = sep.join(keys)
        if joined.count(sep) == len(keys) - 1 or not keys:
            return sep, joined
    # Keys holding every usual separator: take the first character none of them holds.
    used = set("".join(keys))
    sep = next(c for c in map(chr, range(1, 0x110000)) if c not in used)
    return sep, sep.join(keys)


def encode(msg: Message) -> bytes:
    """One frame (length prefix included) for ``msg``."""
    fields = msg.__dict__
    texts = []
    lists = _KEY_LISTS[type(msg)]
    if lists:
        fields = dict(fields)
        for name in lists:
            sep, joined = _join(fields[name])
            text = joined.encode()
            fields[name] = [len(fields[name]), sep, len(text)]
            texts.append(text)
    head = json.dumps([int(msg.OP), fields], separators=(",", ":")).encode()
    body = b"".join([_LEN.pack(len(head)), head, *texts])
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> Message:
    """The message in a frame body; raises :class:`ProtocolError` if it is malformed."""
    try:
        (n,) = _LEN.unpack_from(body)
        at = _LEN.size + n
        op, fields = json.loads(body[_LEN.size:at])
        cls = _REGISTRY[int(op)]
        for name in _KEY_LISTS[cls]:
            if name not in fields:
                continue
            count, sep, nbytes = fields[name]
            if not isinstance(sep, str) or len(sep) != 1 or not isinstance(nbytes, int) or nbytes < 0:
                raise ValueError(f"{name}: a key list must be [count, separator, nbytes]")
            keys = body[at:at + nbytes].decode().split(sep) if count else []
            at += nbytes
            if len(keys) != count:
                raise ValueError(f"{name}: {len(keys)} keys where {count} were announced")
            fields[name] = keys
        if at != len(body):
            raise ValueError("key text does not match the announced lengths")
        return cls(**fields)
    except (ValueError, TypeError, KeyError, struct.error, RecursionError) as exc:
        raise ProtocolError(f"malformed control message: {exc}") from None


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


def recv_msg(sock: socket.socket, deadline: Optional[float] = None,
             want_fds: int = 0, max_frame: int = MAX_FRAME) -> Tuple[Message, List[int]]:
    """Receive one frame (and up to ``want_fds`` descriptors) before ``deadline``; a frame
    announced larger than ``max_frame`` is refused before anything is allocated."""
    fds: List[int] = []
    head = bytearray(_LEN.size)
    if want_fds:
        try:
            _timeout(sock, deadline)
            data, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, want_fds)
        except socket.timeout:
            raise PoolTimeout("deadline passed while waiting for the pool") from None
        except OSError as exc:
            raise PoolDisconnected(f"connection to the pool broke: {exc}") from None
        if not data:
            raise PoolDisconnected("the pool closed the connection")
        head[: len(data)] = data
        if len(data) < _LEN.size:
            recv_exact(sock, memoryview(head)[len(data):], deadline)
    else:
        recv_exact(sock, memoryview(head), deadline)
    (n,) = _LEN.unpack(head)
    if n > max_frame:
        raise ProtocolError(f"control frame of {n} bytes exceeds {max_frame}")
    body = bytearray(n)
    recv_exact(sock, memoryview(body), deadline)
    return decode(bytes(body)), fds
