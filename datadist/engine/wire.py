"""The link protocol: typed, versioned control messages on the project's frame codec.

A frame (:mod:`datadist.engine.codec`) is a fixed header ``<4sBBHII`` (magic, version,
message type, reserved, body length, array length), a binary body holding the message's
fields, and an optional array section (``uint64`` plan halves; never payload).  The body
layout is derived from each message's field annotations: ``int`` (int64), ``U64`` (uint64)
and ``bool`` fields packed together in declaration order, then ``str`` (UTF-8) and
``Dict``/``List`` (JSON) fields, each with a length prefix.  Hot messages are all-numeric,
so they cost one ``struct`` call per side.  Payload bytes follow a frame on the same
stream only where a message says so (``PUSH``: the sender streams the plan's bytes right
after the frame; ``PULL``: the server answers with a ``REPLY`` and then the bytes); a
``summed`` request's payload is followed by its sender's 8-byte checksum.  ``SUM`` asks the
owner of a plan half for the checksum of its bytes (a one-sided copy's check), answered
with ``SUMMED``.
The peer's version is checked before anything else is decoded.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from enum import IntEnum
from ssl import SSLSocket
from typing import Any, ClassVar, Collection, Dict, List, NamedTuple, Optional

from . import native, tls
from .codec import HEADER_SIZE, U64, Buffer, FrameFormat, WireError

__all__ = [
    "VERSION", "U64", "MsgType", "Message", "Hello", "HelloAck", "Attach", "Resolve", "Resolved",
    "ReleaseKey", "Push", "Pull", "Sum", "Summed", "Reply", "Unlink", "Notify", "Note", "Fence", "encode", "read_message", "read_frame", "whole_frame", "Frame", "read_answer", "finish_answer", "OK", "OK_FRAME", "WireError",
    "PRE_LINK", "HEADER_SIZE", "parse_header", "decode_frame", "FORMAT",
]

MAGIC = b"DDKV"
#: 4: ``PUSH`` and ``PULL`` carry ``summed`` (end-to-end checksums); peers of another
#: version refuse to link.
#: 5: ``SUM`` / ``SUMMED`` (checksums of one-sided copies).
#: 6: ``FENCE`` (memory freed waits for the same-host peer's copies: :mod:`.fences`).
VERSION = 6
_MAX_BODY = 16 << 20


class MsgType(IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    ATTACH = 3
    RESOLVE = 4
    RESOLVED = 5
    RELEASE_KEY = 6
    PUSH = 7
    PULL = 8
    REPLY = 9
    UNLINK = 10
    NOTIFY = 11
    NOTE = 12
    SUM = 13
    SUMMED = 14
    FENCE = 15


@dataclass
class Message:
    """Base of all control messages; ``arrays`` travel in the binary section."""

    TYPE: ClassVar[MsgType]
    arrays: List[Any] = field(default_factory=list, repr=False)


@dataclass
class Hello(Message):
    """First frame of a link, client -> server, on the client's request connection."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    cluster_id: U64 = 0
    role: int = 0
    host: str = ""
    pid: int = 0
    ctrl: Dict[str, Any] = field(default_factory=dict)             # {"fd", "size", "base"} of the epoch page
    arenas: List[Dict[str, Any]] = field(default_factory=list)     # [{"fd", "size", "base"}]
    device_regions: List[Dict[str, Any]] = field(default_factory=list)  # CUDA IPC regions of the device pool
    backend: str = "auto"
    device: str = "cpu"                             # where the engine's device caches live: "cpu", "cuda:N", "npu:N"
    remote_cluster_id: U64 = 0                      # whom the client expects to reach
    # With a link secret (datadist.engine.auth): the sender's fresh nonce and its proof,
    # hex.  The first HELLO then carries identity only, none of the memory fields above.
    nonce: str = ""
    proof: str = ""
    # The attach token of the link this process holds with the server (hex), when it
    # links again: only with it may a link the server still holds for it be replaced.
    relink: str = ""


