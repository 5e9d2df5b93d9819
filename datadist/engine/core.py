"""The engine behind one ``LLMDataDist``: pools, registry, agent and links.

``Engine`` owns every resource of an initialized ``LLMDataDist`` and releases all of them
in ``close()``: the agent thread, sockets, peer mappings, the epoch page and the pool
arenas (memfd, so nothing is left in ``/dev/shm`` even if the process is killed).

Linking (client side, ``link``): connect to the server's listen address, ``HELLO`` (this
engine's pid, host, epoch page and pool arenas), read ``HELLO_ACK``, then open the second
connection with ``ATTACH``.  Each side then picks its transport towards the other on its
own: ``shm`` if the peer is on this host and its arenas map here (the nonce in its epoch
page proves it is the very process that answered), else ``tcp``; a forced ``shm`` that
cannot map fails the link.
"""
from __future__ import annotations

import hmac
import importlib.util
import logging
import os
import secrets
import socket
import threading
import time
from typing import Optional, Union

from .options import EngineSettings
from .errors import EngineError, Fault, fail
from .transports.collective import COLLECTIVE_BACKENDS, CollectiveTransport, make_group
from .transports.shm import ShmTransport
from .transports.tcp import TcpTransport
from . import cuda, native, npu, wire
from .agent import Agent
from .handshake import ClientAuth
from .layout import Plan
from .link import Link
from .memory import Arena, PeerArena, PoolAllocator
from .notes import NoteBox
from .registry import EPOCH_PAGE_SIZE, Registry

__all__ = ["Engine", "host_identity", "resolve_device", "npu_visible"]

log = logging.getLogger("datadist")

MAX_LINK_CLUSTERS = 16


def _seconds(s: float):
    import datetime

    return datetime.timedelta(seconds=s)


