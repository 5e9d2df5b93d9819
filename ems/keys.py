"""Key identity: what a stored key is made of, and token-chain hashing.

A wire key is ``DPART + "\\0" + APART``.  DPART (the distribute part) names the tenant's
``access_id``, ``model_id``, ``llm_engine``, ``kvcache_type`` and the hash or the V0
``distribute_key``; APART adds this rank's parallel layout (tp/pp sizes and indices) and the
V0 ``attribute_key``.  So two ranks or two tenants never read each other's blocks, and all
ranks' shards of one hash share a DPART: the remote tier hashes DPART only, so they share a
Redis Cluster slot, hence a node.
"""
from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence, Union

import numpy as np

from .config import Layout

__all__ = ["Namespace", "HashId", "token_chain_hashes", "hash_text"]

HashId = Union[int, bytes]

_CHAIN_SEED = b"ems-token-chain-v1"


#: The letter that starts a hash's key text, by type: an int's hex and a bytes' hex never
#: share a key (``0xb01`` and ``b"\x01"`` once were both ``hb01``).  Both differ from the
#: ``h`` of that older encoding, so a value stored under it (on disk, in Redis) is never
#: read as another type's value: it is not found, and ages out.
INT_TAG, BYTES_TAG = "i", "y"


def hash_text(h: HashId) -> str:
    """A hash as key text: ints as ``i`` + hex (``-`` first if negative), bytes as ``y`` +
    hex; no int and bytes share a text."""
    if isinstance(h, bytes):
        return BYTES_TAG + h.hex()
    return INT_TAG + format(int(h), "x")


def _escape(part: str) -> str:
    """An id as key text: ``|`` separates the parts of a key, so it (and ``%``, the escape
    itself) is percent-encoded; ids without either, all the vendor's, are unchanged."""
    return part.replace("%", "%25").replace("|", "%7C")


class Namespace:
    """Builds wire keys for one client (tenant + layout)."""

    def __init__(self, access_id: Optional[str], layout: Layout) -> None:
        ids = (access_id or "", layout.model_id, layout.llm_engine, layout.kvcache_type)
        self.dprefix = "".join(f"{_escape(part)}|" for part in ids)
        self.apart = (f"tp{layout.tp_world_size}.{layout.rank_in_tp_group}|"
                      f"pp{layout.pp_world_size}.{layout.rank_in_pp_group}")
        # The key of an int hash as one %-format ("%x" is hash_text's hex): building a
        # call's keys is then one C call per key; "%" in the parts must not format.
        self._int_key = (f"{self.dprefix}{INT_TAG}".replace("%", "%%") + "%x\x00"
                         + self.apart.replace("%", "%%")).__mod__
        #: An int hash's key is ``prefix + format(h, "x") + suffix`` (UTF-8).
        self.int_key_parts = (f"{self.dprefix}{INT_TAG}".encode(), f"\x00{self.apart}".encode())

    def hash_keys(self, hashes: Sequence[HashId]) -> List[str]:
        """Keys of the hash, token and chunk forms."""
        if set(map(type, hashes)) <= {int}:
            return list(map(self._int_key, hashes))
        d, a = self.dprefix, self.apart
        return [f"{d}{hash_text(h)}\x00{a}" for h in hashes]

    def primary_key(self, distribute_key: str, attribute_key: str) -> str:
        """Key of a V0 ``PrimaryKey``."""
        return f"{self.dprefix}k{distribute_key}\x00{self.apart}|{attribute_key}"

    def str_key(self, key: str) -> str:
        """Key of a V0 ``str`` key."""
        return f"{self.dprefix}s{key}\x00{self.apart}|"


def token_chain_hashes(token_ids: np.ndarray, block_size: int) -> List[int]:
    """Chained prefix hashes of every full ``block_size`` chunk of ``token_ids``.

    Chunk i's hash covers chunks 0..i (BLAKE2b-64 of the previous digest and the chunk's
    tokens as little-endian int64), so equal hashes mean equal prefixes, across processes
    and hosts.  A trailing partial chunk gets no hash.
    """
    tokens = np.ascontiguousarray(token_ids, dtype="<i8")
    out: List[int] = []
    prev = _CHAIN_SEED
    for i in range(tokens.shape[0] // block_size):
        digest = hashlib.blake2b(prev + tokens[i * block_size:(i + 1) * block_size].tobytes(),
                                 digest_size=8).digest()
        out.append(int.from_bytes(digest, "big"))
        prev = digest
    return out
