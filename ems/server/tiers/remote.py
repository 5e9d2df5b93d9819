"""Remote tier: Redis or Valkey, standalone (``redis://``) or Cluster (``redis+cluster://``).

This is the multi-node pool: every node's daemon writes committed values through to it and
reads misses from it.  A key is ``ems:{TAG}:NAME`` where TAG derives from the tenant and the
key's distribute part only, so every key sharing a ``distribute_key`` (all ranks' shards of
one hash) hashes to the same Cluster slot, hence the same node.  A value is stored as a
small header (magic, size, checksum) followed by its bytes.

Faults (connection refused, timeouts, cluster moves that fail) read as misses and failed
stores (a value larger than Redis stores is not sent: :data:`MAX_STORED`); they are
counted, logged once per kind, and never reach a client as an error.
After a fault the tier is **down** for :data:`DOWN_S`: reads miss and stores fail at once,
without asking Redis, so a node that went silent (a dead host: every request waits for the
socket timeout, and a Cluster client retries) costs one timeout per window, not one per
request; the first request after the window tries Redis again.
"""
from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, cast
from urllib.parse import urlparse, urlunparse

from .base import Sink, Tier

__all__ = ["RedisTier", "redis_key"]

log = logging.getLogger("ems.server.remote")

#: Seconds the tier is skipped after a fault.
DOWN_S = 5.0

_HEAD = struct.Struct("!8sQQ")
#: Largest stored string Redis accepts by default (``proto-max-bulk-len``): a larger value is
#: not written through (counted ``too_large``) and says nothing about the tier's health.
MAX_STORED = 512 << 20
_MAGIC = b"EMSRED01"


def redis_key(ns: str, key: str) -> str:
    """``ems:{tag}:name``: the tag hashes tenant + distribute part (shared by all shards)."""
    dpart = key.split("\x00", 1)[0]
    tag = hashlib.blake2b(f"{ns}\x00{dpart}".encode(), digest_size=8).hexdigest()
    name = hashlib.blake2b(f"{ns}\x00{key}".encode(), digest_size=20).hexdigest()
    return f"ems:{{{tag}}}:{name}"