def npu_visible() -> bool:
    """Whether torch_npu is installed and sees an NPU (imported only where installed)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        return bool(torch.npu.is_available() and torch.npu.device_count() > 0)
    except Exception:  # a broken install sees no device
        return False


def resolve_device(device_type: str, device_id: int) -> str:
    """Where ``Placement.DEVICE`` caches of an engine live: ``"npu:<device_id>"``,
    ``"cuda:<device_id>"`` or ``"cpu"`` (host memory, only where asked for).  ``auto``
    picks the NPU when torch_npu sees one, else CUDA when torch sees a device, else the CPU.
    A device that cannot be used is an error, never host memory in disguise: ``npu``
    without torch_npu or without a device it sees, ``cuda`` without a GPU, raise
    ``LLM_FEATURE_NOT_ENABLED`` naming what to do."""
    if device_type == "npu" or (device_type == "auto" and npu_visible()):
        if importlib.util.find_spec("torch_npu") is None:
            fail(Fault.FEATURE_NOT_ENABLED,
                        "device_type = 'npu' needs torch_npu (Ascend's PyTorch adapter), which is not installed; "
                        "install the torch_npu build matching your torch, or set device_type 'cpu' to keep "
                        "Placement.DEVICE caches in host memory")
        if not npu_visible():
            fail(Fault.FEATURE_NOT_ENABLED,
                        "device_type = 'npu', but torch_npu sees no NPU here (driver, ASCEND_RT_VISIBLE_DEVICES); "
                        "use device_type 'cpu' to keep Placement.DEVICE caches in host memory")
        return f"npu:{device_id}"
    if device_type == "cuda" or (device_type == "auto" and cuda.driver_present()):
        if cuda.available():
            return f"cuda:{device_id}"
        if device_type == "cuda":
            fail(Fault.FEATURE_NOT_ENABLED,
                        "device_type = 'cuda', but torch sees no CUDA device here (CPU-only torch, no driver, "
                        "or CUDA_VISIBLE_DEVICES empty); use device_type 'cpu' or 'auto'")
    return "cpu"


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
        self._links_lock = threading.Lock()
        self._links_changed = threading.Condition(self._links_lock)
        self.pools: dict[str, PoolAllocator] = {}
        self.arenas: list[Arena] = []
        self.pinned: list[Arena] = []
        self.device_arena: Optional[Union[cuda.DeviceArena, npu.NpuArena]] = None
        self.registry: Optional[Registry] = None
        self.agent: Optional[Agent] = None
        self.notes = NoteBox()
        #: Where Placement.DEVICE caches live: "cpu" (host memory), "cuda:N" or "npu:N".
        self.device = resolve_device(options.device_type, options.device_id)
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
            self.agent = Agent(self, options.listen_address)
        except BaseException:
            self.close()
            raise

    def find_link(self, cluster_id: int) -> Optional[Link]:
        """The link to ``cluster_id``: the one this end made if any, else the accepted one."""
        with self._links_lock:
            return self.links.get((cluster_id, True)) or self.links.get((cluster_id, False))

    def linked_clusters(self) -> list[int]:
        with self._links_lock:
            return sorted({cluster for cluster, _ in self.links})

    @property
    def listen_port(self) -> Optional[int]:
        ls = self.agent.listener if self.agent is not None else None
        return ls.getsockname()[1] if ls is not None else None

    # -- hello ---------------------------------------------------------------------------
    def _hello_fields(self) -> dict:
        page = self.registry.page
        return dict(cluster_id=self.cluster_id, role=int(self.role), host=self.host, pid=self.pid,
                    ctrl={"fd": page.fd, "size": page.size, "base": page.base, "nonce": self.registry.nonce},
                    arenas=[{"fd": a.fd, "size": a.size, "base": a.base} for a in self.arenas],
                    device_regions=[r.to_wire() for r in self.device_arena.regions] if self.device_arena else [],
                    backend=self.backend)

    def _make_transport(self, peer: wire.Hello, link: Link) -> None:
        """Pick and set up the transport towards ``peer`` (see the module docstring).
        Collective links get theirs once the process group exists (``_join_group``)."""
        tcp = TcpTransport()
        collective = {self.backend, peer.backend} & set(COLLECTIVE_BACKENDS)
        if collective:
            if self.backend != peer.backend:
                fail(Fault.LINK_FAILED,
                            f"transfer_backend {self.backend!r} here, {peer.backend!r} on cluster {peer.cluster_id}: "
                            "collective links need the same backend on both ends")
            return
        if self.backend == "tcp" or peer.backend == "tcp":
            link.transport = tcp
            return
        mapped: list[PeerArena] = []
        try:
            if peer.host != self.host:
                raise OSError(f"peer is on another host ({peer.host})")
            ctrl = PeerArena.open(peer.pid, peer.ctrl["fd"], EPOCH_PAGE_SIZE, peer.ctrl["base"])
            mapped.append(ctrl)
            if Registry.read_epoch(Registry.nonce_address(ctrl.local_base)) != peer.ctrl["nonce"]:
                raise OSError("mapped epoch page belongs to another process (pid namespaces differ?)")
            for a in peer.arenas:
                mapped.append(PeerArena.open(peer.pid, a["fd"], a["size"], a["base"]))
        except OSError as exc:
            for m in mapped:
                m.close()
            if self.backend == "shm":
                fail(Fault.LINK_FAILED,
                            f"transfer_backend='shm' but cluster {peer.cluster_id}'s memory cannot be mapped: {exc}")
            log.info("link to cluster %d uses tcp: %s", peer.cluster_id, exc)
            link.transport = tcp
            return
        link.peer_epoch_addr = mapped[0].local_base
        link.transport = ShmTransport(peer.pid, mapped, self._probe_cma(peer), fallback=tcp,
                                      device_pool=[cuda.IpcRegion.from_wire(r) for r in peer.device_regions],
                                      cuda_here=self.device.startswith("cuda"))
        log.info("link to cluster %d uses shm (cross-memory attach %s)", peer.cluster_id,
                 "on" if link.transport.cma_ok else "off")

    @staticmethod
    def _probe_cma(peer: wire.Hello) -> bool:
        import numpy as np

        got = np.zeros(1, dtype=np.uint64)
        plan = Plan(np.zeros(1, np.uint64), np.zeros(1, np.uint64),
                    np.array([Registry.nonce_address(peer.ctrl["base"])], np.uint64),
                    np.array([got.__array_interface__["data"][0]], np.uint64), np.array([8], np.uint64))
        try:
            native.cma_plan(peer.pid, plan, write=False)
        except OSError as exc:
            log.info("cross-memory attach to pid %d not permitted (%s); registered caches go over tcp", peer.pid, exc)
            return False
        return int(got[0]) == peer.ctrl["nonce"]

    # -- server side (agent thread) ------------------------------------------------------
    def accept_hello(self, msg: wire.Hello, sock: socket.socket) -> wire.HelloAck:
        # A refusal names nothing of this engine (no cluster id, pid, host, memory or
        # handles): only an accepted peer learns those.
        if msg.remote_cluster_id != self.cluster_id:
            return wire.HelloAck(status=int(Fault.LINK_FAILED),
                                 message=f"no cluster {msg.remote_cluster_id} at this address")
        with self._links_lock:
            old = self.links.get((msg.cluster_id, False))
            if old is not None and old.broken is None:
                return wire.HelloAck(status=int(Fault.ALREADY_LINKED),
                                     message=f"cluster {msg.cluster_id} is already linked here")
        fields = self._hello_fields()
        link = Link(remote_cluster_id=msg.cluster_id, remote_role=msg.role, peer_pid=msg.pid,
                    timeout_ms=self.timeout_ms, is_client=False, local_cluster_id=self.cluster_id,
                    on_broken=self._link_broken)
        try:
            self._make_transport(msg, link)
        except Exception as exc:  # reported to the peer, which raises it there
            link.close()
            return wire.HelloAck(status=int(exc.fault if isinstance(exc, EngineError) else Fault.LINK_FAILED),
                                 message=str(exc) if isinstance(exc, EngineError) else
                                 f"the link could not be set up ({type(exc).__name__})")
        store_port = 0
        if self.backend in COLLECTIVE_BACKENDS:
            import torch.distributed as dist

            ip = self.options.listen_ip or "127.0.0.1"
            link.store = dist.TCPStore(ip, 0, 2, True, timeout=_seconds(self.options.link_total_time_s),
                                       wait_for_workers=False)
            store_port = link.store.port
        link.serve_sock = sock
        link.attach_token = secrets.token_hex(16)
        self._install(link)
        self.agent.watch(link)
        return wire.HelloAck(path=self.backend if store_port else link.path, store_port=store_port,
                             attach_token=link.attach_token, **fields)

    def accept_attach(self, msg: wire.Attach, sock: socket.socket) -> wire.Reply:
        with self._links_lock:
            link = self.links.get((msg.cluster_id, False))
        # Only the peer that just linked knows the token: nobody else can take over the
        # request connection of a link that is opening.
        if link is None or link.req_sock is not None or not hmac.compare_digest(link.attach_token, msg.token):
            return wire.Reply(status=int(Fault.LINK_FAILED), message="no pending link to attach to")
        link.req_sock = sock
        if link.store is None:
            link.ready.set()
        return wire.Reply()

    def after_attach(self, link: Link) -> None:
        """Server side, after the ATTACH reply went out: join the link's process group
        (the client joins as soon as it reads that reply)."""
        if link.store is not None and link.transport is None:
            try:
                self._join_group(link, link.store, rank=0)
            except Exception as exc:  # the client sees the failure as a link failure
                log.warning("process group with cluster %d failed: %s", link.remote_cluster_id, exc)
                link.retire(f"process group setup failed: {exc}")
                return
            link.ready.set()

    def _join_group(self, link: Link, store, rank: int) -> None:
        import torch.distributed as dist

        prefix = dist.PrefixStore(f"datadist-link-{min(self.cluster_id, link.remote_cluster_id)}-"
                                  f"{max(self.cluster_id, link.remote_cluster_id)}", store)
        group = make_group(self.backend, prefix, rank, self.timeout_ms / 1000.0)
        link.transport = CollectiveTransport(self.backend, group, 1 - rank, store, device=self.device)
        log.info("link to cluster %d uses %s (rank %d)", link.remote_cluster_id, self.backend, rank)

    def _link_broken(self, cluster_id: int, reason: str) -> None:
        if self.registry is not None:
            self.registry.source_lost(cluster_id, reason)

    def _install(self, link: Link) -> None:
        self.registry.source_linked(link.remote_cluster_id)
        key = (link.remote_cluster_id, link.is_client)
        with self._links_lock:
            old = self.links.pop(key, None)
            self.links[key] = link
            self._links_changed.notify_all()
        if old is not None:
            self.agent.unwatch(old)
            old.close()

    # -- client side ---------------------------------------------------------------------
    def link(self, remote_cluster_id: int, ip: str, port: int, deadline: float) -> Fault:
        """Link to the server at ``ip:port``; returns the per-cluster status."""
        with self._links_lock:
            old = self.links.get((remote_cluster_id, True))
        if old is not None and old.broken is None:
            return Fault.ALREADY_LINKED
        socks: list[socket.socket] = []
        link: Optional[Link] = None
        try:
            hello_sock = self._connect_retrying(ip, port, deadline)
            socks.append(hello_sock)
            hello = wire.Hello(remote_cluster_id=remote_cluster_id, **self._hello_fields())
            if self.options.link_secret is not None:
                if not self._authenticate(hello_sock, hello, remote_cluster_id):
                    log.warning("link to cluster %d at %s:%d refused: the peer did not prove it holds the link "
                                "secret (or refused ours)", remote_cluster_id, ip, port)
                    for s in socks:
                        s.close()
                    return Fault.LINK_FAILED
            hello_sock.sendall(wire.encode(hello))
            ack = wire.read_message(hello_sock)
            if not isinstance(ack, wire.HelloAck):
                raise wire.WireError(f"expected HELLO_ACK, got {type(ack).__name__}")
            if ack.status:
                log.warning("link to cluster %d at %s:%d refused: %s", remote_cluster_id, ip, port, ack.message)
                return Fault.of(ack.status)
            link = Link(remote_cluster_id=remote_cluster_id, remote_role=ack.role, peer_pid=ack.pid,
                        timeout_ms=self.timeout_ms, is_client=True, local_cluster_id=self.cluster_id,
                        on_broken=self._link_broken)
            self._make_transport(ack, link)
            attach_sock = self._connect(ip, port, deadline)
            socks.append(attach_sock)
            attach_sock.sendall(wire.encode(wire.Attach(cluster_id=self.cluster_id, token=ack.attach_token)))
            reply = wire.read_message(attach_sock)
            if not isinstance(reply, wire.Reply) or reply.status:
                raise wire.WireError(getattr(reply, "message", "attach refused"))
            if ack.store_port:
                import torch.distributed as dist

                store = dist.TCPStore(ip, ack.store_port, 2, False,
                                      timeout=_seconds(max(0.001, deadline - time.monotonic())))
                self._join_group(link, store, rank=1)
        except (OSError, RuntimeError, wire.WireError) as exc:  # RuntimeError: torch.distributed
            log.warning("link to cluster %d at %s:%d failed: %s", remote_cluster_id, ip, port, exc)
            for s in socks:
                s.close()
            if link is not None:
                link.close()
            return Fault.LINK_FAILED
        except Exception:
            for s in socks:
                s.close()
            if link is not None:
                link.close()
            raise
        link.req_sock, link.serve_sock = hello_sock, attach_sock
        link.ready.set()
        self._install(link)
        self.agent.watch(link)
        log.info("linked to cluster %d at %s:%d over %s", remote_cluster_id, ip, port, link.path)
        return Fault.OK

    def _authenticate(self, sock: socket.socket, hello: wire.Hello, remote_cluster_id: int) -> bool:
        """The client's half of an authenticated opening (:mod:`datadist.engine.handshake`):
        on success ``hello`` carries the nonce and proof and may be sent; nothing of this
        engine's memory has been sent before."""
        state = ClientAuth(self.options.link_secret, str(self.cluster_id).encode(), str(remote_cluster_id).encode())
        sock.sendall(wire.encode(wire.Hello(cluster_id=self.cluster_id, remote_cluster_id=remote_cluster_id,
                                            nonce=state.nonce_hex)))
        challenge = wire.read_message(sock)
        if not isinstance(challenge, wire.HelloAck) or not challenge.challenge or challenge.status:
            return False
        proof = state.answer(challenge.nonce, challenge.proof)
        if proof is None:
            return False
        hello.nonce, hello.proof = state.nonce_hex, proof
        return True

    def _connect_retrying(self, ip: str, port: int, deadline: float) -> socket.socket:
        """Connect, trying ``link_retry_count`` times in all while the deadline allows (a
        server that is still starting refuses the first attempts)."""
        attempts = self.options.link_retry_count
        for attempt in range(1, attempts + 1):
            try:
                return self._connect(ip, port, deadline)
            except ConnectionRefusedError:
                if attempt == attempts or time.monotonic() >= deadline:
                    raise
                log.info("link to %s:%d refused (attempt %d of %d); retrying", ip, port, attempt, attempts)
                time.sleep(min(0.05 * attempt, max(0.0, deadline - time.monotonic())))  # back off
        raise AssertionError("unreachable")

    @staticmethod
    def _connect(ip: str, port: int, deadline: float) -> socket.socket:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("link timeout passed")
        sock = socket.create_connection((ip, port), timeout=left)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        return sock

    def wait_link(self, cluster_id: int, deadline: float, cancel: threading.Event) -> bool:
        """Wait until ``cluster_id`` has linked to this engine and its link is ready;
        False at the deadline or once ``cancel`` is set."""
        while not cancel.is_set():
            with self._links_lock:
                link = self.links.get((cluster_id, True)) or self.links.get((cluster_id, False))
                if link is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._links_changed.wait(min(left, 0.5))  # wakes early when a link installs
                    continue
            left = deadline - time.monotonic()
            if link.ready.wait(max(0.0, min(left, 0.5))) and link.broken is None:
                return True
            if left <= 0:
                return False
        return False

    def get_link(self, cluster_id: int) -> Link:
        """The link to ``cluster_id`` ready for transfers; ``LLM_NOT_YET_LINK`` otherwise."""
        link = self.find_link(cluster_id)
        if link is None or not link.ready.is_set():
            fail(Fault.NOT_LINKED,
                        f"cluster {cluster_id} is not linked with cluster {self.cluster_id}; call link_clusters first")
        return link

    def unlink(self, cluster_id: int, deadline: float, force: bool) -> Fault:
        link = self.find_link(cluster_id)
        if link is None:
            return Fault.NOT_LINKED
        # A transfer in flight makes the link busy.  A link being retired (its peer just went
        # away: the agent holds the lock for a moment) is not busy: wait for that moment.
        if not (link.lock.acquire(blocking=False)
                or (link.broken is not None and link.lock.acquire(timeout=max(0.0, deadline - time.monotonic())))):
            return Fault.LINK_BUSY
        link.closing = True
        try:
            if not force and link.broken is None:
                try:
                    link.rpc(wire.Unlink(cluster_id=self.cluster_id), deadline)
                except Exception as exc:  # the peer may be gone; the local end goes anyway
                    log.warning("unlink of cluster %d: peer did not confirm (%s)", cluster_id, exc)
        finally:
            link.lock.release()
        self.drop_link(link, notify=False)
        return Fault.OK

    def drop_link(self, link: Link, notify: bool) -> None:
        """Forget ``link`` and close it (any thread; the agent calls it on UNLINK)."""
        key = (link.remote_cluster_id, link.is_client)
        with self._links_lock:
            if self.links.get(key) is link:
                del self.links[key]
            others = (link.remote_cluster_id, not link.is_client) in self.links
        if not others:
            self._link_broken(link.remote_cluster_id, "the link was unlinked")  # no more pushes from there
        self.agent.unwatch(link)
        # Closing must wait until the agent has unregistered the socket.
        self.agent.call(link.close)

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Release everything; idempotent, safe to call on a half-built engine."""
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
        with self._links_lock:
            links, self.links = list(self.links.values()), {}
        for link in links:
            link.say_goodbye()
            link.close()
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
