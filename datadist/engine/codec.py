"""One frame codec for every control protocol of the project, parameterised per protocol.

Both the datadist link protocol (:mod:`datadist.engine.wire`) and the ems pool protocol
(:mod:`ems.pool.wire`) are a :class:`FrameFormat`: a magic, a version, a typed registry of
message classes (an ``IntEnum`` of message kinds) and, per kind, the largest body and array
section a receiver accepts.

Frame layout (all integers little-endian)::

    header   <4sBBHII   magic, version, kind, reserved (0), body bytes, array-section bytes
    body                the message's fields, laid out from its dataclass annotations
    arrays              per array: <Q count, then count x <Q (only formats that name an
                        arrays attribute; never payload).  Sent arrays are cast to uint64
                        as numpy casts; received ones are views of one aligned copy of
                        the section, at most ``max_array_count`` of them

Body layout, derived once per class from its dataclass fields in declaration order
(annotations are the strings ``from __future__ import annotations`` leaves; an IntEnum is
looked up by name in the message's module)::

    fixed fields first, packed by one struct:  int <q, U64 <Q, bool ?, an IntEnum <q
    then each variable field, in order:
      str             <I n, n bytes UTF-8
      Optional[str]   <I n (0xFFFFFFFF: None), n bytes UTF-8
      dict / Dict[..] <I n, n bytes JSON (top-level type checked); list / List[Any] likewise
      List[str]       key list: <III count, separator code point, n; the keys joined by the
                      separator, n bytes UTF-8 (the sender picks a separator no key holds)
      List[int]       <I count, count x <q;  List[U64]: count x <Q;  List[bool]: count x ?

Contracts:

* :meth:`FrameFormat.parse_header` checks magic, version, reserved, kind (and an optional
  allow-list) and the kind's limits (and an optional ``max_frame``) on the 16 header bytes
  alone, so a receiver refuses an oversized frame before it allocates anything.
* Decoding never raises anything but the format's error class (a :class:`WireError`
  subclass) for malformed, truncated, oversized or mistyped input: no ``struct.error``,
  ``UnicodeDecodeError``, ``KeyError``, ``RecursionError`` or ``TypeError`` escapes.
* :meth:`FrameFormat.encode` raises :class:`EncodeError` (a ``ValueError``) for a message
  the format cannot carry (a value of the wrong type or range, text that is not UTF-8, a
  frame over its kind's limits); nothing is then sent.  Payload bytes never go through the
  codec: only control fields and ``uint64`` arrays, which are joined without a ``tobytes``
  copy.
"""
from __future__ import annotations

import dataclasses
import json
import struct
import sys
from enum import IntEnum
from operator import attrgetter, itemgetter
from typing import Any, Callable, Collection, Dict, Generic, List, Optional, Tuple, Type, TypeVar, Union

import numpy as np

__all__ = [
    "WireError", "EncodeError", "FrameFormat", "HEADER", "HEADER_SIZE", "U64", "KeyList", "Buffer",
]

#: Annotation of fields that hold unsigned 64-bit values (keys, cluster ids, checksums).
U64 = int
#: Annotation of a key list (the same as ``List[str]``).
KeyList = List[str]
#: What the decoders read.
Buffer = Union[bytes, bytearray, memoryview]

#: magic, version, kind, reserved, body bytes, array-section bytes.
HEADER = struct.Struct("<4sBBHII")
HEADER_SIZE = HEADER.size

M = TypeVar("M")
_Parts = List[Any]  # bytes-like pieces of a frame, joined once
_Enc = Callable[[Any, _Parts], None]
_Dec = Callable[[Buffer, int, int], Tuple[Any, int]]

