"""The link protocol: typed, versioned control messages, one codec.

A frame is a fixed header ``<4sBBHII`` (magic, version, message type, reserved, body
length, array length), a binary body holding the message's fields, and an optional array
section (``uint64`` plan halves; never payload).  The body layout is derived from each
message's field annotations: ``int`` (int64), ``U64`` (uint64) and ``bool`` fields packed
together in declaration order, then ``str`` (UTF-8) and ``dict``/``list`` (JSON) fields,
each with a length prefix.  Hot messages are all-numeric, so they cost one ``struct``
call per side.  Payload bytes follow a frame on the same
stream only where a message says so (``PUSH``: the sender streams the plan's bytes right
after the frame; ``PULL``: the server answers with a ``REPLY`` and then the bytes).
The peer's version is checked before anything else is decoded.
"""
from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any, ClassVar, Optional

import numpy as np

from . import native

__all__ = [
    "VERSION", "U64", "MsgType", "Message", "Hello", "HelloAck", "Attach", "Resolve", "Resolved",
    "ReleaseKey", "Push", "Pull", "Reply", "Unlink", "Notify", "Note", "encode", "read_message", "WireError",
    "PRE_LINK", "HEADER_SIZE", "parse_header", "decode_frame",
]

#: Annotation of fields that hold unsigned 64-bit values (keys, cluster ids).
U64 = int

MAGIC = b"DDKV"
VERSION = 3
_HEADER = struct.Struct("<4sBBHII")
_MAX_BODY = 16 << 20
_JSON = json.JSONEncoder(separators=(",", ":"))


class WireError(Exception):
    """The stream does not carry a valid frame of our protocol and version."""


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


@dataclass
class Message:
    """Base of all control messages; ``arrays`` travel in the binary section."""

    TYPE: ClassVar[MsgType]
    arrays: list = field(default_factory=list, repr=False)


