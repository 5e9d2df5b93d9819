"""Opening links: the handshake on both ends, which makes each :class:`~.link.Link`.

The client's link is complete when the engine installs it: both sockets, its transport, a
collective link's process group joined.  The server installs its link when the ``HELLO``
is accepted, with what it has then (the socket it serves, a socket transport, the attach
token, a collective link's ``TCPStore``); the ``ATTACH`` brings its request socket, and a
collective link gets its transport once the process group is joined
(:meth:`Linker.after_attach`).  Its ``ready`` event is set only then: the engine hands out
ready links only (``Engine.get_link``).

Client side (:meth:`Linker.link`): connect to the server's listen address, ``HELLO`` (this
engine's pid, host, epoch page and pool arenas; with a link secret, an authenticated
opening first: :mod:`.handshake`), read ``HELLO_ACK``, then open the second connection
with ``ATTACH``.  Server side (the agent thread): :meth:`Linker.accept_hello` and
:meth:`Linker.accept_attach`.  Each side picks its transport towards the other on its own:
``shm`` if the peer is on this host and its arenas map here (the nonce in its epoch page
proves it is the very process that answered), else ``tcp``; a forced ``shm`` that cannot
map fails the link; collective backends (``gloo``/``nccl``/``hccl``) join a two-member
process group once both connections are up.  Between two NPU engines ``auto`` means
``hccl`` (CANN moves device memory device to device; a socket transport would stage every
byte through host memory on both ends), on one host too, except where TLS is configured
(a process group moves payloads outside TLS).  Process groups whose communicator forms
lazily (``hccl``, ``nccl``) are warmed by one exchange while the link is made, within the
link's timeout, so that no transfer's ``sync_kv_timeout`` pays for it.

With ``transfer_checksum`` the socket transport is :mod:`.transports.checked`'s (every
payload summed on both ends) and the shm transport checks each one-sided copy against the
owner's checksum; a link whose transfers it cannot cover (a process group) says so in a
warning when it is made.

With TLS configured (:mod:`.tls`), both connections of every link this engine opens are
TLS, handshake first, whatever the transport; the server side does the same in the agent.
"""
from __future__ import annotations

import datetime
import hmac
import logging
import secrets
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, Union

import numpy as np

from . import cuda, native, npu, wire
from .conn_owner import holds_other_end
from .errors import EngineError, Fault, fail
from .handshake import REFUSAL, ClientAuth
from .layout import Plan
from .link import Link
from .memory import Arena, PeerArena, PoolMemory
from .metrics import EngineMetrics
from .options import EngineSettings
from .registry import EPOCH_PAGE_SIZE, Registry
from .transports.base import Transport
from .transports.checked import CheckedTcpTransport
from .transports.collective import COLLECTIVE_BACKENDS, CollectiveTransport, make_group
from .transports.shm import ShmTransport
from .transports.tcp import TcpTransport

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["Linker", "LinkerHost"]

log = logging.getLogger("datadist")


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


