"""The frame codec (datadist.engine.codec) and the two protocols defined on it: every
message of both round-trips, the link protocol's bytes are those of its version, random,
mutated and truncated frames raise only the WireError family, limits are enforced on the
header before anything is allocated, and key lists carry any text."""
from __future__ import annotations

import dataclasses
import os
import socket
import struct
import time
import tracemalloc
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datadist.engine import codec, wire as dw
from datadist.engine.codec import HEADER_SIZE, U64, EncodeError, FrameFormat, WireError
from ems._errors import EmsError, ProtocolError
from ems.pool import wire as ew

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- samples


def _sample(fmt: FrameFormat[Any], cls: type, seed: int) -> Any:
    """An instance of a message class with a non-default value in every field (arrays only
    where its kind may carry them)."""
    values: Dict[str, Any] = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        hint = str(f.type).replace(" ", "")
        k = seed + i
        if f.name == "arrays":
            values[f.name] = ([np.arange(k % 5 + 1, dtype=np.uint64) * (1 << 40), np.array([], np.uint64)]
                              if fmt.limits(cls)[1] else [])
        elif hint == "bool":
            values[f.name] = True
        elif hint in ("int", "U64"):
            values[f.name] = (1 << 63) + k if hint == "U64" else -k - 1
        elif hint == "str":
            values[f.name] = f"v{k}\x00é日\x1e"
        elif hint == "Optional[str]":
            values[f.name] = None if k % 2 else f"id-{k}"
        elif hint in ("dict", "Dict[str,Any]"):
            values[f.name] = {"k": k, "nested": [1, {"x": None}]}
        elif hint.startswith(("List[Dict", "list")):
            values[f.name] = [{"fd": k, "size": 4096}]
        elif hint == "List[str]":
            values[f.name] = [f"key{j}\x00tp1|pp1" for j in range(k % 4 + 2)]
        elif hint == "List[int]":
            values[f.name] = [-2, -1, 0, 1 << 62, k]
        elif hint == "List[U64]":
            values[f.name] = [0, (1 << 64) - 1, k]
        elif hint == "List[bool]":
            values[f.name] = [True, False, True]
        elif hint == "ErrorKind":
            values[f.name] = ew.ErrorKind.BUSY
        else:
            raise AssertionError(f"{cls.__name__}.{f.name}: no sample for {hint}")
    return cls(**values)


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "arrays":
            assert [v.tolist() for v in x] == [v.tolist() for v in y]
        else:
            assert x == y and type(x) is type(y), (f.name, x, y)


def _frames(fmt: FrameFormat[Any]) -> List[bytes]:
    return [fmt.encode(_sample(fmt, cls, kind)) for kind, cls in sorted(fmt.classes().items())]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt, kinds", [(dw.FORMAT, dw.MsgType), (ew.FORMAT, ew.Op)], ids=["link", "ems"])
def test_every_message_round_trips(fmt: FrameFormat[Any], kinds: type) -> None:
    assert sorted(fmt.classes()) == sorted(int(k) for k in kinds)  # every kind has its message
    for kind, cls in fmt.classes().items():
        for seed in (0, 1):
            msg = _sample(fmt, cls, seed)
            frame = fmt.encode(msg)
            _same(fmt.decode(frame), msg)
            head, blen, alen = fmt.parse_header(frame[:HEADER_SIZE])
            assert head is cls and len(frame) == HEADER_SIZE + blen + alen
            _same(fmt.decode_frame(cls, bytearray(frame[HEADER_SIZE:]), blen), msg)
            _same(fmt.decode(fmt.encode(cls())), cls())  # and every default


