"""The engine behind one ``LLMDataDist``: pools, registry, agent and links.

``Engine`` owns every resource of an initialized ``LLMDataDist`` and releases all of them
in ``close()``: the agent thread, sockets, peer mappings, the epoch page and the pool
arenas (memfd, so nothing is left in ``/dev/shm`` even if the process is killed).

Links are opened by :class:`~.linking.Linker` (both ends of the handshake); the engine
keeps them by peer, hands them to the API layer and drops them.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Hashable, Optional, Sequence, TypeVar, Union

from . import cuda, exporter, fences, npu, wire
from .agent import Agent
from .errors import Fault, fail
from .link import Link
from .linking import Linker
from .transports.collective import COLLECTIVE_BACKENDS
from .memory import Arena, PoolAllocator
from .metrics import EngineMetrics
from .notes import NoteBox
from .options import EngineSettings
from .registry import Registry

__all__ = ["Engine", "host_identity", "resolve_device", "npu_visible", "npu_probe"]

log = logging.getLogger("datadist")

MAX_LINK_CLUSTERS = 16
#: Threads that link or unlink the clusters of one list at once (CANN's pool for it has 16).
MAX_AT_ONCE = 16
_T = TypeVar("_T")


def npu_probe() -> tuple[bool, Optional[str]]:
    """``(sees, problem)``: whether torch_npu is installed and sees an NPU, and why not
    where it is installed but unusable (its import or device query failed; None
    otherwise).  torch_npu is imported only where installed."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, None
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as exc:  # a broken install: reported, never taken for "no NPU" in silence
        return False, f"torch_npu is installed but its import failed: {type(exc).__name__}: {exc}"
    try:
        # torch.npu exists once torch_npu is imported; torch's stubs do not know it.
        return bool(torch.npu.is_available() and torch.npu.device_count() > 0), None  # type: ignore[attr-defined]
    except Exception as exc:
        return False, f"torch_npu cannot query its devices: {type(exc).__name__}: {exc}"


def npu_visible() -> bool:
    """Whether torch_npu is installed and sees an NPU (imported only where installed)."""
    return npu_probe()[0]


_warned: set[str] = set()


def resolve_device(device_type: str, device_id: int) -> str:
    """Where ``Placement.DEVICE`` caches of an engine live: ``"npu:<device_id>"``,
    ``"cuda:<device_id>"`` or ``"cpu"`` (host memory, only where asked for).  ``auto``
    picks the NPU when torch_npu sees one, else CUDA when torch sees a device, else the CPU.
    A device that cannot be used is an error, never host memory in disguise: ``npu``
    without torch_npu, with a torch_npu that fails to import (its error) or without a
    device it sees, ``cuda`` without a GPU, raise ``LLM_FEATURE_NOT_ENABLED`` naming what
    to do; ``auto`` with a torch_npu that fails to import warns with its error (once)."""
    sees, problem = npu_probe() if device_type in ("npu", "auto") else (False, None)
    if problem is not None and device_type == "auto" and problem not in _warned:
        _warned.add(problem)
        log.warning("device_type 'auto' looks past the NPU: %s", problem)
    if device_type == "npu" or (device_type == "auto" and sees):
        return _npu_device(device_id, sees, problem)
    if device_type == "cuda" or (device_type == "auto" and cuda.driver_present()):
        if cuda.available():
            return f"cuda:{device_id}"
        if device_type == "cuda":
            fail(Fault.FEATURE_NOT_ENABLED,
                        "device_type = 'cuda', but torch sees no CUDA device here (CPU-only torch, no driver, "
                        "or CUDA_VISIBLE_DEVICES empty); use device_type 'cpu' or 'auto'")
    return "cpu"


def _npu_device(device_id: int, sees: bool, problem: Optional[str]) -> str:
    """``npu:<device_id>``, or the error saying why an NPU cannot be used here."""
    if importlib.util.find_spec("torch_npu") is None:
        fail(Fault.FEATURE_NOT_ENABLED,
             "device_type = 'npu' needs torch_npu (Ascend's PyTorch adapter), which is not installed; "
             "install the torch_npu build matching your torch, or set device_type 'cpu' to keep "
             "Placement.DEVICE caches in host memory")
    if problem is not None:
        fail(Fault.FEATURE_NOT_ENABLED, f"device_type = 'npu', but {problem}")
    if not sees:
        fail(Fault.FEATURE_NOT_ENABLED,
             "device_type = 'npu', but torch_npu sees no NPU here (driver, ASCEND_RT_VISIBLE_DEVICES); "
             "use device_type 'cpu' to keep Placement.DEVICE caches in host memory")
    return f"npu:{device_id}"