_LEN = struct.Struct("<I")
_KEYS = struct.Struct("<III")
_Q = struct.Struct("<Q")
_NONE = 0xFFFFFFFF
_U64 = np.dtype("<u8")
_JSON = json.JSONEncoder(separators=(",", ":"))
#: Key-list separators tried in order (ASCII: they cannot occur inside a multi-byte UTF-8
#: sequence, so counting them in the encoded text is exact).
_SEPARATORS = "\x1e\x1f\x1d\x1c\n"
#: From this many bytes on, a separator is counted by numpy (10x str.count).
_NUMPY_COUNT = 2048
#: What a malformed frame may make the decoders raise; all become the format's error.
_DECODE_ERRORS = (struct.error, ValueError, TypeError, RecursionError, OverflowError, IndexError, KeyError)
_ENCODE_ERRORS = (struct.error, ValueError, TypeError, OverflowError, AttributeError)


class WireError(Exception):
    """The stream does not carry a valid frame of the expected protocol and version."""


class EncodeError(ValueError):
    """A message the format cannot carry (wrong type or range, over its kind's limits)."""


# ----------------------------------------------------------------------------- field codecs


def _need(pos: int, size: int, end: int, name: str) -> None:
    if size > end - pos:
        raise ValueError(f"{name} overruns the body")


def _text(data: Buffer, pos: int, n: int) -> str:
    return str(memoryview(data)[pos:pos + n], "utf-8")


def _put_sized(raw: bytes, parts: _Parts) -> None:
    """A length-prefixed byte string."""
    parts.append(_LEN.pack(len(raw)))
    parts.append(raw)


def _sized_at(data: Buffer, pos: int, end: int, name: str) -> Tuple[int, int]:
    """Where a length-prefixed field's bytes start, and the length it announces (not yet
    checked against ``end``: the caller may read a marker first)."""
    _need(pos, 4, end, name)
    (n,) = _LEN.unpack_from(data, pos)
    return pos + 4, n


def _str_codec(name: str, optional: bool) -> Tuple[_Enc, _Dec]:
    def enc(value: Any, parts: _Parts) -> None:
        if value is None and optional:
            parts.append(_LEN.pack(_NONE))
            return
        _put_sized(str.encode(value), parts)

    def dec(data: Buffer, pos: int, end: int) -> Tuple[Any, int]:
        pos, n = _sized_at(data, pos, end, name)
        if n == _NONE and optional:
            return None, pos
        _need(pos, n, end, name)
        return _text(data, pos, n), pos + n
    return enc, dec


def _json_codec(name: str, kind: type) -> Tuple[_Enc, _Dec]:
    def enc(value: Any, parts: _Parts) -> None:
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, not {type(value).__name__}")
        _put_sized(_JSON.encode(value).encode(), parts)

    def dec(data: Buffer, pos: int, end: int) -> Tuple[Any, int]:
        pos, n = _sized_at(data, pos, end, name)
        _need(pos, n, end, name)
        value = json.loads(_text(data, pos, n))
        if not isinstance(value, kind):
            raise ValueError(f"{name} is not a JSON {kind.__name__}")
        return value, pos + n
    return enc, dec


def _count(raw: bytes, byte: int) -> int:
    if len(raw) < _NUMPY_COUNT:
        return raw.count(byte)
    return int(np.count_nonzero(np.frombuffer(raw, np.uint8) == byte))


def join_keys(keys: List[str]) -> Tuple[int, bytes]:
    """A separator (code point) that no key holds, and the keys joined by it, UTF-8.  Raises
    ``TypeError`` for a non-str key and ``UnicodeEncodeError`` for text UTF-8 cannot hold."""
    if len(keys) <= 1:
        return ord(_SEPARATORS[0]), str.encode(keys[0]) if keys else b""
    for sep in _SEPARATORS:
        raw = sep.join(keys).encode()
        if _count(raw, ord(sep)) == len(keys) - 1:
            return ord(sep), raw
    used = set("".join(keys))  # keys holding every usual separator: any code point none holds
    free = next((c for c in range(0x20, 0x110000) if chr(c) not in used and not 0xD800 <= c < 0xE000), None)
    if free is None:
        raise ValueError("the keys hold every code point: no separator is left")
    return free, chr(free).join(keys).encode()