def test_module_functions_keep_their_contracts() -> None:
    push = dw.Push(cache_id=4, epoch=9, nbytes=64, via=1, arrays=[np.arange(3, dtype=np.uint64)] * 3)
    frame = dw.encode(push)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        b.settimeout(5)
        _same(dw.read_message(b, (dw.MsgType.PUSH,)), push)
        a.sendall(frame)
        with pytest.raises(dw.WireError):
            dw.read_message(b, dw.PRE_LINK)  # a request before a link
    cls, blen, _ = dw.parse_header(frame[:dw.HEADER_SIZE])
    _same(dw.decode_frame(cls, frame[dw.HEADER_SIZE:], blen), push)
    msg = ew.Commit(["a", "b"], [1, 2], [3, (1 << 64) - 1], False)
    assert ew.decode(ew.encode(msg)) == msg
    assert issubclass(ProtocolError, WireError) and issubclass(ProtocolError, EmsError)
    assert dw.WireError is WireError


def test_link_frames_keep_their_byte_format() -> None:
    """The link protocol's byte format (VERSION 6: 4 added ``summed`` to PUSH and PULL, 5
    added SUM and SUMMED, 6 FENCE): header, fixed fields, length-prefixed text and JSON,
    then each array as a count and its words."""
    push = dw.Push(cache_id=-3, epoch=7, nbytes=1 << 63, via=1, summed=True, arrays=[np.array([5, 6], np.uint64)])
    body = struct.pack("<qQQq?", -3, 7, 1 << 63, 1, True)
    arrays = struct.pack("<QQQ", 2, 5, 6)
    assert dw.encode(push) == struct.pack("<4sBBHII", b"DDKV", 6, 7, 0, len(body), len(arrays)) + body + arrays
    reply = dw.Reply(status=5, message="né")
    body = struct.pack("<qI", 5, 3) + "né".encode()
    assert dw.encode(reply) == struct.pack("<4sBBHII", b"DDKV", 6, 9, 0, len(body), 0) + body
    summed = dw.Summed(status=0, checksum=(1 << 64) - 1, message="")
    body = struct.pack("<qQI", 0, (1 << 64) - 1, 0)
    assert dw.encode(summed) == struct.pack("<4sBBHII", b"DDKV", 6, 14, 0, len(body), 0) + body
    ask = dw.Sum(cache_id=2, epoch=9, nbytes=16, arrays=[np.array([5], np.uint64)])
    body = struct.pack("<qQQq?", 2, 9, 16, 0, False)
    assert dw.encode(ask) == struct.pack("<4sBBHII", b"DDKV", 6, 13, 0, len(body), 16) + body + struct.pack("<QQ", 1, 5)
    assert dw.decode_frame(dw.Sum, dw.encode(ask)[16:], len(body)) == ask
    hello = dw.Hello(ctrl={"fd": 3}, arenas=[{"a": "é"}])
    raw = dw.encode(hello)
    assert b'\x08\x00\x00\x00{"fd":3}' in raw and b'[{"a":"\\u00e9"}]' in raw
    assert dw.encode(dw.Fence()) == struct.pack("<4sBBHII", b"DDKV", 6, 15, 0, 0, 0)
    assert dw.VERSION == 6 and ew.PROTOCOL_VERSION == 7


# ----------------------------------------------------------------------------- key lists and text


KEY_CASES = [
    [], [""], ["", ""], ["a"], ["x\x1ey"], ["x\x1ey", "z\x1f"], ["\x1e\x1f\x1d\x1c\n", "é\x00日"],
    ["\x00", "\x00\x00", ""], ["a\x1eb\x1fc\x1dd\x1ce\nf", "g"], ["🎉", "\U0010ffff", "\ud7ff"],
    [chr(c) for c in range(0x20, 0x80)] + ["\x1e\x1f\x1d\x1c\n"],  # the fallback separator is taken
    [f"t|m|e|kv|h{i:x}\x00tp1.0|pp1.0" for i in range(10000)],
]


@pytest.mark.parametrize("keys", KEY_CASES, ids=range(len(KEY_CASES)))
def test_key_lists_carry_any_text(keys: List[str]) -> None:
    for msg in (ew.Exists(keys, True), ew.Drop(keys, list(range(len(keys))))):
        got = ew.decode(ew.encode(msg))
        assert got == msg and all(type(k) is str for k in got.keys)


