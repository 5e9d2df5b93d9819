"""Argument binding and validation of save / load / exists: which call form, which keys,
which bytes.  Every problem raises ``InvalidArgument`` naming the argument.

Forms (exclusive; mixing arguments of two is invalid):

* V0 ``(option, key_list, value_list)``: keys with buffers.
* hash ``(slot_mapping, hashes, offsets, option)``: key i covers ``offsets[i]`` slots.
* token ``(slot_mapping, token_ids=, mask=, option=)``: chained hashes of full chunks.
* chunk ``(hashes=, chunk_descs=, option=)``: key i covers ``chunk_descs[g][i]`` per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Optional, Set, Tuple, TypeGuard

import numpy as np

from ._errors import invalid
from .keys import HashId, Namespace, token_chain_hashes
from .pool.keyset import KeySetView
from .kvcache import KvLayout, ValuePlan, buffers_plan
from .types import CcKvOption, KvBufferWrapper, PrimaryKey, check_key_text

__all__ = ["Request", "KeyQuery", "parse_transfer", "parse_exists", "V0", "HASH", "TOKEN", "CHUNK"]

V0, HASH, TOKEN, CHUNK = "v0", "hash", "token", "chunk"

_V0_POS = ("option", "key_list", "value_list")
_V1_POS = ("slot_mapping", "hashes", "offsets", "option")
_ALL = frozenset(_V0_POS + _V1_POS + ("token_ids", "mask", "chunk_descs"))
_FORM_ARGS = {
    V0: {"key_list", "value_list"},
    HASH: {"slot_mapping", "hashes", "offsets"},
    TOKEN: {"slot_mapping", "token_ids", "mask"},
    CHUNK: {"hashes", "chunk_descs"},
}


@dataclass
class Request:
    """A validated call: its form, option, wire keys and one value plan per key."""

    form: str
    option: CcKvOption
    keys: List[str]
    values: List[ValuePlan]
    device: str = "cpu"  # where a V0 call's buffers are (V1: the registered cache's device)

    @property
    def total(self) -> int:
        return len(self.keys)


def _bind(op: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    if len(args) >= 2 and args[0] is None and _v0_keys(args[1]):
        # (None, key_list, value_list): the V0 form, whose option the vendor says must not
        # be None; read as the hash form, it would blame a slot_mapping it never had.
        raise invalid("option", f"must be a CcKvOption in the V0 form {op}(option, key_list, value_list), got None")
    names = _V0_POS if args and isinstance(args[0], CcKvOption) else _V1_POS
    if len(args) > len(names):
        raise invalid("args", f"{op}() takes at most {len(names)} positional arguments, got {len(args)}")
    bound = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in _ALL:
            raise invalid(name, f"unknown argument of {op}()")
        if name in bound:
            raise invalid(name, f"{op}() got it both by position and by name")
        bound[name] = value
    return bound


def _v0_keys(value: Any) -> bool:
    """Whether ``value`` looks like a V0 ``key_list`` (a non-empty list of ``PrimaryKey``
    or ``str``), which no hash form argument is."""
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], (PrimaryKey, str))


def _option(value: Any) -> CcKvOption:
    if value is None:
        return CcKvOption()
    if not isinstance(value, CcKvOption):
        raise invalid("option", f"must be a CcKvOption, got {type(value).__name__}")
    return value.validate()


def _to_numpy(value: Any) -> Any:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        return value.detach().cpu().numpy()
    return value


def int_array(name: str, value: Any, allow_empty: bool = False) -> np.ndarray:
    """A 1-D int64 array from a list / tuple / ndarray / tensor of ints."""
    value = _to_numpy(value)
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise invalid(name, f"must be a list of int, got {type(value).__name__}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise invalid(name, f"must be a list of int: {exc}") from None
    if arr.ndim != 1:
        raise invalid(name, f"must be a flat list of int, got shape {arr.shape}")
    if arr.size == 0:
        if allow_empty:
            return arr.astype(np.int64)
        raise invalid(name, "must not be empty")
    if arr.dtype.kind == "O":
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in arr):
            raise invalid(name, "must contain only int")
        try:
            return arr.astype(np.int64)
        except OverflowError:
            raise invalid(name, "values must fit in int64") from None
    if arr.dtype.kind not in "iu":
        raise invalid(name, f"must contain only int, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def mask_array(value: Any) -> np.ndarray:
    """``mask`` as int64 0/1: a flat list / tuple / ndarray / tensor of bools (the vendor
    describes it as a False prefix and a True suffix) or of ints (its samples pass 0/1)."""
    value = _to_numpy(value)
    if isinstance(value, (list, tuple, np.ndarray)):
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):  # ragged: int_array names the problem
            arr = None
        if arr is not None and arr.dtype.kind == "b":
            value = arr.astype(np.int64)
    return int_array("mask", value)


def hash_list(name: str, value: Any, allow_empty: bool = False) -> List[HashId]:
    """A list of hashes (ints of any size, or bytes)."""
    value = _to_numpy(value)
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise invalid(name, f"must be a list of int, got {type(value).__name__}")
    if not value and not allow_empty:
        raise invalid(name, "must not be empty")
    if set(map(type, value)) == {int}:  # the common case, checked at C speed
        return list(value)
    out: List[HashId] = []
    for i, h in enumerate(value):
        if isinstance(h, bool) or not isinstance(h, (int, np.integer, bytes)):
            raise invalid(name, f"entry {i} is a {type(h).__name__}, not an int")
        out.append(h if isinstance(h, bytes) else int(h))
    return out


def _unique(hashes: List[HashId]) -> None:
    """Refuse the first repeated hash of a save, as the vendor refuses a repeated key (one
    key cannot take two values in one call)."""
    if len(set(hashes)) == len(hashes):  # the common case, at C speed
        return
    first: Dict[HashId, int] = {}
    for i, h in enumerate(hashes):
        if h in first:
            raise invalid(f"hashes[{i}]", f"duplicate hash {h!r} (also hashes[{first[h]}])")
        first[h] = i


def _form(bound: Dict[str, Any]) -> str:
    given = {k for k, v in bound.items() if v is not None and k != "option"}
    if given & _FORM_ARGS[V0]:
        form = V0
    elif "chunk_descs" in given:
        form = CHUNK
    elif given & {"token_ids", "mask"}:
        form = TOKEN
    elif given:
        form = HASH
    else:
        raise invalid("hashes", "no keys given (use slot_mapping+hashes+offsets, slot_mapping+token_ids, "
                      "hashes+chunk_descs, or option+key_list+value_list)")
    extra = sorted(given - _FORM_ARGS[form])
    if extra:
        raise invalid(extra[0], f"cannot be combined with the {form} form's arguments "
                      f"({', '.join(sorted(_FORM_ARGS[form]))})")
    required = {V0: ("key_list", "value_list"), HASH: ("slot_mapping", "hashes", "offsets"),
                TOKEN: ("slot_mapping", "token_ids"), CHUNK: ("hashes", "chunk_descs")}[form]
    for name in required:
        if bound.get(name) is None:
            raise invalid(name, f"is required by the {form} form")
    return form


def parse_transfer(op: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], ns: Namespace,
                   layout: Optional[KvLayout]) -> Request:
    """Validate a save / load call into a :class:`Request`."""
    bound = _bind(op, args, kwargs)
    form = _form(bound)
    option = _option(bound.get("option"))
    if form == V0:
        keys, values, device = _v0(bound["key_list"], bound["value_list"], ns)
        return Request(form, option, keys, values, device)
    if layout is None:
        raise invalid("kvcache", f"call register_kvcache() before the {form} form of {op}()")
    saving = op.endswith("save")  # a load may fill two places from one key
    if form == HASH:
        hashes, spans = _hash_form(bound, layout, saving)
        return Request(form, option, ns.hash_keys(hashes), [layout.span_plan(s) for s in spans])
    if form == TOKEN:
        hashes, spans = _token_form(bound, layout)
        return Request(form, option, ns.hash_keys(hashes), [layout.span_plan(s) for s in spans])
    hashes, descs = _chunk_form(bound, layout, saving)
    return Request(form, option, ns.hash_keys(hashes), [layout.chunk_plan(d) for d in descs])


def _v0(key_list: Any, value_list: Any, ns: Namespace) -> Tuple[List[str], List[ValuePlan], str]:
    if not isinstance(key_list, (list, tuple)) or not key_list:
        raise invalid("key_list", "must be a non-empty list of PrimaryKey or str")
    if not isinstance(value_list, (list, tuple)):
        raise invalid("value_list", "must be a list of lists of KvBufferWrapper")
    if len(value_list) != len(key_list):
        raise invalid("value_list", f"has {len(value_list)} entries for {len(key_list)} keys")
    keys: List[str] = []
    seen: Set[Hashable] = set()
    for i, k in enumerate(key_list):
        ident, wire = _v0_key(f"key_list[{i}]", k, ns)
        if ident in seen:
            raise invalid(f"key_list[{i}]", f"duplicate key {k!r}")
        seen.add(ident)
        keys.append(wire)
    values: List[ValuePlan] = []
    devices: Set[str] = set()
    for i, bufs in enumerate(value_list):
        values.append(_v0_value(f"value_list[{i}]", bufs, devices))
    if len(devices) > 1:
        raise invalid("value_list", f"mixes buffers of {', '.join(sorted(devices))}; one call moves one kind of memory")
    return keys, values, devices.pop() if devices else "cpu"


def _v0_key(name: str, key: Any, ns: Namespace) -> Tuple[Hashable, str]:
    """A V0 key (``PrimaryKey`` or ``str``): what tells it from the call's other keys, and
    its wire key."""
    if isinstance(key, PrimaryKey):
        return (key.distribute_key, key.attribute_key), ns.primary_key(key.distribute_key, key.attribute_key)
    if isinstance(key, str):
        check_key_text(name, key)
        return key, ns.str_key(key)
    raise invalid(name, f"must be a PrimaryKey or str, got {type(key).__name__}")


def _v0_value(name: str, bufs: Any, devices: Set[str]) -> ValuePlan:
    """The plan of one V0 value (its buffers concatenated); adds their memory to ``devices``."""
    if not isinstance(bufs, (list, tuple)) or not bufs:
        raise invalid(name, "must be a non-empty list of KvBufferWrapper")
    addrs, lens = [], []
    for j, b in enumerate(bufs):
        if not isinstance(b, KvBufferWrapper):
            raise invalid(f"{name}[{j}]", f"must be a KvBufferWrapper, got {type(b).__name__}")
        addr, device = b.locate()
        devices.add(device)
        addrs.append(addr)
        lens.append(b.length)
    return buffers_plan(addrs, lens)


def _hash_form(bound: Dict[str, Any], layout: KvLayout, unique: bool) -> Tuple[List[HashId], List[np.ndarray]]:
    slots = int_array("slot_mapping", bound["slot_mapping"])
    hashes = hash_list("hashes", bound["hashes"])
    if unique:
        _unique(hashes)
    offsets = int_array("offsets", bound["offsets"])
    if len(offsets) != len(hashes):
        raise invalid("offsets", f"has {len(offsets)} entries for {len(hashes)} hashes")
    if int(offsets.min()) <= 0:
        raise invalid("offsets", "every entry must be > 0")
    if int(offsets.sum()) != len(slots):
        raise invalid("offsets", f"sum(offsets) = {int(offsets.sum())} but len(slot_mapping) = {len(slots)}")
    layout.check_slots("slot_mapping", slots)
    bounds = np.concatenate(([0], np.cumsum(offsets)))
    return hashes, [slots[bounds[i]:bounds[i + 1]] for i in range(len(hashes))]


def _token_form(bound: Dict[str, Any], layout: KvLayout) -> Tuple[List[HashId], List[np.ndarray]]:
    slots = int_array("slot_mapping", bound["slot_mapping"])
    tokens = int_array("token_ids", bound["token_ids"])
    if len(tokens) != len(slots):
        raise invalid("token_ids", f"has {len(tokens)} tokens but slot_mapping has {len(slots)} slots")
    mask = bound.get("mask")
    if mask is not None:
        mask = mask_array(mask)
        if len(mask) != len(tokens):
            raise invalid("mask", f"has {len(mask)} entries for {len(tokens)} tokens")
        if not np.isin(mask, (0, 1)).all():
            raise invalid("mask", "entries must be 0 (cached prefix) or 1 (suffix)")
        if (np.diff(mask) < 0).any():
            raise invalid("mask", "must be 0s (cached prefix) followed by 1s (suffix)")
    layout.check_slots("slot_mapping", slots)
    bs = layout.block_size
    chain = token_chain_hashes(tokens, bs)
    hashes: List[HashId] = []
    spans: List[np.ndarray] = []
    for i, h in enumerate(chain):
        if mask is not None and mask[(i + 1) * bs - 1] == 0:
            continue  # the whole chunk is in the cached prefix
        hashes.append(h)
        spans.append(slots[i * bs:(i + 1) * bs])
    return hashes, spans


def _chunk_form(bound: Dict[str, Any], layout: KvLayout,
                unique: bool) -> Tuple[List[HashId], List[List[Tuple[int, int]]]]:
    hashes = hash_list("hashes", bound["hashes"])
    if unique:
        _unique(hashes)
    descs = bound["chunk_descs"]
    if not isinstance(descs, (list, tuple)):
        raise invalid("chunk_descs", "must be a list (layer groups) of lists of (start_slot, length)")
    if len(descs) != len(layout.groups):
        raise invalid("chunk_descs", f"has {len(descs)} layer groups but store_layer_group_desc has "
                      f"{len(layout.groups)}")
    per_key: List[List[Tuple[int, int]]] = [[] for _ in hashes]
    for g, group in enumerate(descs):
        if not isinstance(group, (list, tuple)) or len(group) != len(hashes):
            raise invalid("chunk_descs", f"group {g} must have one (start_slot, length) per hash "
                          f"({len(hashes)})")
        for i, d in enumerate(group):
            per_key[i].append(_chunk_desc(f"[{g}][{i}]", d, layout.num_slots))
    return hashes, per_key


def _chunk_desc(where: str, desc: Any, num_slots: int) -> Tuple[int, int]:
    """One ``(start_slot, length)`` pair of ``chunk_descs``, inside the registered cache."""
    if (not isinstance(desc, (list, tuple)) or len(desc) != 2
            or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in desc)):
        raise invalid("chunk_descs", f"{where} must be a (start_slot, length) pair of int")
    start, length = int(desc[0]), int(desc[1])
    if start < 0 or length <= 0 or start + length > num_slots:
        raise invalid("chunk_descs", f"{where} = ({start}, {length}) is outside the "
                      f"registered cache [0, {num_slots})")
    return start, length


class KeyQuery:
    """The keys of one ``exists`` call.  Int hashes stay ints until a string is needed: a
    published key set counts ``prefix + hex(h) + suffix`` keys without building them."""

    def __init__(self, ns: Namespace, ints: Optional[List[int]] = None,
                 keys: Optional[List[str]] = None) -> None:
        self._ns = ns
        self._ints = ints
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys) if self._keys is not None else len(self._ints or ())

    def strings(self) -> List[str]:
        """The wire keys."""
        if self._keys is None:
            self._keys = self._ns.hash_keys(self._ints or [])
        return self._keys

    def count_in(self, keyset: KeySetView) -> Optional[int]:
        """Leading keys ``keyset`` holds, or None when it cannot answer now."""
        if self._keys is None and self._ints is not None:
            prefix, suffix = self._ns.int_key_parts
            try:
                return keyset.count_ints(prefix, self._ints, suffix)
            except OverflowError:  # a negative or > 64-bit hash: count its text instead
                pass
        return keyset.count(self.strings())


def parse_exists(args: Tuple[Any, ...], kwargs: Dict[str, Any], ns: Namespace,
                 layout: Optional[KvLayout]) -> Tuple[KeyQuery, CcKvOption]:
    """``exists(hashes, option=None)``; also ``token_ids=`` (chained hashes) or ``key_list=``."""
    bound = _bind_exists(args, kwargs)
    option = _option(bound.get("option"))
    given = [k for k in ("hashes", "token_ids", "key_list") if bound.get(k) is not None]
    if len(given) != 1:
        raise invalid("hashes", "give exactly one of hashes, token_ids or key_list")
    if given[0] == "hashes":
        hashes = hash_list("hashes", bound["hashes"], allow_empty=True)
        if _all_ints(hashes):
            return KeyQuery(ns, ints=hashes), option
        return KeyQuery(ns, keys=ns.hash_keys(hashes)), option
    if given[0] == "token_ids":
        if layout is None:
            raise invalid("kvcache", "call register_kvcache() before exists(token_ids=...)")
        return KeyQuery(ns, ints=token_chain_hashes(int_array("token_ids", bound["token_ids"], True),
                                                    layout.block_size)), option
    key_list = bound["key_list"]
    if not isinstance(key_list, (list, tuple)):
        raise invalid("key_list", "must be a list of PrimaryKey or str")
    return KeyQuery(ns, keys=[_v0_key(f"key_list[{i}]", k, ns)[1] for i, k in enumerate(key_list)]), option


def _bind_exists(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    names = ("hashes", "option")
    if len(args) > len(names):
        raise invalid("args", f"exists() takes at most 2 positional arguments, got {len(args)}")
    bound = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in ("hashes", "option", "token_ids", "key_list"):
            raise invalid(name, "unknown argument of exists()")
        if name in bound:
            raise invalid(name, "exists() got it both by position and by name")
        bound[name] = value
    return bound


def _all_ints(hashes: List[HashId]) -> TypeGuard[List[int]]:
    """Whether every hash is an ``int`` (none is ``bytes``)."""
    return set(map(type, hashes)) <= {int}
