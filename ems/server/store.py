"""The pool's index: two-phase puts, leases, LRU eviction and the tiers below memory.

Rules the store keeps (SPEC section 2):

* A key is visible only once COMMIT publishes a reservation its owner finished writing.
* A value under a lease (a GET's pin) or being spilled is never freed or reused.  Saving
  a key again hides its old value from new readers at RESERVE (a failed save is a miss,
  never the old value); the old one is freed when its last pin goes.
* Every value carries its checksum; a value a tier returns is checked before it becomes
  visible, and a mismatch is a miss that also removes the bad copy.

Threading: one lock guards all state.  Tier I/O (disk writes when spilling, disk or remote
reads when filling, remote writes through) happens with the lock released, on the calling
session's thread, with the entries involved pinned.  ``_allocate`` may release the lock
while it spills a victim, so callers re-read any state they need after it returns.

Memory: each tenant has its own anonymous memfd arena (clients map it: the descriptor
travels with the HELLO reply), carved into 4 KiB pages by the engine's first-fit
allocator.  Freed values keep their pages: every process that maps the arena has already
faulted them in, and a fresh page costs about a microsecond per 4 KiB in each process
(several times the copy itself), so reuse is what keeps saves at memory speed.  Resident
memory is therefore each arena's high-water mark, at most ``arena_size``.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from datadist.engine.memory import Arena, PoolAllocator, round_to_pages

from ..pool.checksum import checksum
from ..pool.keyset import KeySet
from ..pool.wire import NO_SPACE, SKIPPED
from .tiers.base import Tier

__all__ = ["Store", "Owner", "TenantSpace", "Entry", "PAGE_SHIFT", "PAGE"]

log = logging.getLogger("ems.server.store")

#: Allocation unit of the arenas (4 KiB): a value of a few tokens wastes little capacity.
PAGE_SHIFT = 12
PAGE = 1 << PAGE_SHIFT
#: Most keys a tenant's published key set is sized for (2**22 keys: 2**23 slots, a 64 MiB
#: memfd, resident as keys spread over it); beyond it, or with more empty values than
#: pages, clients ask the daemon instead.
MAX_PUBLISHED_KEYS = 1 << 22
#: Longest memfd name Linux takes (bytes, without the terminating NUL).
_MEMFD_NAME_MAX = 249


def _memfd_name(prefix: str, tenant: str) -> str:
    """A tenant's memfd name: only a label in /proc listings, so a long ``access_id`` (up
    to 512 characters) is cut to the kernel's limit rather than refused."""
    return f"{prefix}{tenant or 'open'}"[:_MEMFD_NAME_MAX]


class Entry:
    """A committed value in a tenant's arena."""

    __slots__ = ("space", "key", "off", "alloc", "size", "checksum", "pins", "live", "on_disk", "superseded")

    def __init__(self, space: "TenantSpace", key: str, off: int, alloc: int, size: int,
                 crc: int, on_disk: bool = False) -> None:
        self.space, self.key, self.off, self.alloc, self.size = space, key, off, alloc, size
        self.checksum = crc
        self.pins = 0
        self.live = False
        self.on_disk = on_disk
        #: A newer value of the key was committed while this one spilled: its copy must not land.
        self.superseded = False


@dataclass
class Reservation:
    key: str
    size: int
    alloc: int
    #: The checksum of the bytes the daemon received for it (a WRITE over TCP), if any.
    received: Optional[int] = None
    #: When it was made (``time.monotonic``): old ones are taken back when memory is short.
    made: float = field(default_factory=time.monotonic)
    #: A WRITE's bytes are arriving into it: never taken back then (they would land in
    #: pages given to another reservation); the WRITE has its own deadline.
    writing: bool = False


@dataclass
class Owner:
    """What one connection holds: open reservations and leases (released when it closes)."""

    ident: int
    reservations: Dict[Tuple[str, int], Reservation] = field(default_factory=dict)
    leases: Dict[int, List[Entry]] = field(default_factory=dict)