@given(st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=8), max_size=20))
@FUZZ
def test_key_lists_fuzz(keys: List[str]) -> None:
    assert ew.decode(ew.encode(ew.Get(keys, False))).keys == keys


def test_optional_text_keeps_none_apart_from_empty() -> None:
    for access in (None, "", "id\x00é", "x" * 1000):
        got = ew.decode(ew.encode(ew.Hello(access_id=access, access_key=access, pid=1)))
        assert got.access_id == access and got.access_key == access


def test_a_key_list_that_lies_is_refused() -> None:
    frame = bytearray(ew.encode(ew.Exists(["a", "b", "c"])))
    at = HEADER_SIZE + 1  # after local_only: count, separator, text bytes
    for offset, value in ((0, 2), (0, 4), (0, 0), (4, ord("x")), (4, 0x110000), (8, 4), (8, 6)):
        bad = bytearray(frame)
        struct.pack_into("<I", bad, at + offset, value)
        with pytest.raises(ProtocolError):
            ew.decode(bytes(bad))


# ----------------------------------------------------------------------------- hostile input


def _decode_only_wire_errors(fmt: FrameFormat[Any], data: bytes) -> None:
    try:
        msg = fmt.decode(data)
    except WireError as exc:
        assert isinstance(exc, fmt.error)
        return
    assert type(msg) in fmt.classes().values()


FORMATS = {"link": dw.FORMAT, "ems": ew.FORMAT}
GOOD = {name: _frames(fmt) for name, fmt in FORMATS.items()}


@given(st.sampled_from(sorted(FORMATS)), st.binary(max_size=300))
@FUZZ
def test_random_bytes_raise_only_wire_errors(name: str, data: bytes) -> None:
    _decode_only_wire_errors(FORMATS[name], data)


@given(st.sampled_from(sorted(FORMATS)), st.data())
@FUZZ
def test_random_bodies_behind_a_valid_header_raise_only_wire_errors(name: str, data: st.DataObject) -> None:
    fmt = FORMATS[name]
    kind = data.draw(st.sampled_from(sorted(fmt.classes())))
    body = data.draw(st.binary(max_size=200))
    alen = data.draw(st.sampled_from([0, 8, 16, 24])) if fmt.arrays else 0
    arrays = data.draw(st.binary(min_size=alen, max_size=alen))
    frame = struct.pack("<4sBBHII", fmt.magic, fmt.version, kind, 0, len(body), alen) + body + arrays
    _decode_only_wire_errors(fmt, frame)