def host_identity() -> str:
    """Identifies this host (and boot): same-host peers compare it before mapping memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


class Engine:
    def __init__(self, cluster_id: int, role: int, options: EngineSettings) -> None:
        self.cluster_id = cluster_id
        self.role = role
        self.options = options
        self.timeout_ms = options.sync_kv_timeout_ms
        self.backend = options.transfer_backend
        self.host = host_identity()
        self.pid = os.getpid()
        #: Links by (peer cluster id, whether this end initiated it).  Two peers may link to
        #: each other at once (both listening, as CANN's hixl backend allows): each end then
        #: holds the link it made and the one it accepted, and unlinks its own first.
        self.links: dict[tuple[int, bool], Link] = {}
        self.links_lock = threading.Lock()
        self._links_changed = threading.Condition(self.links_lock)
        self.pools: dict[str, PoolAllocator] = {}
        self.arenas: list[Arena] = []
        self.pinned: list[Arena] = []
        self.device_arena: Optional[Union[cuda.DeviceArena, npu.NpuArena]] = None
        self.exposure: Optional[exporter.Exposure] = None
        self.registry: Optional[Registry] = None
        self.agent: Optional[Agent] = None
        self.notes = NoteBox()
        #: What the engine counted (:mod:`.metrics`); :meth:`metrics` reads it with the gauges.
        self.metrics = EngineMetrics(cluster_id)
        self.linker = Linker(self)
        #: Where Placement.DEVICE caches live: "cpu" (host memory), "cuda:N" or "npu:N".
        self.device = resolve_device(options.device_type, options.device_id)
        if self.backend in COLLECTIVE_BACKENDS or self.device.startswith("npu"):
            # Its links may form process groups: the first import of torch.distributed takes
            # seconds on a loaded host, paid here rather than inside a link's timeout.
            import torch.distributed  # noqa: F401
        try:
            gpu = cuda.device(options.device_id) if self.device.startswith("cuda") else None
            for name, cfg in (("host", options.host_mem_pool), ("device", options.mem_pool)):
                if cfg is None:
                    continue
                if name == "device" and self.device != "cpu":
                    self.device_arena = (cuda.DeviceArena(gpu, cfg.memory_size) if gpu is not None else
                                         npu.NpuArena(self.device, cfg.memory_size))
                    self.pools[name] = PoolAllocator(self.device_arena, cfg.page_shift)
                    continue
                arena = Arena(f"datadist-{cluster_id}-{name}", cfg.memory_size)
                self.arenas.append(arena)
                self.pools[name] = PoolAllocator(arena, cfg.page_shift)
                if gpu is not None and cuda.pin(arena.base, arena.size):
                    self.pinned.append(arena)  # host <-> device copies of its caches run at DMA speed
            self.registry = Registry(cluster_id, secrets.randbits(63))
            self.agent = Agent(self, self.linker, options.listen_address)
            self.exposure = self._expose(options.metrics_address)
        except BaseException:
            self.close()
            raise

    def live_registry(self) -> Registry:
        """The registry of this engine; ``close`` has dropped it from a closed one."""
        registry = self.registry
        if registry is None:
            fail(Fault.FAILED, f"engine of cluster {self.cluster_id} is closed")
        return registry

    def live_agent(self) -> Agent:
        """The agent of this engine; ``close`` has stopped and dropped it from a closed one."""
        agent = self.agent
        if agent is None:
            fail(Fault.FAILED, f"engine of cluster {self.cluster_id} is closed")
        return agent

    def find_link(self, cluster_id: int) -> Optional[Link]:
        """The link to ``cluster_id``: the one this end made if any, else the accepted one."""
        with self.links_lock:
            return self.links.get((cluster_id, True)) or self.links.get((cluster_id, False))

    def held(self, cluster_id: int, initiated: bool) -> Optional[Link]:
        """The link to ``cluster_id`` that this end made (``initiated``) or accepted, if any."""
        with self.links_lock:
            return self.links.get((cluster_id, initiated))

    def linked_clusters(self) -> list[int]:
        with self.links_lock:
            return sorted({cluster for cluster, _ in self.links})

    @property
    def listen_port(self) -> Optional[int]:
        ls = self.agent.listener if self.agent is not None else None
        return ls.getsockname()[1] if ls is not None else None

    def link_broken(self, cluster_id: int, reason: str) -> None:
        if self.registry is not None:
            self.registry.source_lost(cluster_id, reason)

    def install(self, link: Link) -> None:
        """Keep ``link`` (replacing and closing the one held for its peer and end) and have
        the agent watch its ``serve_sock``."""
        self.live_registry().source_linked(link.remote_cluster_id)
        self.metrics.installed(link.remote_cluster_id, link.is_client)
        key = (link.remote_cluster_id, link.is_client)
        with self.links_lock:
            old = self.links.pop(key, None)
            self.links[key] = link
            self._links_changed.notify_all()
        agent = self.live_agent()
        if old is not None:
            agent.unwatch(old)
            old.close()
        agent.watch(link)

    def watch(self, link: Link, watched: bool) -> None:
        """Have the agent serve ``link``'s requests from now on, or stop serving them (they
        wait unread); any thread."""
        agent = self.live_agent()
        if watched:
            agent.watch(link)
        else:
            agent.unwatch(link)

    def link(self, remote_cluster_id: int, ip: str, port: int, deadline: float) -> Fault:
        """Link to the engine listening at ``ip:port`` (:meth:`.linking.Linker.link`)."""
        fault = self.linker.link(remote_cluster_id, ip, port, deadline)
        self.metrics.link_attempt(int(fault))
        return fault

    def at_once(self, work: Callable[[_T], Fault], keys: Sequence[Hashable], items: Sequence[_T]) -> list[Fault]:
        """``work(item)`` for every item, the faults in the items' order.  Items of distinct
        ``keys`` run at once, each on a thread of its own with this engine's device current
        (at most :data:`MAX_AT_ONCE` at a time), as CANN's ``link_clusters`` and
        ``unlink_clusters`` treat a list: a process group that takes seconds to form (HCCL)
        does not spend the next cluster's time.  An item whose key came before runs after
        all of those, in order, so it sees what the first did (a second link to one
        cluster is ``ALREADY_LINKED``, as when the list ran one by one).  One item runs on
        the caller's thread."""
        first: dict[Hashable, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        lead = list(first.values())  # ascending: each key's first item
        done: dict[int, Fault] = {}
        if len(lead) == 1:
            done[lead[0]] = work(items[lead[0]])
        elif lead:
            with ThreadPoolExecutor(min(len(lead), MAX_AT_ONCE), thread_name_prefix="datadist-link",
                                    initializer=npu.set_device, initargs=(self.device,)) as pool:
                done.update(zip(lead, pool.map(lambda i: work(items[i]), lead)))
        return [done[i] if i in done else work(item) for i, item in enumerate(items)]

    def wait_link(self, cluster_id: int, deadline: float, cancel: threading.Event) -> bool:
        """Wait until ``cluster_id`` has linked to this engine and its link is ready;
        False at the deadline or once ``cancel`` is set."""
        while not cancel.is_set():
            with self.links_lock:
                link = self.links.get((cluster_id, True)) or self.links.get((cluster_id, False))
                if link is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._links_changed.wait(min(left, 0.5))  # wakes early when a link installs
                    continue
            left = deadline - time.monotonic()
            if link.wait_opened(max(0.0, min(left, 0.5))) and link.broken is None:
                return True
            if left <= 0:
                return False
        return False

    def get_link(self, cluster_id: int) -> Link:
        """The link to ``cluster_id`` ready for transfers; ``LLM_NOT_YET_LINK`` otherwise.
        A link the peer made that is still forming its process group (its client may
        return from ``link_clusters`` a moment before this end has joined) is waited for,
        at most ``sync_kv_timeout``."""
        link = self.find_link(cluster_id)
        if link is not None and not link.ever_opened and link.store is not None:
            link.wait_opened(self.timeout_ms / 1000.0)
        if link is None or not link.ever_opened:
            fail(Fault.NOT_LINKED,
                        f"cluster {cluster_id} is not linked with cluster {self.cluster_id}; call link_clusters first")
        return link

    def unlink(self, cluster_id: int, deadline: float, force: bool) -> Fault:
        link = self.find_link(cluster_id)
        if link is None:
            return Fault.NOT_LINKED
        # A transfer in flight makes the link busy.  A link being retired (its peer just went
        # away: the agent holds the lock for a moment) is not busy: wait for that moment.
        if not (link.turns.acquire(blocking=False)
                or (link.broken is not None and link.turns.acquire(timeout=max(0.0, deadline - time.monotonic())))):
            return Fault.LINK_BUSY
        link.mark_closing()
        try:
            if not force and link.broken is None:
                try:
                    link.rpc(wire.Unlink(cluster_id=self.cluster_id), deadline)
                except Exception as exc:  # the peer may be gone; the local end goes anyway
                    log.warning("unlink of cluster %d: peer did not confirm (%s)", cluster_id, exc)
        finally:
            # Transfers queued behind the unlink fail fast instead of moving into a peer
            # that has let go of this link.
            link.mark_closing("the link was unlinked")
            link.turns.release()
        self.drop_link(link, notify=False)
        return Fault.OK

    def give_back(self, nbytes: int, release: Optional[Callable[[], None]]) -> None:
        """Memory the registry forgot (its epoch moved) goes back through ``release`` (None:
        registered memory, only waited for) once no peer copies into or out of it
        (:mod:`.fences`); at most ``2 * sync_kv_timeout`` is waited for that, then it goes
        back when the copies end.  On the agent thread (a user callback) the wait runs on
        a thread of its own: the peers' answers may need this agent."""
        registry = self.live_registry()
        with self.links_lock:
            links = list(self.links.values())
        work = functools.partial(fences.free_after_peers, links, registry.inflight, registry.epoch, nbytes, release,
                                 2 * self.timeout_ms)
        if self.live_agent().on_thread():
            threading.Thread(target=work, name="datadist-free", daemon=True).start()
        else:
            work()

    def drop_link(self, link: Link, notify: bool) -> None:
        """Forget ``link`` and close it (any thread; the agent calls it on UNLINK)."""
        key = (link.remote_cluster_id, link.is_client)
        with self.links_lock:
            if self.links.get(key) is link:
                del self.links[key]
            others = (link.remote_cluster_id, not link.is_client) in self.links
        link.mark_closing("the link was unlinked")  # a prepared transfer holding it fails from now on
        if not others:
            self.link_broken(link.remote_cluster_id, "the link was unlinked")  # no more pushes from there
        agent = self.live_agent()
        agent.unwatch(link)
        # Closing must wait until the agent has unregistered the socket.
        agent.call(link.close)

    # -- metrics -------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What the engine counted, with its gauges now: links up, pool memory and the
        agent's backlog (the dict ``LLMDataDist.metrics()`` returns)."""
        with self.links_lock:
            up = sum(1 for link in self.links.values() if link.up)
        pools = {name: {"size_bytes": pool.size_bytes, "free_bytes": pool.free_bytes,
                        "used_bytes": pool.size_bytes - pool.free_bytes} for name, pool in self.pools.items()}
        agent = self.agent
        backlog = agent.backlog() if agent is not None else \
            {"pending_calls": 0, "pending_handshakes": 0, "handed_off": 0}
        return self.metrics.snapshot({"links": {"up": up}, "pools": pools, "agent": backlog})

    def _expose(self, address: Optional[tuple[str, int]]) -> Optional[exporter.Exposure]:
        """Serve the engine's metrics on ``address`` (:mod:`.exporter`); None: not asked."""
        if address is None:
            return None
        try:
            exposure = exporter.serve_engine(id(self), self.snapshot, *address)
        except exporter.MissingPackage as exc:
            fail(Fault.FEATURE_NOT_ENABLED, f"the metrics endpoint ({address[0]}:{address[1]}): {exc}")
        except OSError as exc:
            fail(Fault.FAILED, f"the metrics endpoint cannot listen on {address[0]}:{address[1]}: {exc}")
        log.info("metrics of cluster %d at http://%s:%d/metrics", self.cluster_id, *exposure.address)
        return exposure

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Release everything; idempotent, safe to call on a half-built engine."""
        if self.exposure is not None:
            self.exposure.close()
            self.exposure = None
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
        with self.links_lock:
            links, self.links = list(self.links.values()), {}
        for link in links:
            link.close(goodbye=True)
        if self.registry is not None:
            self.registry.close()
            self.registry = None
        for arena in self.pinned:
            cuda.unpin(arena.base)
        self.pinned = []
        for arena in self.arenas:
            arena.close()
        self.arenas = []
        if self.device_arena is not None:
            self.device_arena.close()
            self.device_arena = None
        self.pools = {}