@dataclass
class HelloAck(Hello):
    TYPE: ClassVar[MsgType] = MsgType.HELLO_ACK
    status: int = 0
    message: str = ""
    path: str = "tcp"                               # what the server will use towards the client
    store_port: int = 0                             # collective links: the server's TCPStore
    attach_token: str = ""                          # what the client's ATTACH must carry (hex)
    challenge: bool = False                         # an authentication challenge, not an answer


@dataclass
class Attach(Message):
    """Second connection of a link: the one the server initiates requests on."""

    TYPE: ClassVar[MsgType] = MsgType.ATTACH
    cluster_id: U64 = 0
    token: str = ""       # the HELLO_ACK's attach_token: only the peer that linked may attach


@dataclass
class Resolve(Message):
    """Find a cache by key: kind is "id" (cache_id, batch_index), "key" (CacheKey fields)
    or "blocks" (BlocksCacheKey fields)."""

    TYPE: ClassVar[MsgType] = MsgType.RESOLVE
    kind: str = "id"
    cluster_id: U64 = 0
    cache_id: int = 0
    batch_index: int = 0
    req_id: U64 = 0
    model_id: U64 = 0
    prefix_id: U64 = 0


@dataclass
class Resolved(Message):
    """The cache a key names; ``arrays[0]`` holds its tensor addresses."""

    TYPE: ClassVar[MsgType] = MsgType.RESOLVED
    status: int = 0
    message: str = ""
    cache_id: int = 0
    row: int = 0
    num_tensors: int = 0
    tensor_size: int = 0
    batch_size: int = 0
    is_blocks: bool = False
    dtype: str = ""
    epoch: U64 = 0
    watched: bool = False     # the owner keeps arrival notices for this cache
    device: str = "cpu"       # where its tensors live: "cpu" or "cuda:N"
    ipc: List[Dict[str, Any]] = field(default_factory=list)   # CUDA IPC regions covering a device cache


@dataclass
class ReleaseKey(Message):
    TYPE: ClassVar[MsgType] = MsgType.RELEASE_KEY
    cluster_id: U64 = 0
    req_id: U64 = 0
    model_id: U64 = 0
    prefix_id: U64 = 0


@dataclass
class Push(Message):
    """Bytes for cache ``cache_id`` follow; arrays: the server's half of the plan."""

    TYPE: ClassVar[MsgType] = MsgType.PUSH
    cache_id: int = 0
    epoch: U64 = 0
    nbytes: U64 = 0
    via: int = 0          # 0: bytes follow on this stream; 1: through the link's process group
    # The payload on the stream is followed by its sender's checksum (8 bytes, little-endian;
    # transports/checked.py): the initiator asked for end-to-end integrity.
    summed: bool = False


@dataclass
class Pull(Push):
    """Send the bytes of the plan half in ``arrays`` from cache ``cache_id``."""

    TYPE: ClassVar[MsgType] = MsgType.PULL


@dataclass
class Sum(Push):
    """The owner's checksum of the plan half in ``arrays`` of cache ``cache_id`` (its bytes
    as they are when it reads them, in plan order: what a one-sided copy of that plan
    moves); answered with ``SUMMED``, and no payload moves either way."""

    TYPE: ClassVar[MsgType] = MsgType.SUM


@dataclass
class Summed(Message):
    """The answer to ``SUM``: the checksum (``status`` 0), or why there is none."""

    TYPE: ClassVar[MsgType] = MsgType.SUMMED
    status: int = 0
    checksum: U64 = 0
    message: str = ""


@dataclass
class Reply(Message):
    TYPE: ClassVar[MsgType] = MsgType.REPLY
    status: int = 0
    message: str = ""


@dataclass
class Notify(Message):
    """One-way, initiator -> receiver after a push: tensors [t_lo, t_hi) of ``cache_id``
    were written (``status`` 0) or a push into them failed.  Never answered."""

    TYPE: ClassVar[MsgType] = MsgType.NOTIFY
    cluster_id: U64 = 0
    cache_id: int = 0
    t_lo: int = 0
    t_hi: int = 0
    nbytes: U64 = 0
    status: int = 0
    message: str = ""