@given(st.sampled_from(sorted(FORMATS)), st.data())
@FUZZ
def test_mutated_and_truncated_frames_raise_only_wire_errors(name: str, data: st.DataObject) -> None:
    fmt = FORMATS[name]
    frame = bytearray(data.draw(st.sampled_from(GOOD[name])))
    for _ in range(data.draw(st.integers(1, 6))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    _decode_only_wire_errors(fmt, bytes(frame))
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(WireError):
        fmt.decode(bytes(frame[:cut]))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_truncation_of_every_frame_is_refused(name: str) -> None:
    fmt = FORMATS[name]
    for frame in GOOD[name]:
        for cut in range(len(frame)):
            with pytest.raises(fmt.error):
                fmt.decode(frame[:cut])
        with pytest.raises(fmt.error):
            fmt.decode(frame + b"\0" * 8)


def test_mistyped_fields_are_refused() -> None:
    bad_enum = bytearray(ew.encode(ew.Error(ew.ErrorKind.AUTH, "no")))
    struct.pack_into("<q", bad_enum, HEADER_SIZE, 77)
    nested = b"[" * 100000
    not_a_dict = b"[1]"
    stats = [struct.pack("<4sBBHII", ew.MAGIC, ew.PROTOCOL_VERSION, ew.Op.STATS_REPLY, 0, 4 + len(j), 0)
             + struct.pack("<I", len(j)) + j for j in (nested, not_a_dict, b"{\xff}", b"{'a':1}")]
    for frame in [bytes(bad_enum), *stats]:
        with pytest.raises(ProtocolError):
            ew.decode(frame)
    hello = dw.encode(dw.Hello(ctrl={"fd": 3}))
    for frame in (hello.replace(b'{"fd":3}', b'["fd",3]'), hello.replace(b'{"fd":3}', b'{"fd":\xff}')):
        with pytest.raises(dw.WireError):
            dw.FORMAT.decode(frame)
    reserved = bytearray(dw.encode(dw.Unlink(cluster_id=1)))
    reserved[6] = 1
    with pytest.raises(dw.WireError):
        dw.FORMAT.decode(bytes(reserved))
    many = dw.Push(arrays=[np.zeros(0, np.uint64)] * 4)
    frame = bytearray(dw.encode(many))
    frame += struct.pack("<Q", 0)  # a fifth array, past the link's bound
    struct.pack_into("<I", frame, 12, struct.unpack_from("<I", frame, 12)[0] + 8)
    with pytest.raises(dw.WireError):
        dw.FORMAT.decode(bytes(frame))


# ----------------------------------------------------------------------------- limits


def test_limits_are_checked_on_the_header_before_anything_is_allocated() -> None:
    huge = [struct.pack("<4sBBHII", b"DDKV", dw.VERSION, dw.MsgType.HELLO, 0, 0xFFFFFFF0, 0),
            struct.pack("<4sBBHII", b"DDKV", dw.VERSION, dw.MsgType.PUSH, 0, 8, 0xFFFFFFF8),
            struct.pack("<4sBBHII", b"DDKV", dw.VERSION, dw.MsgType.PUSH, 0, 8, 12)]  # not whole words
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        for head in huge:
            tracemalloc.start()
            t0 = time.monotonic()
            a.sendall(head)  # the header only: reading a body would wait out the timeout
            with pytest.raises(dw.WireError):
                dw.read_message(b)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert time.monotonic() - t0 < 2 and peak < 1 << 20
    pre = struct.pack("<4sBBHII", ew.MAGIC, ew.PROTOCOL_VERSION, ew.Op.HELLO, 0, ew.SMALL_FRAME + 1, 0)
    big = struct.pack("<4sBBHII", ew.MAGIC, ew.PROTOCOL_VERSION, ew.Op.EXISTS, 0, 1 << 20, 0)
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        for head, max_frame in ((pre, ew.MAX_FRAME), (big, 64 << 10), (big[:8] + b"\0" * 8, ew.MAX_FRAME)):
            tracemalloc.start()
            a.sendall(head)
            with pytest.raises(ProtocolError):
                ew.recv_msg(b, time.monotonic() + 5, max_frame=max_frame)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < 1 << 20


def test_descriptors_of_a_refused_frame_are_closed() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    r, w = os.pipe()
    try:
        with a, b:
            before = len(os.listdir("/proc/self/fd"))
            socket.send_fds(a, [b"XXXX" + b"\0" * 12], [r])
            with pytest.raises(ProtocolError):
                ew.recv_msg(b, time.monotonic() + 5, want_fds=2)
            assert len(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(r)
        os.close(w)


def test_the_sender_refuses_what_the_format_cannot_carry() -> None:
    cases = [
        ew.Exists([1, 2]),                       # not str keys
        ew.Exists(["ok", "\ud800"]),             # not encodable as UTF-8
        ew.Exists(["\ud800"]),
        ew.Commit(["a"], [1], [-1]),             # a U64 below 0
        ew.Reserve(["a"], [1 << 63]),            # an int64 overflow
        ew.Error("busy", "a string where an ErrorKind belongs"),
        ew.Error(77, "no such kind"),
        ew.Hello(access_id=5),                   # not Optional[str]
        ew.StatsReply(stats=[1]),                # not a dict
        ew.Write(offset=1.5),
        ew.Hello(nonce="x" * (ew.SMALL_FRAME + 1)),  # over its kind's limit
        dw.Push(arrays=[np.array(["x"])]),      # not numbers
        dw.Push(arrays=[np.zeros(1, np.uint64)] * 5),
        dw.Hello(cluster_id=-1),
    ]
    for msg in cases:
        fmt = dw.FORMAT if isinstance(msg, dw.Message) else ew.FORMAT
        with pytest.raises(EncodeError):
            fmt.encode(msg)
    assert issubclass(EncodeError, ValueError)


# ----------------------------------------------------------------------------- a protocol of its own


class Kind(IntEnum):
    ALL = 1
    OTHER = 2
    SPARE = 3


class Color(IntEnum):
    RED = 1
    BLUE = 7


@dataclass
class Everything:
    n: int = 0
    u: U64 = 0
    flag: bool = False
    color: Color = Color.RED
    text: str = ""
    maybe: Optional[str] = None
    table: Dict[str, Any] = field(default_factory=dict)
    rows: List[Any] = field(default_factory=list)
    keys: List[str] = field(default_factory=list)
    ints: List[int] = field(default_factory=list)
    words: List[U64] = field(default_factory=list)
    flags: List[bool] = field(default_factory=list)
    tail: int = 0
    arrays: List[Any] = field(default_factory=list)


@dataclass
class Other:
    pass


def test_a_protocol_of_its_own() -> None:
    fmt: FrameFormat[Any] = FrameFormat("test", b"TEST", 9, Kind, arrays="arrays", max_items=100)
    fmt.register(Everything, Kind.ALL, 1 << 20, 1 << 20)
    fmt.register(Other, Kind.OTHER, 0)
    fmt.compile()
    msg = Everything(-5, (1 << 64) - 1, True, Color.BLUE, "t\x00", "", {"a": [1]}, [None], ["a", "b\x1e"],
                     [-1, 2], [(1 << 64) - 1], [True, False], 42, [np.arange(3, dtype=np.uint64)])
    got = fmt.decode(fmt.encode(msg))
    _same(got, msg)
    assert got.color is Color.BLUE and fmt.decode(fmt.encode(Other())) == Other()
    with pytest.raises(WireError):  # more list entries than the format allows
        fmt.decode(fmt.encode(Everything(ints=list(range(101)))))
    with pytest.raises(WireError):
        fmt.decode(fmt.encode(Other())[:HEADER_SIZE] + b"\0")
    with pytest.raises(TypeError):
        fmt.register(Other, Kind.SPARE, 0)      # a class twice
    with pytest.raises(TypeError):
        fmt.register(Everything, Kind.ALL, 0)   # a kind twice
    with pytest.raises(TypeError):
        fmt.register(Other, Color.RED, 0)       # a kind of another enum

    @dataclass
    class Unsupported:
        when: float = 0.0

    fmt.register(Unsupported, Kind.SPARE, 10)
    with pytest.raises(TypeError):
        fmt.compile()
    with pytest.raises(ValueError):
        FrameFormat("bad", b"TOOLONG", 1, Kind)
    assert codec.join_keys(["a", "b"]) == (0x1E, b"a\x1eb")


@pytest.mark.parametrize("cls", [ew.Exists, ew.Get, ew.Reserve, ew.Commit, ew.Drop])
def test_a_pool_frame_lists_at_most_max_keys(cls) -> None:
    """A list of wire.MAX_KEYS keys round-trips; one key more is refused while decoding,
    before the text is split into strings."""
    keys = [str(i % 10) for i in range(ew.MAX_KEYS)]
    assert ew.decode(ew.encode(cls(keys=keys))).keys == keys
    with pytest.raises(ProtocolError, match="keys"):
        ew.decode(ew.encode(cls(keys=keys + ["x"])))