class LinkerHost(Protocol):
    """What the linker uses of its engine (:class:`~.core.Engine`): who it is (what a
    HELLO says), the memory same-host peers map, and the engine's links: the one held
    for a peer, and where a new one goes (``install``, which also has the agent watch it;
    ``watch`` starts or stops that)."""

    @property
    def cluster_id(self) -> int: ...

    @property
    def role(self) -> int: ...

    @property
    def host(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def backend(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def timeout_ms(self) -> int: ...

    @property
    def options(self) -> EngineSettings: ...

    @property
    def metrics(self) -> EngineMetrics: ...

    @property
    def arenas(self) -> Sequence[Arena]: ...

    @property
    def device_arena(self) -> Optional[PoolMemory]: ...

    def live_registry(self) -> Registry: ...

    def held(self, cluster_id: int, initiated: bool) -> Optional[Link]: ...

    def link_broken(self, cluster_id: int, reason: str) -> None: ...

    def install(self, link: Link) -> None: ...

    def watch(self, link: Link, watched: bool) -> None: ...


class _Opening:
    """What a client's handshake has acquired so far, released if it fails."""

    def __init__(self) -> None:
        self.socks: list[socket.socket] = []
        self.transport: Optional[Transport] = None
        self.link: Optional[Link] = None

    def keep(self, sock: socket.socket) -> socket.socket:
        self.socks.append(sock)
        return sock

    def abandon(self) -> None:
        if self.link is not None:
            self.link.close()  # its sockets and transport too
        elif self.transport is not None:
            self.transport.close()
        for sock in self.socks:
            sock.close()


class Linker:
    """The handshakes of one engine (client and server side)."""

    def __init__(self, engine: LinkerHost) -> None:
        self.engine = engine

    # -- hello ---------------------------------------------------------------------------
    def _hello_fields(self) -> dict[str, Any]:
        registry = self.engine.live_registry()
        page = registry.page
        return dict(cluster_id=self.engine.cluster_id, role=int(self.engine.role), host=self.engine.host, pid=self.engine.pid,
                    ctrl={"fd": page.fd, "size": page.size, "base": page.base, "nonce": registry.nonce},
                    arenas=[{"fd": a.fd, "size": a.size, "base": a.base} for a in self.engine.arenas],
                    device_regions=[r.to_wire() for r in self.engine.device_arena.regions] if self.engine.device_arena else [],
                    backend=self.engine.backend, device=self.engine.device)

    def _collective(self, peer: wire.Hello) -> Optional[str]:
        """The process-group backend of the link to ``peer``, or None for a socket link
        (both ends compute the same answer from the two HELLOs)."""
        def wanted(backend: str, device: str, other: str) -> str:
            if (backend == "auto" and device.startswith("npu") and other.startswith("npu")
                    and self.engine.options.tls is None):
                return "hccl"
            return backend

        mine = wanted(self.engine.backend, self.engine.device, peer.device)
        theirs = wanted(peer.backend, peer.device, self.engine.device)
        if not {mine, theirs} & set(COLLECTIVE_BACKENDS):
            return None
        if mine != theirs:
            fail(Fault.LINK_FAILED,
                 f"transfer_backend {mine!r} here ({self.engine.device}), {theirs!r} on cluster {peer.cluster_id} "
                 f"({peer.device}): collective links need the same backend on both ends")
        return mine

    def _transport_to(self, peer: wire.Hello, sock: socket.socket) -> tuple[Optional[Transport], Optional[int]]:
        """The transport towards ``peer`` (see the module docstring), which spoke through
        ``sock``, and, for a same-host peer, the local address of its mapped epoch page.
        A same-host peer must be the process holding the other end of ``sock``
        (:mod:`.conn_owner`): what it says of itself could be another process's words.
        Collective links get theirs once the process group exists (:meth:`_join_group`):
        None here."""
        checked = self.engine.options.transfer_checksum
        tcp = CheckedTcpTransport() if checked else TcpTransport()
        if self._collective(peer) is not None:
            if checked:
                log.warning("link to cluster %d moves payloads through a process group, which transfer_checksum does "
                            "not cover: its transfers are not checksummed (set transfer_backend tcp to have them "
                            "checked)", peer.cluster_id)
            return None, None
        if self.engine.backend == "tcp" or peer.backend == "tcp":
            return tcp, None
        mapped: list[PeerArena] = []
        try:
            if peer.host != self.engine.host:
                raise OSError(f"peer is on another host ({peer.host})")
            if not holds_other_end(peer.pid, sock):
                raise OSError(f"process {peer.pid}, which the peer says it is, does not hold its end of the connection")
            ctrl = PeerArena.open(peer.pid, peer.ctrl["fd"], EPOCH_PAGE_SIZE, peer.ctrl["base"])
            mapped.append(ctrl)
            if Registry.read_epoch(Registry.nonce_address(ctrl.local_base)) != peer.ctrl["nonce"]:
                raise OSError("mapped epoch page belongs to another process (pid namespaces differ?)")
            for a in peer.arenas:
                mapped.append(PeerArena.open(peer.pid, a["fd"], a["size"], a["base"]))
        except OSError as exc:
            for m in mapped:
                m.close()
            if self.engine.backend == "shm":
                fail(Fault.LINK_FAILED,
                            f"transfer_backend='shm' but cluster {peer.cluster_id}'s memory cannot be mapped: {exc}")
            log.info("link to cluster %d uses tcp: %s", peer.cluster_id, exc)
            return tcp, None
        shm = ShmTransport(peer.pid, mapped, self._probe_cma(peer), fallback=tcp,
                           device_pool=[cuda.IpcRegion.from_wire(r) for r in peer.device_regions],
                           cuda_here=self.engine.device.startswith("cuda"), summed=checked)
        log.info("link to cluster %d uses shm (cross-memory attach %s)", peer.cluster_id,
                 "on" if shm.cma_ok else "off")
        return shm, mapped[0].local_base

    def _may_map_here(self, peer: wire.Hello) -> bool:
        """Whether ``peer`` may copy into and out of this engine's memory itself (a
        same-host link that is not forced onto tcp nor collective: the peer decides for
        its end as :meth:`_transport_to` does for this one)."""
        return (peer.host == self.engine.host and "tcp" not in (self.engine.backend, peer.backend)
                and self._collective(peer) is None)

    @staticmethod
    def _probe_cma(peer: wire.Hello) -> bool:
        got = np.zeros(1, dtype=np.uint64)
        plan = Plan(np.zeros(1, np.uint64), np.zeros(1, np.uint64),
                    np.array([Registry.nonce_address(peer.ctrl["base"])], np.uint64),
                    np.array([got.__array_interface__["data"][0]], np.uint64), np.array([8], np.uint64))
        try:
            native.cma_plan(peer.pid, plan, write=False)
        except OSError as exc:
            log.info("cross-memory attach to pid %d not permitted (%s); registered caches go over tcp", peer.pid, exc)
            return False
        nonce: int = peer.ctrl["nonce"]
        return int(got[0]) == nonce

    # -- server side (agent thread) ------------------------------------------------------
    def accept_hello(self, msg: wire.Hello, sock: socket.socket) -> wire.HelloAck:
        # A refusal names nothing of this engine (no cluster id, pid, host, memory or
        # handles): only an accepted peer learns those.
        if msg.remote_cluster_id != self.engine.cluster_id:
            return wire.HelloAck(status=int(Fault.LINK_FAILED),
                                 message=f"no cluster {msg.remote_cluster_id} at this address")
        old = self.engine.held(msg.cluster_id, initiated=False)
        if old is not None and old.broken is None:
            # The process holding that link links again, which a client does only once its
            # own end is broken (a deadline passed mid-transfer): the end of stream never
            # reached this end (a partition swallowed it), so the old link is dead, and
            # install() below replaces it (refusing would keep the client out until TCP gave
            # up).  It proves it is that process with the link's attach token, which only
            # it was given: a pid can be guessed, and anyone could take the link over.
            if old.peer_pid != msg.pid or not hmac.compare_digest(old.attach_token.encode(),
                                                                  str(msg.relink).encode()):
                return wire.HelloAck(status=int(Fault.ALREADY_LINKED),
                                     message=f"cluster {msg.cluster_id} is already linked here")
            old.mark_broken("the peer linked again; its end of this link is gone")
        fields = self._hello_fields()
        try:
            transport, epoch_addr = self._transport_to(msg, sock)
        except Exception as exc:  # reported to the peer, which raises it there
            return wire.HelloAck(status=int(exc.fault if isinstance(exc, EngineError) else Fault.LINK_FAILED),
                                 message=str(exc) if isinstance(exc, EngineError) else
                                 f"the link could not be set up ({type(exc).__name__})")
        link = Link(remote_cluster_id=msg.cluster_id, remote_role=msg.role, peer_pid=msg.pid,
                    timeout_ms=self.engine.timeout_ms, is_client=False, local_cluster_id=self.engine.cluster_id,
                    on_broken=self.engine.link_broken, transport=transport, peer_epoch_addr=epoch_addr, metrics=self.engine.metrics,
                    serve_sock=sock, attach_token=secrets.token_hex(16), may_map_here=self._may_map_here(msg))
        store_port = 0
        backend = self._collective(msg)
        if backend is not None:
            link.collective = backend
            from torch._C._distributed_c10d import TCPStore  # torch.distributed's own, as its stubs export it

            ip = self.engine.options.listen_ip or "127.0.0.1"
            link.store = TCPStore(ip, 0, 2, True, timeout=_seconds(self.engine.options.link_total_time_s),
                                  wait_for_workers=False)
            store_port = link.store.port
        self.engine.install(link)
        return wire.HelloAck(path=backend or link.path, store_port=store_port,
                             attach_token=link.attach_token, **fields)

    def accept_attach(self, msg: wire.Attach, sock: socket.socket) -> wire.Reply:
        link = self.engine.held(msg.cluster_id, initiated=False)
        # Only the peer that just linked knows the token: nobody else can take over the
        # request connection of a link that is opening.
        if link is None or link.req_sock is not None or not hmac.compare_digest(link.attach_token, msg.token):
            return wire.Reply(status=int(Fault.LINK_FAILED), message="no pending link to attach to")
        link.req_sock = sock
        if link.store is None:
            link.opened()
        return wire.Reply()

    def after_attach(self, cluster_id: int) -> None:
        """Server side (the agent thread), after the ATTACH reply went out to ``cluster_id``:
        join the process group of the link it attached to (the client joins as soon as it
        reads that reply) on a thread of its own.  A communicator can take seconds to form
        (HCCL's does); the agent serves every other link meanwhile.  The joining link's own
        requests wait unread until it is ready: the agent stops watching it until then."""
        link = self.engine.held(cluster_id, initiated=False)
        if link is not None and link.store is not None and link.transport is None:
            self.engine.watch(link, False)
            threading.Thread(target=self._join_served, args=(link,), daemon=True,
                             name=f"datadist-join-{link.remote_cluster_id}").start()

    def _join_served(self, link: Link) -> None:
        """Join ``link``'s process group as the server (rank 0) and open the link, or close
        it with the reason (the client sees a link failure)."""
        assert link.store is not None and link.collective is not None  # after_attach checked
        try:
            npu.set_device(self.engine.device)  # this thread's current device, as the agent's
            self._join_group(link, link.store, 0, link.collective,
                             time.monotonic() + self.engine.options.link_total_time_s)
            link.opened()
            self.engine.watch(link, True)  # its requests are served from now on
        except Exception as exc:  # nothing above this thread to raise to; the engine may be closed
            log.warning("process group with cluster %d failed: %s", link.remote_cluster_id, exc)
            link.close(f"process group setup failed: {exc}", wait=False)

    def _join_group(self, link: Link, store: Store, rank: int, backend: str, deadline: float) -> None:
        """Join the link's process group of ``backend`` as ``rank`` and warm it before
        ``deadline`` (the link's timeout)."""
        from torch._C._distributed_c10d import PrefixStore  # torch.distributed's own, as its stubs export it

        prefix = PrefixStore(f"datadist-link-{min(self.engine.cluster_id, link.remote_cluster_id)}-"
                                  f"{max(self.engine.cluster_id, link.remote_cluster_id)}", store)
        group = make_group(backend, prefix, rank, self.engine.timeout_ms / 1000.0)
        transport = link.transport = CollectiveTransport(backend, group, 1 - rank, store, device=self.engine.device)
        started = time.monotonic()
        transport.warm(rank, deadline)
        log.info("link to cluster %d uses %s (rank %d; communicator ready in %.0f ms)", link.remote_cluster_id,
                 backend, rank, (time.monotonic() - started) * 1000)

    # -- client side ---------------------------------------------------------------------
    def link(self, remote_cluster_id: int, ip: str, port: int, deadline: float) -> Fault:
        """Link to the server at ``ip:port``; returns the per-cluster status."""
        old = self.engine.held(remote_cluster_id, initiated=True)
        if old is not None and old.broken is None:
            return Fault.ALREADY_LINKED
        opening = _Opening()
        try:
            result = self._dial(remote_cluster_id, ip, port, deadline, opening,
                                old.attach_token if old is not None else "")
        except (OSError, RuntimeError, wire.WireError, KeyError, ValueError, TypeError) as exc:
            # RuntimeError: torch.distributed; KeyError, ValueError, TypeError: an answer
            # whose fields are missing or malformed (a broken or hostile peer)
            log.warning("link to cluster %d at %s:%d failed: %s: %s", remote_cluster_id, ip, port,
                        type(exc).__name__, exc)
            opening.abandon()
            return Fault.LINK_FAILED
        except BaseException:
            opening.abandon()
            raise
        if isinstance(result, Fault):
            opening.abandon()
            return result
        result.opened()
        self.engine.install(result)
        log.info("linked to cluster %d at %s:%d over %s", remote_cluster_id, ip, port, result.path)
        return Fault.OK

    def _dial(self, remote_cluster_id: int, ip: str, port: int, deadline: float,
              opening: "_Opening", relink: str) -> Union[Link, Fault]:
        """The client's half of the handshake: HELLO (authenticated first where a secret
        is set; ``relink``: the attach token of the broken link this one replaces),
        HELLO_ACK, the transport towards the server, ATTACH on a second connection, and
        for collective links the process group.  Returns the complete link, or the
        server's refusal."""
        hello_sock = opening.keep(self._connect_retrying(ip, port, deadline))
        hello = wire.Hello(remote_cluster_id=remote_cluster_id, relink=relink, **self._hello_fields())
        refused = self._authenticate(hello_sock, hello, remote_cluster_id) \
            if self.engine.options.link_secret is not None else None
        if refused is not None:
            log.warning("link to cluster %d at %s:%d refused: %s", remote_cluster_id, ip, port, refused)
            return Fault.LINK_FAILED
        hello_sock.sendall(wire.encode(hello))
        ack = wire.read_message(hello_sock)
        if not isinstance(ack, wire.HelloAck):
            raise wire.WireError(f"expected HELLO_ACK, got {type(ack).__name__}")
        if ack.status:
            log.warning("link to cluster %d at %s:%d refused: %s", remote_cluster_id, ip, port, ack.message)
            return Fault.of(ack.status)
        transport, epoch_addr = self._transport_to(ack, hello_sock)
        opening.transport = transport
        attach_sock = opening.keep(self._connect(ip, port, deadline))
        attach_sock.sendall(wire.encode(wire.Attach(cluster_id=self.engine.cluster_id, token=ack.attach_token)))
        reply = wire.read_message(attach_sock)
        if not isinstance(reply, wire.Reply) or reply.status:
            raise wire.WireError(getattr(reply, "message", "attach refused"))
        link = opening.link = Link(
            remote_cluster_id=remote_cluster_id, remote_role=ack.role, peer_pid=ack.pid,
            timeout_ms=self.engine.timeout_ms, is_client=True, local_cluster_id=self.engine.cluster_id,
            on_broken=self.engine.link_broken, transport=transport, peer_epoch_addr=epoch_addr, metrics=self.engine.metrics,
            req_sock=hello_sock, serve_sock=attach_sock, attach_token=ack.attach_token,
            may_map_here=self._may_map_here(ack))
        backend = self._collective(ack)
        if ack.store_port and backend is not None:
            from torch._C._distributed_c10d import TCPStore  # torch.distributed's own, as its stubs export it

            store = TCPStore(ip, ack.store_port, 2, False, timeout=_seconds(max(0.001, deadline - time.monotonic())))
            self._join_group(link, store, 1, backend, deadline)
        return link

    def _authenticate(self, sock: socket.socket, hello: wire.Hello, remote_cluster_id: int) -> Optional[str]:
        """The client's half of an authenticated opening (:mod:`datadist.engine.handshake`):
        None on success (``hello`` then carries the nonce and proof and may be sent), else
        why the opening failed; nothing of this engine's memory has been sent before."""
        secret = self.engine.options.link_secret
        assert secret is not None  # only called with a link secret (_dial)
        state = ClientAuth(secret, str(self.engine.cluster_id).encode(), str(remote_cluster_id).encode())
        sock.sendall(wire.encode(wire.Hello(cluster_id=self.engine.cluster_id, remote_cluster_id=remote_cluster_id,
                                            nonce=state.nonce_hex)))
        challenge = wire.read_message(sock)
        unproven = "the peer did not prove it holds the link secret (or refused ours)"
        if isinstance(challenge, wire.HelloAck) and challenge.status and challenge.message != REFUSAL:
            return challenge.message or unproven  # refused before any proof (e.g. this engine lacks TLS)
        if not isinstance(challenge, wire.HelloAck) or not challenge.challenge or challenge.status:
            return unproven
        proof = state.answer(challenge.nonce, challenge.proof)
        if proof is None:
            return unproven
        hello.nonce, hello.proof = state.nonce_hex, proof
        return None

    def _connect_retrying(self, ip: str, port: int, deadline: float) -> socket.socket:
        """Connect, trying ``link_retry_count`` times in all while the deadline allows (a
        server that is still starting refuses the first attempts)."""
        attempts = self.engine.options.link_retry_count
        for attempt in range(1, attempts + 1):
            try:
                return self._connect(ip, port, deadline)
            except ConnectionRefusedError:
                if attempt == attempts or time.monotonic() >= deadline:
                    raise
                log.info("link to %s:%d refused (attempt %d of %d); retrying", ip, port, attempt, attempts)
                time.sleep(min(0.05 * attempt, max(0.0, deadline - time.monotonic())))  # back off
        raise AssertionError("unreachable")

    def _connect(self, ip: str, port: int, deadline: float) -> socket.socket:
        """A connection to the server, TLS (handshake done) when this engine has TLS."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("link timeout passed")
        sock = socket.create_connection((ip, port), timeout=left)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        tls = self.engine.options.tls
        if tls is None:
            return sock
        try:
            return tls.connect(sock)  # closes the socket if the handshake fails
        except (ssl.SSLError, ConnectionError) as exc:  # a peer without TLS closes on our handshake
            why = getattr(exc, "reason", None) or exc
            raise ConnectionError(f"TLS handshake with {ip}:{port} failed ({why}); the peer must have TLS on, "
                                  "with a certificate signed by this engine's CA, and trust ours") from None