@dataclass
class Hello(Message):
    """First frame of a link, client -> server, on the client's request connection."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    cluster_id: U64 = 0
    role: int = 0
    host: str = ""
    pid: int = 0
    ctrl: dict = field(default_factory=dict)       # {"fd", "size", "base"} of the epoch page
    arenas: list = field(default_factory=list)      # [{"fd", "size", "base"}]
    device_regions: list = field(default_factory=list)  # CUDA IPC regions of the device pool
    backend: str = "auto"
    remote_cluster_id: U64 = 0                      # whom the client expects to reach
    # With a link secret (datadist.engine.auth): the sender's fresh nonce and its proof,
    # hex.  The first HELLO then carries identity only, none of the memory fields above.
    nonce: str = ""
    proof: str = ""


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
    ipc: list = field(default_factory=list)   # CUDA IPC regions covering a device cache


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


@dataclass
class Pull(Push):
    """Send the bytes of the plan half in ``arrays`` from cache ``cache_id``."""

    TYPE: ClassVar[MsgType] = MsgType.PULL


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


_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, HelloAck, Attach, Resolve, Resolved, ReleaseKey, Push, Pull, Reply, Unlink, Notify,
                                 Note)
}


class _Schema:
    """How one message class is laid out in a body (see the module docstring)."""

    _FIXED = {"int": "q", "U64": "Q", "bool": "?"}

    def __init__(self, cls: type) -> None:
        flds = [f for f in fields(cls) if f.name != "arrays"]
        self.fixed = [f.name for f in flds if f.type in self._FIXED]
        self.var = [(f.name, f.type) for f in flds if f.type not in self._FIXED]
        for name, kind in self.var:
            if kind not in ("str", "dict", "list"):
                raise TypeError(f"{cls.__name__}.{name}: unsupported wire type {kind}")
        self.struct = struct.Struct("<" + "".join(self._FIXED[f.type] for f in flds if f.type in self._FIXED))

    def pack(self, msg: "Message") -> bytes:
        parts = [self.struct.pack(*[getattr(msg, n) for n in self.fixed])]
        for name, kind in self.var:
            value = getattr(msg, name)
            raw = value.encode() if kind == "str" else _JSON.encode(value).encode()
            parts.append(_LEN.pack(len(raw)))
            parts.append(raw)
        return b"".join(parts)

    def unpack(self, cls: type, data, blen: int) -> "Message":
        if blen < self.struct.size:
            raise WireError(f"{cls.__name__} body of {blen} bytes is shorter than its fixed fields")
        values = dict(zip(self.fixed, self.struct.unpack_from(data, 0)))
        pos = self.struct.size
        for name, kind in self.var:
            (n,) = _LEN.unpack_from(data, pos)
            pos += _LEN.size
            if pos + n > blen:
                raise WireError(f"{cls.__name__}.{name} of {n} bytes overruns the body")
            raw = bytes(data[pos:pos + n])
            pos += n
            value = raw.decode() if kind == "str" else json.loads(raw)
            if kind != "str" and not isinstance(value, dict if kind == "dict" else list):
                raise WireError(f"{cls.__name__}.{name} is not a JSON {kind}")
            values[name] = value
        if pos != blen:
            raise WireError(f"{cls.__name__} body of {blen} bytes does not match its layout ({pos} bytes)")
        return cls(**values)


_LEN = struct.Struct("<I")


def encode(msg: Message) -> bytes:
    """Serialize ``msg`` into one frame."""
    raw = _SCHEMAS[type(msg)].pack(msg)
    if msg.arrays:
        arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in msg.arrays]
        arr_bytes = b"".join(struct.pack("<Q", a.shape[0]) + a.tobytes() for a in arrays)
    else:
        arr_bytes = b""
    return _HEADER.pack(MAGIC, VERSION, int(msg.TYPE), 0, len(raw), len(arr_bytes)) + raw + arr_bytes


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    """``n`` bytes from ``sock`` within its timeout.  The C loop polls only when no data is
    waiting; Python's timeout mode would poll before every read (one system call more per
    read, on the path of every small transfer)."""
    buf = bytearray(n)
    timeout = sock.gettimeout()
    native.recv_exact(sock.fileno(), buf, 1 << 40 if timeout is None else max(1, int(timeout * 1000)))
    return buf


#: Frames a peer may send before it is linked (the first frame of a connection).
PRE_LINK = (MsgType.HELLO, MsgType.ATTACH)
#: Largest body and array section of each message type, checked before anything is
#: allocated: the messages that open a link are small, only the plan halves of a request
#: and a cache's tensor addresses carry arrays.
_PRE_LINK_BODY = 64 << 10
_MAX_ARRAYS = 1 << 30
_LIMITS: dict[int, tuple[int, int]] = {
    int(t): (_PRE_LINK_BODY, 0) for t in (MsgType.HELLO, MsgType.ATTACH, MsgType.UNLINK, MsgType.REPLY,
                                         MsgType.NOTIFY, MsgType.NOTE, MsgType.RESOLVE,
                                         MsgType.RELEASE_KEY)}
_LIMITS.update({int(MsgType.HELLO_ACK): (_MAX_BODY, 0), int(MsgType.RESOLVED): (_MAX_BODY, _MAX_ARRAYS),
                int(MsgType.PUSH): (_MAX_BODY, _MAX_ARRAYS), int(MsgType.PULL): (_MAX_BODY, _MAX_ARRAYS)})
HEADER_SIZE = _HEADER.size


def parse_header(head, allowed: Optional[tuple] = None) -> tuple[type, int, int]:
    """Check a frame header: our magic and version, a known type (one of ``allowed`` if
    given) and sizes within that type's limits.  Returns ``(class, body bytes, array
    bytes)``; raises :class:`WireError` before the caller allocates anything."""
    magic, version, mtype, _, blen, alen = _HEADER.unpack(head)
    if magic != MAGIC:
        raise WireError(f"not a datadist link frame (magic {magic!r})")
    if version != VERSION:
        raise WireError(f"peer speaks link protocol version {version}, this side {VERSION}")
    cls = _TYPES.get(mtype)
    if cls is None or (allowed is not None and mtype not in allowed):
        raise WireError(f"unexpected message type {mtype}")
    max_body, max_arrays = _LIMITS[mtype]
    if blen > max_body or alen > max_arrays or alen % 8:
        raise WireError(f"{cls.__name__} frame of {blen} + {alen} bytes is out of bounds")
    return cls, blen, alen


def decode_frame(cls: type, data, blen: int) -> Message:
    """Decode a frame's body and array section (``data``, sized by :func:`parse_header`).
    Anything malformed, truncated or of the wrong type raises :class:`WireError`, so a
    hostile frame costs its sender the connection and nothing else."""
    try:
        msg = _SCHEMAS[cls].unpack(cls, data, blen)
        arrays: list[Any] = []
        pos, end = blen, len(data)
        while pos < end:
            (count,) = struct.unpack_from("<Q", data, pos)
            pos += 8
            if count > (end - pos) // 8:
                raise WireError(f"{cls.__name__} array of {count} entries overruns its frame")
            arrays.append(np.frombuffer(data, dtype=np.uint64, count=count, offset=pos).copy())
            pos += 8 * count
    except WireError:
        raise
    except (struct.error, UnicodeDecodeError, ValueError, TypeError, RecursionError) as exc:
        raise WireError(f"malformed {cls.__name__} frame: {exc}") from None
    msg.arrays = arrays
    return msg


def read_message(sock: socket.socket, allowed: Optional[tuple] = None) -> Message:
    """Read one frame (blocking within the socket's timeout) and decode it.

    Raises ``ConnectionResetError`` at end of stream, ``socket.timeout`` at the socket's
    deadline and :class:`WireError` for a foreign, oversized or malformed frame, or one
    whose type is not in ``allowed``.
    """
    cls, blen, alen = parse_header(_recv_exact(sock, _HEADER.size), allowed)
    return decode_frame(cls, _recv_exact(sock, blen + alen), blen)


_SCHEMAS: dict[type, _Schema] = {cls: _Schema(cls) for cls in _TYPES.values()}