class RedisTier(Tier):
    """Values in Redis / Valkey through the ``redis`` package."""

    name = "remote"

    def __init__(self, client: Any, url: str, ttl_s: Optional[int] = None) -> None:
        self._client = client
        self.url = url
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self.counters = {"stored": 0, "loaded": 0, "corrupt": 0, "errors": 0, "skipped": 0, "too_large": 0,
                         "retired": 0}
        self._warned: set[str] = set()
        self._down_until = 0.0

    @classmethod
    def from_url(cls, url: str, timeout_s: float = 2.0, connect_timeout_s: float = 1.0) -> "RedisTier":
        """The tier at ``url``.  The timeouts stay well under a client call's default
        deadline (5 s), Cluster retries included, so a dead node reads as a miss within
        the call rather than as the call's timeout."""
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError("the remote tier needs the 'redis' package: pip install 'redis>=5'") from exc
        parsed = urlparse(url)
        scheme = parsed.scheme
        cluster = scheme.endswith("+cluster")
        base = "rediss" if scheme.startswith("rediss") else "redis"
        plain = urlunparse(parsed._replace(scheme=base))
        client: redis.Redis | redis.RedisCluster
        if cluster:
            from redis.backoff import NoBackoff
            from redis.cluster import RedisCluster
            from redis.retry import Retry

            # One retry (after the client re-reads the slot map: a failover moved them),
            # not redis-py's ten, each waiting out the timeouts on a dead node.
            client = RedisCluster.from_url(plain, socket_timeout=timeout_s,
                                           socket_connect_timeout=connect_timeout_s, retry=Retry(NoBackoff(), 1))
        else:
            client = redis.Redis.from_url(plain, socket_timeout=timeout_s,
                                          socket_connect_timeout=connect_timeout_s)
        return cls(client, url)

    def _down(self) -> bool:
        """Whether a recent fault marks the tier down (the call is then skipped, counted)."""
        with self._lock:
            if time.monotonic() >= self._down_until:
                return False
            self.counters["skipped"] += 1
            return True

    def _fault(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.counters["errors"] += 1
            self._down_until = time.monotonic() + DOWN_S
            kind = type(exc).__name__
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("remote tier %s: %s failed: %s", self.url, what, exc)

    def store(self, ns: str, key: str, data: memoryview, checksum: int,
              current: Callable[[], bool] = lambda: True) -> bool:
        if _HEAD.size + len(data) > MAX_STORED:
            with self._lock:
                self.counters["too_large"] += 1
            return False
        if not current():
            return False
        if self._down():
            return False
        buf = bytearray(_HEAD.size + len(data))
        _HEAD.pack_into(buf, 0, _MAGIC, len(data), checksum)
        buf[_HEAD.size:] = data
        payload = memoryview(buf)  # redis-py sends a memoryview as is (one copy in all)
        try:
            self._client.set(redis_key(ns, key), payload, ex=self.ttl_s)
        except Exception as exc:  # redis raises many types; each is a failed store
            self._fault("store", exc)
            return False
        with self._lock:
            self.counters["stored"] += 1
        return True

    def exists(self, ns: str, keys: Sequence[str]) -> List[bool]:
        if not keys:
            return []
        if self._down():
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(redis_key(ns, k))
            return [bool(v) for v in pipe.execute()]
        except Exception as exc:  # a fault reads as absent
            self._fault("exists", exc)
            return [False] * len(keys)

    def load(self, ns: str, key: str, sink: Sink) -> Optional[int]:
        if self._down():
            return None
        try:
            raw = self._client.get(redis_key(ns, key))
        except Exception as exc:  # a fault reads as a miss
            self._fault("load", exc)
            return None
        if raw is None:
            return None
        if len(raw) < _HEAD.size:
            self.discard(ns, key)
            return None
        magic, size, crc = cast("tuple[bytes, int, int]", _HEAD.unpack_from(raw))
        if magic != _MAGIC or len(raw) != _HEAD.size + size:
            self.discard(ns, key)
            return None
        dest = sink(size)
        if dest is None:
            return None
        dest[:] = memoryview(raw)[_HEAD.size:]
        with self._lock:
            self.counters["loaded"] += 1
        return crc

    def retire(self, ns: str, key: str) -> None:
        self.retire_many(ns, [key])

    def retire_many(self, ns: str, keys: Sequence[str]) -> None:
        """Delete the copies of ``keys``, in one round trip: new values of them are being
        saved, and an older one must never be filled back (if a save fails, its key is a
        miss).  While the tier is down (or on a fault) a copy stays: a key whose save then
        fails may read that older value from here."""
        if not keys or self._down():
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.delete(redis_key(ns, k))
            removed = sum(int(v) for v in pipe.execute())
        except Exception as exc:  # redis raises many types; each is a failed retire
            self._fault("retire", exc)
            return
        with self._lock:
            self.counters["retired"] += removed

    def discard(self, ns: str, key: str) -> None:
        with self._lock:
            self.counters["corrupt"] += 1
        try:
            self._client.delete(redis_key(ns, key))
        except Exception as exc:
            self._fault("discard", exc)

    def health(self) -> Optional[str]:
        try:
            self._client.ping()  # within the client's socket timeout
        except Exception as exc:  # redis raises many types; each means not ready
            return f"{self.url} does not answer ({type(exc).__name__}: {exc})"
        return None

    def stats(self) -> Dict[str, Any]:
        with self._lock:
            return {"url": self.url, **self.counters}

    def close(self) -> None:
        try:
            self._client.close()
        except Exception as exc:  # closing a broken client must not fail shutdown
            log.debug("remote tier close: %s", exc)