@dataclass
class Note(Message):
    """One-way, initiator -> receiver: an application's message (``send_notification``),
    e.g. "the blocks of request r were pulled".  The receiver files it under the link's
    authenticated peer, never under a cluster id the frame claims.  Never answered."""

    TYPE: ClassVar[MsgType] = MsgType.NOTE
    text: str = ""


@dataclass
class Unlink(Message):
    TYPE: ClassVar[MsgType] = MsgType.UNLINK
    cluster_id: U64 = 0


@dataclass
class Fence(Message):
    """Memory of the sender was freed (its epoch moved): answered with a ``REPLY`` once no
    copy of the receiver's into or out of the sender's memory that began before is under
    way (:mod:`.fences`)."""

    TYPE: ClassVar[MsgType] = MsgType.FENCE


#: Frames a peer may send before it is linked (the first frame of a connection).
PRE_LINK = (MsgType.HELLO, MsgType.ATTACH)
#: Largest body and array section of each message type, checked before anything is
#: allocated: the messages that open a link are small, only the plan halves of a request
#: and a cache's tensor addresses carry arrays.
_PRE_LINK_BODY = 64 << 10
_MAX_ARRAYS = 1 << 30

#: The link protocol on the frame codec: every message class, its type and its limits.  A
#: frame carries at most 4 arrays (a plan half is 3); decoded arrays are views of one
#: aligned copy of the frame's array section.
FORMAT: FrameFormat[Message] = FrameFormat("datadist link", MAGIC, VERSION, MsgType, arrays="arrays",
                                           max_array_count=4)
_LIMITS: dict[type[Message], tuple[int, int]] = {
    **{cls: (_PRE_LINK_BODY, 0) for cls in (Hello, Attach, Unlink, Reply, Summed, Notify, Note, Resolve, ReleaseKey,
                                            Fence)},
    HelloAck: (_MAX_BODY, 0),
    **{cls: (_MAX_BODY, _MAX_ARRAYS) for cls in (Resolved, Push, Pull, Sum)},
}
for _cls, (_body, _arrays) in _LIMITS.items():
    FORMAT.register(_cls, _cls.TYPE, _body, _arrays)
FORMAT.compile()

#: One frame for a message (:class:`~datadist.engine.codec.EncodeError`, a ``ValueError``,
#: if the message holds values the format cannot carry).
encode = FORMAT.encode


#: The frames that answer a request (anything else in their place breaks the link).
_ANSWERS = frozenset({MsgType.REPLY, MsgType.RESOLVED, MsgType.SUMMED})

#: The answer that says "done", and its frame: the most common frame by far, so it is
#: encoded once and recognized whole (:func:`read_answer`).
OK = Reply()
OK_FRAME = encode(OK)


