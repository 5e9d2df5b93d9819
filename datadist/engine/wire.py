"""The link protocol: typed, versioned control messages, one codec.

A frame is a fixed header ``<4sBBHII`` (magic, version, message type, reserved, body
length, array length), a JSON body holding the message's fields, and an optional array
section (``uint64`` plan halves; never payload).  Payload bytes follow a frame on the same
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
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "VERSION", "MsgType", "Message", "Hello", "HelloAck", "Attach", "Resolve", "Resolved",
    "ReleaseKey", "Push", "Pull", "Reply", "Unlink", "encode", "read_message", "WireError",
]

MAGIC = b"DDKV"
VERSION = 1
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


@dataclass
class Message:
    """Base of all control messages; ``arrays`` travel in the binary section."""

    TYPE: ClassVar[MsgType]
    arrays: list = field(default_factory=list, repr=False)


@dataclass
class Hello(Message):
    """First frame of a link, client -> server, on the client's request connection."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    cluster_id: int = 0
    role: int = 0
    host: str = ""
    pid: int = 0
    ctrl: dict = field(default_factory=dict)       # {"fd", "size", "base"} of the epoch page
    arenas: list = field(default_factory=list)      # [{"fd", "size", "base"}]
    backend: str = "auto"
    remote_cluster_id: int = 0                      # whom the client expects to reach


@dataclass
class HelloAck(Hello):
    TYPE: ClassVar[MsgType] = MsgType.HELLO_ACK
    status: int = 0
    message: str = ""
    path: str = "tcp"                               # what the server will use towards the client


@dataclass
class Attach(Message):
    """Second connection of a link: the one the server initiates requests on."""

    TYPE: ClassVar[MsgType] = MsgType.ATTACH
    cluster_id: int = 0


@dataclass
class Resolve(Message):
    """Find a cache by key: kind is "id" (cache_id, batch_index), "key" (CacheKey fields)
    or "blocks" (BlocksCacheKey fields)."""

    TYPE: ClassVar[MsgType] = MsgType.RESOLVE
    kind: str = "id"
    cluster_id: int = 0
    cache_id: int = 0
    batch_index: int = 0
    req_id: int = 0
    model_id: int = 0
    prefix_id: int = 0


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
    epoch: int = 0


@dataclass
class ReleaseKey(Message):
    TYPE: ClassVar[MsgType] = MsgType.RELEASE_KEY
    cluster_id: int = 0
    req_id: int = 0
    model_id: int = 0
    prefix_id: int = 0


@dataclass
class Push(Message):
    """Bytes for cache ``cache_id`` follow; arrays: the server's half of the plan."""

    TYPE: ClassVar[MsgType] = MsgType.PUSH
    cache_id: int = 0
    epoch: int = 0
    nbytes: int = 0


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
class Unlink(Message):
    TYPE: ClassVar[MsgType] = MsgType.UNLINK
    cluster_id: int = 0


_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, HelloAck, Attach, Resolve, Resolved, ReleaseKey, Push, Pull, Reply, Unlink)
}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls) if f.name != "arrays")
    return names


def encode(msg: Message) -> bytes:
    """Serialize ``msg`` into one frame."""
    body = {name: getattr(msg, name) for name in _field_names(type(msg))}
    raw = _JSON.encode(body).encode()
    arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in msg.arrays]
    arr_bytes = b"".join(struct.pack("<Q", a.shape[0]) + a.tobytes() for a in arrays)
    return _HEADER.pack(MAGIC, VERSION, int(msg.TYPE), 0, len(raw), len(arr_bytes)) + raw + arr_bytes


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError("peer closed the connection")
        got += k
    return buf


def read_message(sock: socket.socket) -> Message:
    """Read one frame (blocking within the socket's timeout) and decode it.

    Raises ``ConnectionResetError`` at end of stream, ``socket.timeout`` at the socket's
    deadline and :class:`WireError` for a foreign or incompatible frame.
    """
    magic, version, mtype, _, blen, alen = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if magic != MAGIC:
        raise WireError(f"not a datadist link frame (magic {magic!r})")
    if version != VERSION:
        raise WireError(f"peer speaks link protocol version {version}, this side {VERSION}")
    if blen > _MAX_BODY or alen > (1 << 34):
        raise WireError(f"frame too large ({blen} + {alen} bytes)")
    cls = _TYPES.get(mtype)
    if cls is None:
        raise WireError(f"unknown message type {mtype}")
    data = _recv_exact(sock, blen + alen)
    body = json.loads(bytes(data[:blen])) if blen else {}
    known = _field_names(cls)
    msg = cls(**{k: v for k, v in body.items() if k in known})
    arrays: list[Any] = []
    pos = blen
    while pos < blen + alen:
        (count,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        arrays.append(np.frombuffer(data, dtype=np.uint64, count=count, offset=pos).copy())
        pos += 8 * count
    msg.arrays = arrays
    return msg
