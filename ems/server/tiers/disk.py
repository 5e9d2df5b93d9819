"""Disk tier: one file per value in a directory, with a byte capacity and LRU order.

File = header (magic, size, checksum, tenant and key lengths) + tenant + key + value.
Files are written to a temporary name and renamed, so a reader never sees half a file;
at start the directory is scanned (headers only) and its values are found again.  A file
whose value fails its checksum is a miss and is deleted.
"""
from __future__ import annotations

import logging
import os
import re
import struct
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import parse_qs, urlparse

from .base import Sink, Tier, tier_key

__all__ = ["DiskTier", "parse_size"]

log = logging.getLogger("ems.server.disk")

_HEAD = struct.Struct("!8sQQII")
_MAGIC = b"EMSVAL01"
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?", re.I)


def parse_size(text: str) -> int:
    """``"64M"``, ``"4GiB"``, ``"1048576"`` -> bytes."""
    m = _SIZE_RE.fullmatch(str(text).strip())
    if not m:
        raise ValueError(f"not a size: {text!r}")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


class DiskTier(Tier):
    """Values as files under ``directory``, at most ``capacity`` bytes of values."""

    name = "disk"

    def __init__(self, directory: str, capacity: int) -> None:
        self.directory = os.path.abspath(directory)
        self.capacity = int(capacity)
        os.makedirs(self.directory, exist_ok=True)
        self._lock = threading.Lock()
        self._index: "OrderedDict[str, Tuple[int, int]]" = OrderedDict()  # name -> (size, checksum)
        self.used = 0
        self.counters = {"stored": 0, "loaded": 0, "corrupt": 0, "evicted": 0, "retired": 0}
        self._scan()

    @classmethod
    def from_url(cls, url: str) -> "DiskTier":
        parsed = urlparse(url)
        query = parse_qs(parsed.query)
        return cls(parsed.path, parse_size(query.get("capacity", ["1G"])[0]))

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name + ".val")

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".tmp"):
                os.unlink(entry.path)  # a write the previous daemon did not finish
                continue
            if not entry.name.endswith(".val"):
                continue
            try:
                with open(entry.path, "rb") as f:
                    magic, size, crc, _nlen, _klen = _HEAD.unpack(f.read(_HEAD.size))
                if magic != _MAGIC:
                    raise ValueError("bad magic")
                found.append((entry.stat().st_mtime, entry.name[:-4], size, crc))
            except (OSError, ValueError, struct.error):
                log.warning("disk tier: removing unreadable file %s", entry.path)
                os.unlink(entry.path)
        for _mtime, name, size, crc in sorted(found):
            self._index[name] = (size, crc)
            self.used += size
        self._evict(0)

    def _evict(self, need: int) -> None:
        while self._index and self.used + need > self.capacity:
            name, (size, _crc) = self._index.popitem(last=False)
            self.used -= size
            self.counters["evicted"] += 1
            try:
                os.unlink(self._path(name))
            except FileNotFoundError:
                pass

    def store(self, ns: str, key: str, data: memoryview, checksum: int,
              current: Callable[[], bool] = lambda: True) -> bool:
        size = len(data)
        if size > self.capacity:
            return False
        name = tier_key(ns, key)
        path = self._path(name)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        meta = ns.encode() + key.encode()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, _HEAD.pack(_MAGIC, size, checksum, len(ns.encode()), len(key.encode())) + meta)
                done = 0
                while done < size:
                    done += os.write(fd, data[done:])
            finally:
                os.close(fd)
            with self._lock:  # retire() takes it too: the check and the replace are one step
                if not current():
                    os.unlink(tmp)
                    return False
                old = self._index.pop(name, None)
                if old is not None:
                    self.used -= old[0]
                self._evict(size)
                os.replace(tmp, path)
                self._index[name] = (size, checksum)
                self.used += size
                self.counters["stored"] += 1
            return True
        except OSError as exc:
            log.warning("disk tier: cannot write %s: %s", path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def exists(self, ns: str, keys: Sequence[str]) -> List[bool]:
        with self._lock:
            return [tier_key(ns, k) in self._index for k in keys]

    def lookup(self, ns: str, key: str) -> Optional[Tuple[int, int]]:
        """(size, checksum) of a value on disk, or None."""
        with self._lock:
            return self._index.get(tier_key(ns, key))

    def load(self, ns: str, key: str, sink: Sink) -> Optional[int]:
        name = tier_key(ns, key)
        with self._lock:
            meta = self._index.get(name)
            if meta is None:
                return None
            self._index.move_to_end(name)
        size, crc = meta
        try:
            with open(self._path(name), "rb") as f:
                magic, fsize, fcrc, nlen, klen = _HEAD.unpack(f.read(_HEAD.size))
                if magic != _MAGIC or fsize != size or fcrc != crc:
                    raise ValueError("header changed")
                if f.read(nlen + klen) != ns.encode() + key.encode():
                    raise ValueError("key mismatch")
                dest = sink(size)
                if dest is None:
                    return None
                got = f.readinto(dest)
                if got != size:
                    raise ValueError(f"short file ({got} of {size} bytes)")
        except FileNotFoundError:
            self._forget(name)
            return None
        except (OSError, ValueError, struct.error) as exc:
            log.warning("disk tier: dropping unreadable value %s: %s", name, exc)
            self.discard(ns, key)
            return None
        self.counters["loaded"] += 1
        return crc

    def _forget(self, name: str) -> None:
        with self._lock:
            meta = self._index.pop(name, None)
            if meta is not None:
                self.used -= meta[0]

    def discard(self, ns: str, key: str) -> None:
        name = tier_key(ns, key)
        self.counters["corrupt"] += 1
        self._forget(name)
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def retire(self, ns: str, key: str) -> None:
        """Forget the copy of ``key``, if there is one: a newer value of it was committed,
        and this copy must never be filled back (should the newer one be evicted without
        reaching this tier).  Under this tier's lock, so a spill of the newer value, which
        replaces the file under the same lock, is never undone."""
        name = tier_key(ns, key)
        with self._lock:
            meta = self._index.pop(name, None)
            if meta is None:
                return
            self.used -= meta[0]
            self.counters["retired"] += 1
            try:
                os.unlink(self._path(name))
            except FileNotFoundError:
                pass

    def health(self) -> Optional[str]:
        if not os.access(self.directory, os.W_OK | os.X_OK):
            return f"{self.directory} is not a writable directory"
        return None

    def stats(self) -> Dict[str, Any]:
        with self._lock:
            return {"directory": self.directory, "capacity": self.capacity, "used": self.used,
                    "values": len(self._index), **self.counters}