def _keys_codec(name: str, max_items: int) -> Tuple[_Enc, _Dec]:
    def enc(value: Any, parts: _Parts) -> None:
        keys = value if isinstance(value, list) else list(value)
        sep, raw = join_keys(keys)
        parts.append(_KEYS.pack(len(keys), sep, len(raw)))
        parts.append(raw)

    def dec(data: Buffer, pos: int, end: int) -> Tuple[Any, int]:
        _need(pos, _KEYS.size, end, name)
        count, sep, n = _KEYS.unpack_from(data, pos)
        pos += _KEYS.size
        _need(pos, n, end, name)
        if count > max_items or (count == 0 and n):
            raise ValueError(f"{name}: {count} keys in {n} bytes")
        if count <= 1:
            return ([_text(data, pos, n)] if count else []), pos + n
        char = chr(sep)
        keys = _text(data, pos, n).split(char, count - 1)  # never more than count pieces
        if len(keys) != count or char in keys[-1]:
            raise ValueError(f"{name}: the text does not hold the {count} keys announced")
        return keys, pos + n
    return enc, dec


def _number_list_codec(name: str, code: str, size: int, max_items: int) -> Tuple[_Enc, _Dec]:
    def enc(value: Any, parts: _Parts) -> None:
        parts.append(_LEN.pack(len(value)))
        parts.append(struct.pack(f"<{len(value)}{code}", *value))

    def dec(data: Buffer, pos: int, end: int) -> Tuple[Any, int]:
        _need(pos, 4, end, name)
        (n,) = _LEN.unpack_from(data, pos)
        pos += 4
        if n > max_items:
            raise ValueError(f"{name}: {n} entries exceed {max_items}")
        _need(pos, n * size, end, name)
        return list(struct.unpack_from(f"<{n}{code}", data, pos)), pos + n * size
    return enc, dec


# ----------------------------------------------------------------------------- schemas

_FIXED = {"int": "q", "U64": "Q", "bool": "?"}
_LISTS = {"List[int]": ("q", 8), "list[int]": ("q", 8), "List[U64]": ("Q", 8), "list[U64]": ("Q", 8),
          "List[bool]": ("?", 1), "list[bool]": ("?", 1)}
_KEY_LISTS = ("List[str]", "list[str]", "KeyList")
_OPTIONAL_STR = ("Optional[str]", "str|None", "None|str", "Union[str,None]")


def _annotation(cls: type, hint: Any) -> Union[str, Type[IntEnum]]:
    """A field's annotation as normalised text, or the IntEnum it names."""
    if isinstance(hint, type):
        if issubclass(hint, IntEnum):
            return hint
        hint = hint.__name__
    text = str(hint).replace(" ", "").replace("typing.", "")
    found = getattr(sys.modules.get(cls.__module__), text, None)
    if isinstance(found, type) and issubclass(found, IntEnum):
        return found
    return text


def _var_codec(cls: type, name: str, text: str, max_items: int) -> Tuple[_Enc, _Dec]:
    where = f"{cls.__name__}.{name}"
    if text == "str" or text in _OPTIONAL_STR:
        return _str_codec(where, text != "str")
    if text in _KEY_LISTS:
        return _keys_codec(where, max_items)
    if text in _LISTS:
        code, size = _LISTS[text]
        return _number_list_codec(where, code, size, max_items)
    if text == "dict" or text.startswith(("Dict[", "dict[")):
        return _json_codec(where, dict)
    if text == "list" or text.startswith(("List[", "list[")):
        return _json_codec(where, list)
    raise TypeError(f"{where}: unsupported wire type {text}")


def _getter(names: List[str]) -> Callable[[Any], Tuple[Any, ...]]:
    """A function returning the tuple of ``names``' attributes of its argument (one C call)."""
    if len(names) > 1:
        return attrgetter(*names)
    if names:
        name = names[0]
        return lambda msg: (getattr(msg, name),)
    return lambda msg: ()