#: Frames larger than this are read a piece of this size at a time, so memory grows with
#: the bytes that arrived, never with what a header announced.
_PIECE = 1 << 20


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    """``n`` bytes from ``sock`` within its timeout (one timeout for all of them).  The C
    loop polls only when no data is waiting; Python's timeout mode would poll before every
    read (one system call more per read, on the path of every small transfer).  A TLS
    socket is read through TLS."""
    timeout = sock.gettimeout()
    if n <= _PIECE:  # every small frame: no clock read on this path
        return _recv_piece(sock, n, timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    buf = bytearray()
    while len(buf) < n:
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        buf += _recv_piece(sock, min(_PIECE, n - len(buf)), left)
    return buf


def _recv_piece(sock: socket.socket, n: int, left: Optional[float]) -> bytearray:
    """``n`` bytes from ``sock`` within ``left`` seconds (None: no limit)."""
    buf = bytearray(n)
    if isinstance(sock, SSLSocket):
        tls.recv_exact(sock, buf, left)
        return buf
    native.recv_exact(sock.fileno(), buf, 1 << 40 if left is None else max(1, int(left * 1000)))
    return buf


def parse_header(head: Buffer, allowed: Optional[Collection[int]] = None) -> tuple[type[Message], int, int]:
    """Check a frame header: our magic and version, a known type (one of ``allowed`` if
    given) and sizes within that type's limits.  Returns ``(class, body bytes, array
    bytes)``; raises :class:`WireError` before the caller allocates anything."""
    return FORMAT.parse_header(head, allowed)


def decode_frame(cls: type[Message], data: Buffer, blen: int) -> Message:
    """Decode a frame's body and array section (``data``, sized by :func:`parse_header`).
    Anything malformed, truncated or of the wrong type raises :class:`WireError`, so a
    hostile frame costs its sender the connection and nothing else."""
    return FORMAT.decode_frame(cls, data, blen)


def read_message(sock: socket.socket, allowed: Optional[Collection[int]] = None) -> Message:
    """Read one frame (blocking within the socket's timeout) and decode it.

    Raises ``ConnectionResetError`` at end of stream, ``socket.timeout`` at the socket's
    deadline and :class:`WireError` for a foreign, oversized or malformed frame, or one
    whose type is not in ``allowed``.
    """
    frame = read_frame(sock, allowed)
    return FORMAT.decode_frame(frame.cls, frame.data, frame.blen)


def read_answer(sock: socket.socket) -> Message:
    """Read one answer to a request (errors as :func:`read_message`).  No answer frame is
    shorter than :data:`OK_FRAME`, so that many bytes are read first in one call, and when
    they are ``OK_FRAME`` the answer is :data:`OK` without decoding; a shorter frame is
    not an answer (``WireError``), and nothing past the frame is read (a pull's payload
    follows it)."""
    return finish_answer(sock, _recv_exact(sock, len(OK_FRAME)))


def finish_answer(sock: socket.socket, head: bytes | bytearray) -> Message:
    """The answer whose first ``len(OK_FRAME)`` bytes are ``head`` (the rest, if any, read
    from ``sock`` within its timeout); errors as :func:`read_answer`."""
    if head == OK_FRAME:
        return OK
    cls, blen, alen = FORMAT.parse_header(head[:HEADER_SIZE], _ANSWERS)
    rest = HEADER_SIZE + blen + alen - len(head)
    if rest < 0:
        raise WireError(f"a {cls.__name__} of {HEADER_SIZE + blen + alen} bytes is no answer")
    data = head[HEADER_SIZE:] + _recv_exact(sock, rest) if rest else head[HEADER_SIZE:]
    return FORMAT.decode_frame(cls, data, blen)


class Frame(NamedTuple):
    """A frame read but not decoded: its class, its body and array section (for
    :func:`decode_frame`), the body's length, and the whole frame's bytes when it is small
    enough to be remembered by them (``keep`` of :func:`read_frame`), else None."""

    cls: type[Message]
    data: Buffer
    blen: int
    raw: Optional[bytes]


def whole_frame(data: bytes, allowed: Optional[Collection[int]] = None, *, keep: int = 0) -> Frame:
    """The frame that ``data`` holds, all of it and nothing more (read before, as it came);
    its header checked as :func:`read_frame` checks it."""
    cls, blen, alen = FORMAT.parse_header(data[:HEADER_SIZE], allowed)
    if len(data) != HEADER_SIZE + blen + alen:
        raise WireError(f"a frame of {HEADER_SIZE + blen + alen} bytes given as {len(data)}")
    return Frame(cls, memoryview(data)[HEADER_SIZE:], blen, data if len(data) <= keep else None)


def read_frame(sock: socket.socket, allowed: Optional[Collection[int]] = None, *, got: bytes = b"",
               keep: int = 0) -> Frame:
    """Read one frame without decoding it; errors as :func:`read_message`.  ``got``: its
    first bytes, read already (its header, or all of it); the header is checked before
    anything more is read.  ``raw`` is kept for frames of at most ``keep`` bytes."""
    head = got[:HEADER_SIZE] if got else _recv_exact(sock, HEADER_SIZE)
    cls, blen, alen = FORMAT.parse_header(head, allowed)
    size = HEADER_SIZE + blen + alen
    if len(got) == size:
        return Frame(cls, memoryview(got)[HEADER_SIZE:], blen, got if size <= keep else None)
    data = _recv_exact(sock, blen + alen)
    return Frame(cls, data, blen, bytes(head) + data if size <= keep else None)