class TenantSpace:
    """A tenant's arena, the allocator of its pages (by offset), its index, and the key
    set it publishes (every key of the index or being spilled; clients map it)."""

    def __init__(self, name: str, arena: Arena) -> None:
        self.name = name
        self.arena = arena
        self.pages = PoolAllocator(arena, PAGE_SHIFT)
        self.index: Dict[str, Entry] = {}
        self.keys = KeySet(_memfd_name("ems-keys-", name), min(arena.size // PAGE, MAX_PUBLISHED_KEYS))

    def close(self) -> None:
        self.index.clear()
        self.keys.close()
        self.arena.close()


class Store:
    """Values of every tenant, within ``capacity`` bytes of shared memory."""

    def __init__(self, capacity: int, arena_size: Optional[int] = None,
                 disk: Optional[Tier] = None, remote: Optional[Tier] = None,
                 reserve_timeout: float = 120.0) -> None:
        self.capacity = int(capacity)
        #: Seconds after which an uncommitted reservation is taken back when memory is short.
        self.reserve_timeout = float(reserve_timeout)
        self._swept = -float("inf")  # when stale reservations were last looked for
        # Arenas are sparse; extra address space absorbs fragmentation.
        self.arena_size = round_to_pages(arena_size or self.capacity + self.capacity // 4 + (16 << 20), PAGE)
        self.disk = disk
        self.remote = remote
        self.used = 0
        self._lock = threading.Lock()
        self._spaces: Dict[str, TenantSpace] = {}
        self._lru: "OrderedDict[Tuple[str, str], Entry]" = OrderedDict()
        self._spilling: Dict[Tuple[str, str], Entry] = {}
        self._next_owner = 0
        self._next_lease = 0
        self.counters = {k: 0 for k in (
            "reserved", "no_space", "committed", "skipped", "gets", "hits", "misses",
            "disk_fills", "remote_fills", "evictions", "spills", "corrupt", "unwritten", "expired", "exists_calls")}
        # Gets by tier: values found there (and their bytes), and lookups that reached the
        # tier and did not find the value there.
        self.tiers = ["memory"] + [t.name for t in (disk, remote) if t is not None]
        self.counters.update({f"{tier}_{what}": 0 for tier in self.tiers for what in ("hits", "hit_bytes", "misses")})
        #: Connections' owners, for the reservations they hold (two-phase puts pending).
        self._owners: "weakref.WeakValueDictionary[int, Owner]" = weakref.WeakValueDictionary()

    # -- tenants and owners -------------------------------------------------------------
    def space(self, tenant: str) -> TenantSpace:
        """The tenant's space, created (with its arena) on first use."""
        with self._lock:
            ts = self._spaces.get(tenant)
            if ts is None:
                ts = TenantSpace(tenant, Arena(_memfd_name("ems-", tenant), self.arena_size))
                self._spaces[tenant] = ts
            return ts

    def new_owner(self) -> Owner:
        with self._lock:
            self._next_owner += 1
            owner = Owner(self._next_owner)
            self._owners[owner.ident] = owner
            return owner

    def pending_puts(self) -> int:
        """Reservations not yet committed nor aborted (two-phase puts in progress)."""
        with self._lock:
            return sum(len(owner.reservations) for owner in self._owners.values())

    def close_owner(self, owner: Owner) -> None:
        """Release everything a closed connection held."""
        with self._lock:
            for entries in owner.leases.values():
                for e in entries:
                    self._unpin(e)
            owner.leases.clear()
            for (tenant, off), res in owner.reservations.items():
                self._free(self._spaces[tenant], off, res.alloc)
            owner.reservations.clear()

    # -- memory management (lock held) ---------------------------------------------------
    def _free(self, ts: TenantSpace, off: int, alloc: int) -> None:
        ts.pages.free_offset(off, alloc)
        self.used -= alloc

    def _unlink(self, e: Entry) -> None:
        """Take ``e`` out of the index (it stays allocated while pinned)."""
        if e.live:
            e.live = False
            self._lru.pop((e.space.name, e.key), None)  # first: nothing below may leave it a victim
            if e.space.index.get(e.key) is e:
                del e.space.index[e.key]
                self._published(e.space, e.key)
        self._maybe_free(e)

    def _published(self, ts: TenantSpace, key: str) -> None:
        """Mirror whether ``key`` is present (indexed or being spilled) into the key set."""
        if key in ts.index or (ts.name, key) in self._spilling:
            ts.keys.add(key, lambda: self._present(ts))
        else:
            ts.keys.discard(key, len(ts.index), lambda: self._present(ts))

    def _present(self, ts: TenantSpace) -> List[str]:
        return list(ts.index) + [k for (name, k) in self._spilling if name == ts.name]

    def _maybe_free(self, e: Entry) -> None:
        if not e.live and e.pins == 0 and e.alloc:
            self._free(e.space, e.off, e.alloc)
            e.alloc = 0

    def _unpin(self, e: Entry) -> None:
        e.pins -= 1
        self._maybe_free(e)

    def _insert(self, e: Entry) -> None:
        old = e.space.index.get(e.key)
        if old is not None:
            self._unlink(old)
        e.live = True
        e.space.index[e.key] = e
        self._lru[(e.space.name, e.key)] = e
        self._published(e.space, e.key)

    def _victim(self, ts: Optional[TenantSpace]) -> Optional[Entry]:
        for e in self._lru.values():
            if e.pins == 0 and (ts is None or e.space is ts):
                return e
        return None

    def _allocate(self, ts: TenantSpace, n: int) -> Optional[int]:
        """``n`` page-aligned bytes in ``ts``'s arena, evicting LRU values as needed."""
        if n > self.capacity:
            return None
        while True:
            if self.used + n <= self.capacity:
                off = ts.pages.alloc_offset(n)
                if off is not None:
                    self.used += n
                    return off
                victim = self._victim(ts)  # the tenant's own arena is fragmented
            else:
                victim = self._victim(None)
            if victim is None:
                return None
            self._evict(victim)

    def _evict(self, e: Entry) -> None:
        self.counters["evictions"] += 1
        if self.disk is None or e.on_disk:
            self._unlink(e)
            return
        # Spill: the value stays readable (and allocated) until it is on disk.
        name = (e.space.name, e.key)
        e.live = False
        del e.space.index[e.key]
        del self._lru[name]
        e.pins += 1
        self._spilling[name] = e
        self._lock.release()
        try:
            ok = self.disk.store(e.space.name, e.key, e.space.arena.view(e.off, e.size), e.checksum,
                                 current=lambda: not e.superseded)
        finally:
            self._lock.acquire()
        if self._spilling.get(name) is e:
            del self._spilling[name]
            self._published(e.space, e.key)
        if ok:
            self.counters["spills"] += 1
        self._unpin(e)

    def _tier_lookup(self, tier: str, found: Optional[int]) -> None:
        """Count a get's lookup in ``tier``: a hit of ``found`` bytes, or a miss (None)."""
        if found is None:
            self.counters[f"{tier}_misses"] += 1
        else:
            self.counters[f"{tier}_hits"] += 1
            self.counters[f"{tier}_hit_bytes"] += found

    def _lookup(self, ts: TenantSpace, key: str) -> Optional[Entry]:
        return ts.index.get(key) or self._spilling.get((ts.name, key))

    # -- puts ---------------------------------------------------------------------------
    def reserve(self, owner: Owner, ts: TenantSpace, keys: Sequence[str], sizes: Sequence[int],
                skip_existing: bool) -> List[int]:
        """Phase one: an arena offset per key, ``SKIPPED`` or ``NO_SPACE``."""
        out: List[int] = []
        refused = None  # the smallest size refused: larger ones need not search again
        saved: List[str] = []  # keys whose older values are superseded
        with self._lock:
            for key, size in zip(keys, sizes):
                if skip_existing:
                    e = self._lookup(ts, key)
                    if e is not None and e.size == size:
                        if e.live:
                            self._lru.move_to_end((ts.name, key))
                        self.counters["skipped"] += 1
                        out.append(SKIPPED)
                        continue
                self._supersede(ts, key)  # before allocating: its pages may serve the new value
                saved.append(key)
                n = round_to_pages(size, PAGE)
                # Each search may scan every value (all pinned) under the lock: one per size.
                off = None if refused is not None and n >= refused else self._allocate(ts, n)
                if off is None and refused is None and self._take_back_stale():
                    off = self._allocate(ts, n)
                if off is None:
                    refused = n if refused is None else min(refused, n)
                    self.counters["no_space"] += 1
                    out.append(NO_SPACE)
                    continue
                owner.reservations[(ts.name, off)] = Reservation(key, size, n)
                self.counters["reserved"] += 1
                out.append(off)
        if self.remote is not None and saved:  # network I/O: without the lock
            self.remote.retire_many(ts.name, saved)
        return out

    def _supersede(self, ts: TenantSpace, key: str) -> None:
        """A new value of ``key`` is being saved: its older value leaves the index now
        (readers holding it keep it) and the disk tier (:meth:`Tier.retire`; the caller
        retires the remote copy), so a save that then fails (no room, a checksum mismatch,
        a reservation taken back or aborted) leaves a miss, never the older value: the
        vendor's keys that fail to save are not read (seeds/003 section 8.2)."""
        old = ts.index.get(key)
        if old is not None:
            self._unlink(old)
        spilling = self._spilling.pop((ts.name, key), None)
        if spilling is not None:  # its copy must not land on disk after this
            spilling.superseded = True
            self._published(ts, key)
        if self.disk is not None:
            self.disk.retire(ts.name, key)

    def _take_back_stale(self) -> bool:
        """Free every reservation older than :attr:`reserve_timeout` (their commits then
        store nothing), looking at most once a second; whether any was freed.  Memory is
        short: a connection that reserves and never commits must not keep the others out."""
        now = time.monotonic()
        if now - self._swept < 1.0:
            return False
        self._swept = now
        freed = 0
        for owner in self._owners.values():
            stale = [(name, off) for (name, off), res in owner.reservations.items()
                     if now - res.made > self.reserve_timeout and not res.writing]
            for name, off in stale:
                res = owner.reservations.pop((name, off))
                self._free(self._spaces[name], off, res.alloc)
            freed += len(stale)
        self.counters["expired"] += freed
        if freed:
            log.warning("took back %d reservation(s) not committed within %.0f s (--reserve-timeout)",
                        freed, self.reserve_timeout)
        return freed > 0

    def writing(self, owner: Owner, ts: TenantSpace, off: int, size: int) -> bool:
        """Whether ``owner`` holds a reservation of ``size`` bytes at ``off``; if so it is
        marked as being written until :meth:`received` (its pages stay its own meanwhile)."""
        with self._lock:
            res = owner.reservations.get((ts.name, off))
            if res is None or res.size != size:
                return False
            res.writing = True
            return True

    def received(self, owner: Owner, ts: TenantSpace, off: int, crc: int) -> None:
        """Record the checksum of the bytes received for ``owner``'s reservation at ``off``
        (summed by the caller as they arrived, without the lock)."""
        with self._lock:
            res = owner.reservations.get((ts.name, off))
            if res is not None:
                res.received = crc
                res.writing = False

    def _vouched(self, ts: TenantSpace, res: Reservation, off: int, crc: Optional[int],
                 mapped: bool) -> Optional[int]:
        """The checksum a committed reservation is stored under, or None when its bytes
        cannot be trusted (freed here): the client's ``crc`` must match what the daemon
        received (over TCP); without a WRITE, the client's if it wrote the arena itself
        (``mapped``: it maps the arena; a client that does not wrote nothing, and the pages
        hold whatever they held before); without ``crc``, what was received; with neither,
        nothing vouches for them."""
        if res.received is not None and crc is not None and crc != res.received:
            self.counters["corrupt"] += 1
            log.error("value of %r arrived corrupted (checksum %#x, the client sent %#x); not stored",
                      res.key, res.received, crc)
        elif res.received is None and not mapped:
            self.counters["unwritten"] += 1
        elif crc is not None or res.received is not None:
            return crc if crc is not None else res.received
        self._free(ts, off, res.alloc)
        return None

    def commit(self, owner: Owner, ts: TenantSpace, keys: Sequence[str], offsets: Sequence[int],
               checksums: Sequence[Optional[int]], keep_local: bool = True, mapped: bool = True) -> List[bool]:
        """Phase two: publish written reservations whose checksums agree (:meth:`_vouched`;
        ``mapped``: the client maps the arena, so it may have written without a WRITE);
        returns which keys are stored.  Sums nothing: only compares under the lock."""
        stored: List[bool] = []
        pushed: List[Entry] = []
        with self._lock:
            for key, off, given in zip(keys, offsets, checksums):
                res = owner.reservations.get((ts.name, off))
                if res is None or res.key != key:
                    stored.append(False)
                    continue
                del owner.reservations[(ts.name, off)]
                crc = self._vouched(ts, res, off, given, mapped)
                if crc is None:
                    stored.append(False)
                    continue
                e = Entry(ts, key, off, res.alloc, res.size, int(crc))
                self._insert(e)
                if self.disk is not None:  # its copy there, if any, is of an older value now
                    spilling = self._spilling.get((ts.name, key))
                    if spilling is not None:  # and one being written must not land after this
                        spilling.superseded = True
                    self.disk.retire(ts.name, key)
                self.counters["committed"] += 1
                stored.append(True)
                if self.remote is not None:
                    e.pins += 1
                    pushed.append(e)
        if not pushed or self.remote is None:  # pushed is empty unless there is a remote tier
            return stored
        results = [self.remote.store(ts.name, e.key, ts.arena.view(e.off, e.size), e.checksum)
                   for e in pushed]
        with self._lock:
            for e, ok in zip(pushed, results):
                e.pins -= 1
                if ok and not keep_local:
                    self._unlink(e)
                else:
                    self._maybe_free(e)
        return stored

    def abort(self, owner: Owner, ts: TenantSpace, offsets: Sequence[int]) -> None:
        with self._lock:
            for off in offsets:
                res = owner.reservations.pop((ts.name, off), None)
                if res is not None:
                    self._free(ts, off, res.alloc)

    # -- gets ---------------------------------------------------------------------------
    def get(self, owner: Owner, ts: TenantSpace, keys: Sequence[str],
            local_only: bool) -> Tuple[int, List[Entry]]:
        """Pin the leading present keys (filling from the tiers); a lease id and entries."""
        pinned: List[Entry] = []
        for key in keys:
            with self._lock:
                e = self._lookup(ts, key)
                self._tier_lookup("memory", e.size if e is not None else None)
                if e is not None:
                    e.pins += 1
                    if e.live:
                        self._lru.move_to_end((ts.name, key))
                    pinned.append(e)
                    continue
            e = self._fill(ts, key, local_only)
            if e is None:
                break
            pinned.append(e)
        with self._lock:
            self.counters["gets"] += 1
            self.counters["hits"] += len(pinned)
            self.counters["misses"] += len(keys) - len(pinned)
            self._next_lease += 1
            lease = self._next_lease
            owner.leases[lease] = pinned
        return lease, pinned

    def _fill(self, ts: TenantSpace, key: str, local_only: bool) -> Optional[Entry]:
        """Bring ``key`` into memory from disk, then remote; pinned entry or None."""
        tiers = [t for t in (self.disk, None if local_only else self.remote) if t is not None]
        for tier in tiers:
            got: Dict[str, int] = {}

            def sink(size: int) -> Optional[memoryview]:
                n = round_to_pages(size, PAGE)
                with self._lock:
                    off = self._allocate(ts, n)
                if off is None:
                    return None
                got.update(off=off, n=n, size=size)
                return ts.arena.view(off, size)

            crc = tier.load(ts.name, key, sink)
            if "off" not in got:
                with self._lock:
                    self._tier_lookup(tier.name, None)
                continue
            off, n, size = got["off"], got["n"], got["size"]
            if crc is None or checksum(ts.arena.view(off, size)) != crc:
                with self._lock:
                    self._free(ts, off, n)
                    self.counters["corrupt"] += crc is not None
                    self._tier_lookup(tier.name, None)
                if crc is not None:
                    log.warning("%s tier: value of %r failed its checksum; dropped", tier.name, key)
                    tier.discard(ts.name, key)
                continue
            with self._lock:
                current = self._lookup(ts, key)
                if current is not None:  # someone committed it meanwhile: theirs is newer
                    self._free(ts, off, n)
                    e = current
                else:
                    e = Entry(ts, key, off, n, size, crc, on_disk=tier is self.disk)
                    self._insert(e)
                    self.counters["disk_fills" if tier is self.disk else "remote_fills"] += 1
                self._tier_lookup(tier.name, size)
                e.pins += 1
            return e
        return None

    def release(self, owner: Owner, lease: int) -> None:
        with self._lock:
            for e in owner.leases.pop(lease, ()):
                self._unpin(e)

    def leased(self, owner: Owner, ts: TenantSpace, off: int, size: int) -> bool:
        """Whether ``owner`` holds a lease covering ``[off, off + size)`` of ``ts``."""
        with self._lock:
            return any(e.space is ts and e.off == off and e.size == size
                       for entries in owner.leases.values() for e in entries)

    def drop(self, ts: TenantSpace, keys: Sequence[str], offsets: Sequence[int]) -> None:
        """A reader found these values corrupted: forget them (if still the same value)."""
        with self._lock:
            for key, off in zip(keys, offsets):
                e = ts.index.get(key)
                if e is not None and e.off == off:
                    self.counters["corrupt"] += 1
                    log.warning("value of %r failed its checksum at a reader; dropped", key)
                    self._unlink(e)

    def exists(self, ts: TenantSpace, keys: Sequence[str], local_only: bool) -> int:
        """How many leading keys some tier holds."""
        index, spilling, name = ts.index, self._spilling, ts.name
        with self._lock:
            self.counters["exists_calls"] += 1
            if all(map(index.__contains__, keys)):  # all in memory: one C loop
                return len(keys)
            present = [k in index or (name, k) in spilling for k in keys]
        hits = 0
        while hits < len(keys) and present[hits]:
            hits += 1
        for tier in (self.disk, None if local_only else self.remote):
            if tier is None or hits == len(keys):
                continue
            flags = tier.exists(ts.name, keys[hits:])
            for i, flag in enumerate(flags):
                present[hits + i] = present[hits + i] or flag
            while hits < len(keys) and present[hits]:
                hits += 1
        return hits

    # -- lifecycle ----------------------------------------------------------------------
    def stats(self) -> Dict[str, Any]:
        with self._lock:
            out: Dict[str, Any] = {
                "capacity": self.capacity, "used": self.used,
                "values": sum(len(ts.index) for ts in self._spaces.values()),
                "tenants": {ts.name or "(open)": {"values": len(ts.index),
                                                  "bytes": sum(e.size for e in ts.index.values()),
                                                  "published_keys": ts.keys.stats()["keys"]}
                            for ts in self._spaces.values()},
                "pinned": sum(1 for e in self._lru.values() if e.pins),
                **self.counters,
            }
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        if self.remote is not None:
            out["remote"] = self.remote.stats()
        return out

    def close(self, spill: bool = True) -> None:
        """Spill what memory holds to disk (most recently used first), then free it all."""
        with self._lock:
            entries = [e for e in reversed(self._lru.values()) if not e.on_disk]
            spaces = list(self._spaces.values())
            self._spaces = {}
            self._lru.clear()
        if spill and self.disk is not None:
            t0 = time.monotonic()
            n = 0
            for e in entries:
                if self.disk.store(e.space.name, e.key, e.space.arena.view(e.off, e.size), e.checksum):
                    n += 1
            log.info("spilled %d values to disk in %.2fs", n, time.monotonic() - t0)
        for ts in spaces:
            ts.close()
        for tier in (self.disk, self.remote):
            if tier is not None:
                tier.close()