class _Schema:
    """How one message class is laid out in a body (see the module docstring)."""

    def __init__(self, cls: type, arrays: Optional[str], max_items: int) -> None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        self.cls = cls
        flds = dataclasses.fields(cls)
        if not all(f.init for f in flds):
            raise TypeError(f"{cls.__name__}: every field of a wire message must be an __init__ field")
        self.has_arrays = any(f.name == arrays for f in flds)
        fixed: List[Tuple[str, str]] = []
        enums: List[Tuple[int, Type[IntEnum]]] = []
        self.encs: List[Tuple[str, _Enc]] = []
        self.decs: List[_Dec] = []
        for f in flds:
            if f.name != arrays:
                self._add(f, fixed, enums, max_items)
        self.struct = struct.Struct("<" + "".join(code for _, code in fixed))
        self.enums = tuple(enums)
        names = [n for n, _ in fixed]
        self.get_fixed = _getter(names)
        # unpack() builds fixed values, then variable ones, then the arrays: reorder to the
        # declaration order __init__ takes (None: already in it)
        decoded = names + [n for n, _ in self.encs] + [f.name for f in flds if f.name == arrays]
        order = [decoded.index(f.name) for f in flds]
        self.order: Optional[Callable[[Any], Tuple[Any, ...]]] = (
            itemgetter(*order) if order != list(range(len(order))) else None)

    def _add(self, f: "dataclasses.Field[Any]", fixed: List[Tuple[str, str]],
             enums: List[Tuple[int, Type[IntEnum]]], max_items: int) -> None:
        """Place field ``f``: in the fixed struct (a number, flag or enum) or after it."""
        kind = _annotation(self.cls, f.type)
        if not isinstance(kind, str):
            enums.append((len(fixed), kind))
            fixed.append((f.name, "q"))
        elif kind in _FIXED:
            fixed.append((f.name, _FIXED[kind]))
        else:
            enc, dec = _var_codec(self.cls, f.name, kind, max_items)
            self.encs.append((f.name, enc))
            self.decs.append(dec)

    def pack(self, msg: Any, parts: _Parts) -> None:
        """Append the body's pieces for ``msg`` to ``parts``."""
        values = self.get_fixed(msg)
        for i, enum in self.enums:
            enum(values[i])  # a value outside the enum fails here, not at the receiver
        parts.append(self.struct.pack(*values))
        for name, enc in self.encs:
            enc(getattr(msg, name), parts)

    def unpack(self, data: Buffer, blen: int, arrays: List[Any]) -> Any:
        """The message in ``data[:blen]`` (with ``arrays`` from the array section)."""
        fixed = self.struct
        if blen < fixed.size:
            raise ValueError(f"body of {blen} bytes is shorter than its fixed fields")
        values = fixed.unpack_from(data, 0)
        if self.enums:
            listed = list(values)
            for i, enum in self.enums:
                listed[i] = enum(listed[i])
            values = tuple(listed)
        pos = fixed.size
        if self.decs:
            extra = []
            for dec in self.decs:
                value, pos = dec(data, pos, blen)
                extra.append(value)
            values += tuple(extra)
        if pos != blen:
            raise ValueError(f"body of {blen} bytes does not match its layout ({pos} bytes)")
        if self.has_arrays:
            values += (arrays,)
        return self.cls(*(self.order(values) if self.order is not None else values))


@dataclasses.dataclass
class _Entry:
    cls: type
    kind: int
    max_body: int
    max_arrays: int
    schema: Optional[_Schema] = None


# ----------------------------------------------------------------------------- the format


class FrameFormat(Generic[M]):
    """One protocol: magic, version, message kinds and their classes and limits.

    ``kinds`` is the protocol's ``IntEnum`` of message kinds; ``error`` the exception class
    every decoding failure raises (a :class:`WireError` subclass); ``arrays`` the name of
    the attribute holding a message's ``uint64`` arrays (None: the protocol has no array
    section); ``max_items`` bounds each list field's entries (and ``max_array_count`` the
    arrays of one frame), so a small frame cannot make the decoder build a huge list.
    """

    def __init__(self, name: str, magic: bytes, version: int, kinds: Type[IntEnum], *,
                 error: Type[WireError] = WireError, arrays: Optional[str] = None,
                 max_items: int = 1 << 22, max_array_count: int = 16) -> None:
        if len(magic) != 4 or not 0 <= version <= 0xFF or not issubclass(error, WireError):
            raise ValueError("a frame format needs a 4-byte magic, a version < 256 and a WireError class")
        self.name, self.magic, self.version, self.kinds = name, magic, version, kinds
        self.error = error
        self.arrays = arrays
        self.max_items = max_items
        self.max_array_count = max_array_count
        self._by_kind: Dict[int, _Entry] = {}
        self._by_cls: Dict[type, _Entry] = {}

    # -- registry ----------------------------------------------------------------------
    def register(self, cls: Type[M], kind: IntEnum, max_body: int, max_arrays: int = 0) -> None:
        """Make ``cls`` the message of ``kind``, accepted with at most ``max_body`` body bytes
        and ``max_arrays`` array-section bytes.  ``TypeError`` for a kind or class
        registered twice or a kind of another enum.  The layout is derived when first
        needed (``cls`` may not be a dataclass yet) or by :meth:`compile`."""
        if not isinstance(kind, self.kinds):
            raise TypeError(f"{cls.__name__}: kind {kind!r} is not a {self.kinds.__name__}")
        if int(kind) in self._by_kind or cls in self._by_cls:
            raise TypeError(f"duplicate {self.name} message kind {int(kind)} for {cls.__name__}")
        if not (0 <= max_body <= 0xFFFFFFFF and 0 <= max_arrays <= 0xFFFFFFFF) or (max_arrays and not self.arrays):
            raise ValueError(f"{cls.__name__}: limits out of range")
        entry = _Entry(cls, int(kind), max_body, max_arrays)
        self._by_kind[entry.kind] = entry
        self._by_cls[cls] = entry

    def compile(self) -> None:
        """Derive every registered class's layout now (an unsupported field type raises
        ``TypeError`` at import, not at the first message)."""
        for entry in self._by_kind.values():
            self._schema(entry)

    def _schema(self, entry: _Entry) -> _Schema:
        if entry.schema is None:
            entry.schema = _Schema(entry.cls, self.arrays, self.max_items)
        return entry.schema

    def kind_of(self, cls: type) -> int:
        """The kind ``cls`` is registered under (``KeyError`` if none)."""
        return self._by_cls[cls].kind

    def limits(self, cls: type) -> Tuple[int, int]:
        """``(largest body, largest array section)`` of ``cls``'s frames (``KeyError`` if
        ``cls`` is not registered)."""
        entry = self._by_cls[cls]
        return entry.max_body, entry.max_arrays

    def classes(self) -> Dict[int, type]:
        """Kind -> message class, every registered message."""
        return {k: e.cls for k, e in self._by_kind.items()}

    # -- encoding ----------------------------------------------------------------------
    def encode(self, msg: M) -> bytes:
        """One frame for ``msg``; :class:`EncodeError` if the format cannot carry it."""
        entry = self._by_cls.get(type(msg))
        if entry is None:
            raise EncodeError(f"{type(msg).__name__} is not a {self.name} message")
        schema = entry.schema or self._schema(entry)
        parts: _Parts = [b""]
        try:
            schema.pack(msg, parts)
            blen = sum(map(len, parts))
            alen = self._pack_arrays(msg, parts) if schema.has_arrays else 0
        except _ENCODE_ERRORS as exc:
            raise EncodeError(f"{type(msg).__name__} cannot be encoded: {exc}") from None
        if blen > entry.max_body or alen > entry.max_arrays:
            raise EncodeError(f"{type(msg).__name__} frame of {blen} + {alen} bytes exceeds its limits "
                              f"({entry.max_body} + {entry.max_arrays})")
        parts[0] = HEADER.pack(self.magic, self.version, entry.kind, 0, blen, alen)
        return b"".join(parts)

    def _pack_arrays(self, msg: Any, parts: _Parts) -> int:
        arrays = getattr(msg, self.arrays or "")
        if len(arrays) > self.max_array_count:
            raise ValueError(f"{len(arrays)} arrays exceed {self.max_array_count}")
        alen = 0
        for a in arrays:
            arr = np.ascontiguousarray(a, dtype=_U64).reshape(-1)
            parts.append(_Q.pack(arr.shape[0]))
            parts.append(arr)  # a buffer, joined once with the frame: no tobytes copy
            alen += 8 + arr.nbytes
        return alen

    # -- decoding ----------------------------------------------------------------------
    def parse_header(self, head: Buffer, allowed: Optional[Collection[int]] = None,
                     max_frame: Optional[int] = None) -> Tuple[Type[M], int, int]:
        """Check a frame header: our magic, version and a zero reserved field, a known kind
        (one of ``allowed`` if given) and sizes within that kind's limits (and within
        ``max_frame`` bytes in all, if given).  Returns ``(class, body bytes, array bytes)``;
        raises the format's error before the caller allocates anything."""
        if len(head) < HEADER_SIZE:
            raise self.error(f"{self.name} header of {len(head)} bytes")
        magic, version, kind, reserved, blen, alen = HEADER.unpack_from(head)
        if magic != self.magic:
            raise self.error(f"not a {self.name} frame (magic {magic!r})")
        if version != self.version:
            raise self.error(f"peer speaks {self.name} protocol version {version}, this side {self.version}")
        entry = self._by_kind.get(kind)
        if entry is None or reserved or (allowed is not None and kind not in allowed):
            raise self.error(f"unexpected {self.name} message type {kind}")
        if blen > entry.max_body or alen > entry.max_arrays or alen % 8 or (
                max_frame is not None and blen + alen > max_frame):
            raise self.error(f"{entry.cls.__name__} frame of {blen} + {alen} bytes is out of bounds")
        cls: Type[M] = entry.cls
        return cls, blen, alen

    def decode_frame(self, cls: Type[M], data: Buffer, blen: int) -> M:
        """The message of class ``cls`` (from :meth:`parse_header`) in ``data``: its body
        (``blen`` bytes) and then exactly its array section.  Anything malformed, truncated
        or mistyped raises the format's error."""
        entry = self._by_cls.get(cls)
        if entry is None:
            raise self.error(f"{getattr(cls, '__name__', cls)} is not a {self.name} message")
        schema = entry.schema or self._schema(entry)
        try:
            if len(data) != blen and not schema.has_arrays:
                raise ValueError(f"{len(data) - blen} bytes after a body of {blen}")
            arrays = self._unpack_arrays(data, blen) if schema.has_arrays else []
            msg: M = schema.unpack(data, blen, arrays)
        except WireError:
            raise
        except _DECODE_ERRORS as exc:
            raise self.error(f"malformed {entry.cls.__name__} frame: {exc}") from None
        return msg

    def _unpack_arrays(self, data: Buffer, blen: int) -> List[Any]:
        """The arrays of the section after the body: views of one aligned copy."""
        section = len(data) - blen
        if section < 0 or section % 8:
            raise ValueError(f"an array section of {section} bytes")
        if not section:
            return []
        words = np.frombuffer(data, dtype=_U64, count=section // 8, offset=blen).copy()
        arrays: List[Any] = []
        i, n = 0, words.shape[0]
        while i < n:
            count = int(words[i])
            i += 1
            if count > n - i or len(arrays) >= self.max_array_count:
                raise ValueError(f"an array of {count} entries overruns the frame")
            arrays.append(words[i:i + count])
            i += count
        return arrays

    def decode(self, frame: Buffer, allowed: Optional[Collection[int]] = None,
               max_frame: Optional[int] = None) -> M:
        """The message in ``frame``, one whole frame (header included) and nothing more."""
        cls, blen, alen = self.parse_header(frame, allowed, max_frame)
        if len(frame) != HEADER_SIZE + blen + alen:
            raise self.error(f"frame of {len(frame)} bytes, its header announces {HEADER_SIZE + blen + alen}")
        return self.decode_frame(cls, memoryview(frame)[HEADER_SIZE:], blen)
