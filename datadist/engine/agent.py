"""The agent: one thread per engine that accepts links and serves peers' requests.

It owns a selector over the listening socket (servers only), every link's
``serve_sock`` and a wake-up socket pair (for registration and shutdown from other
threads).  Requests are served in order on this thread: lookups, key releases, and the
socket transport's payloads, which stream straight between the socket and cache memory.
End of stream on a ``serve_sock`` means the peer died or unlinked: the link is marked
broken and its sockets are shut down, which also wakes any call blocked on them.
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import queue
import selectors
import socket
import threading
from typing import Callable, Optional

import numpy as np

from .arrivals import Notice
from .errors import EngineError, Fault
from . import native, npu, wire
from .layout import Plan, tensor_span
from .transports.base import ANY_CACHE, STALE
from .transports.collective import VIA_COLLECTIVE, CollectiveTransport
from .transports.local import host_side
from .handshake import REFUSAL, ServerAuth
from .incoming import Incoming, Pending, RateLimitedLog
from .link import Link
from .registry import CacheRecord, Registry

__all__ = ["Agent", "runs_inside", "runs_inside_any", "warn_if_unauthenticated"]

log = logging.getLogger("datadist")

_DRAIN_CHUNK = 1 << 20
#: Least time a new connection has to deliver its first frame (more if sync_kv_timeout is longer).
_HANDSHAKE_S = 5.0
#: What a linked peer may send on its request stream.
_SERVED = (wire.MsgType.RESOLVE, wire.MsgType.RELEASE_KEY, wire.MsgType.PUSH, wire.MsgType.PULL,
           wire.MsgType.UNLINK, wire.MsgType.NOTIFY, wire.MsgType.NOTE)
_EMPTY = np.zeros(0, dtype=np.uint64)
_NO_PAYLOAD = Plan(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)


_warned_open = False


def _opening(msg: wire.Hello) -> bool:
    """An authenticated opening: a nonce and no proof yet (:mod:`datadist.engine.handshake`)."""
    return bool(msg.nonce) and not msg.proof


def _refusal() -> wire.HelloAck:
    """A refusal that names nothing of this engine."""
    return wire.HelloAck(status=int(Fault.LINK_FAILED), message=REFUSAL)


def warn_if_unauthenticated(addr: tuple, secret: object) -> None:
    """Once per process: listening beyond loopback without a link secret lets anyone who
    reaches the address link, read and write this engine's caches."""
    global _warned_open
    if secret is not None or _warned_open or ipaddress.ip_address(addr[0]).is_loopback:
        return
    _warned_open = True
    log.warning("listening on %s:%d without a link secret: any host that reaches it can link and read or "
                "write registered caches; set LLMConfig.link_secret (or DATADIST_LINK_SECRET) on every engine",
                addr[0], addr[1])


class Agent:
    """Serves peers of one engine; see the module docstring.  ``engine`` provides
    ``registry``, ``timeout_ms``, ``accept_hello(msg, sock)``, ``accept_attach(msg, sock)``
    and ``drop_link(link)``."""

    def __init__(self, engine, listen: Optional[tuple[str, int]]) -> None:
        self.engine = engine
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._calls: list[Callable[[], None]] = []
        self._calls_lock = threading.Lock()
        self._stop = False
        self._incoming = Incoming(max(engine.timeout_ms / 1000.0, _HANDSHAKE_S))
        self._refusals = RateLimitedLog(log)
        self.listeners: dict[tuple[str, int], socket.socket] = {}
        if listen is not None:
            try:
                self._listen_now(listen)
            except OSError:
                self._close_selector()
                raise
        self._thread = threading.Thread(target=self._run, name=f"datadist-agent-{engine.cluster_id}", daemon=True)
        self._thread.start()

    @property
    def listener(self) -> Optional[socket.socket]:
        """The first listening socket (the ``listen_ip_info`` one), if any."""
        return next(iter(self.listeners.values()), None)

    def _listen_now(self, addr: tuple[str, int]) -> tuple[str, int]:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(addr)
            ls.listen(64)
            ls.setblocking(False)
        except OSError:
            ls.close()
            raise
        bound = ls.getsockname()[:2]
        warn_if_unauthenticated(bound, self.engine.options.link_secret)
        self.listeners[bound] = ls
        self._sel.register(ls, selectors.EVENT_READ, "listen")
        return bound

    def add_listener(self, addr: tuple[str, int], timeout: float = 5.0) -> tuple[str, int]:
        """Listen on ``addr`` as well (comm domains, switch_role); returns the bound address.
        Raises ``OSError`` if the address cannot be bound."""
        done: "queue.Queue" = queue.Queue()

        def bind() -> None:
            try:
                done.put(self._listen_now(addr))
            except OSError as exc:
                done.put(exc)

        self.call(bind)
        got = done.get(timeout=timeout)
        if isinstance(got, OSError):
            raise got
        return got

    def remove_listener(self, addr: tuple[str, int], timeout: float = 5.0) -> None:
        """Stop listening on ``addr`` (no-op if not listening there).  Returns once the
        socket is closed, so another process may bind the address right after."""
        done: "queue.Queue" = queue.Queue()

        def close() -> None:
            ls = self.listeners.pop(tuple(addr), None)
            if ls is not None:
                self._sel.unregister(ls)
                ls.close()
            done.put(None)

        self.call(close)
        if threading.current_thread() is not self._thread:
            with contextlib.suppress(queue.Empty):  # a stopped agent has closed it already
                done.get(timeout=timeout)

    # -- control from other threads -------------------------------------------------------
    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the agent thread (selector changes must happen there)."""
        with self._calls_lock:
            self._calls.append(fn)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def watch(self, link: Link) -> None:
        self.call(lambda: self._register(link))

    def _register(self, link: Link) -> None:
        sock = link.serve_sock
        if sock is not None and sock.fileno() >= 0 and link.broken is None:
            # Timeout mode keeps the descriptor non-blocking for the selector and bounds
            # every read of a request that has started arriving.
            sock.settimeout(self.engine.timeout_ms / 1000.0)
            self._sel.register(sock, selectors.EVENT_READ, link)

    def unwatch(self, link: Link) -> None:
        self.call(lambda: self._unregister(link))

    def _unregister(self, link: Link) -> None:
        sock = link.serve_sock
        if sock is None:
            return
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the agent's sockets; idempotent."""
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._drain_wake()  # closes of links dropped just before the stop
        self._close_selector()

    def _close_selector(self) -> None:
        pending = [p.sock for p in self._incoming.pending.values()]
        self._incoming.pending = {}
        for sock in (*self.listeners.values(), *pending, self._wake_r, self._wake_w):
            sock.close()
        self.listeners = {}
        self._sel.close()

    # -- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        if self.engine.device.startswith("npu"):
            npu.set_device(self.engine.device)  # this thread's current device, never the caller's
        while not self._stop:
            try:
                events = self._sel.select(self._incoming.next_timeout())
            except (OSError, ValueError):
                if self._stop:
                    return
                raise
            for key, _ in events:
                if self._stop:
                    return
                if key.data == "wake":
                    self._drain_wake()
                elif key.data == "listen":
                    self._accept(key.fileobj)
                elif isinstance(key.data, Pending):
                    if key.data.sock.fileno() >= 0:
                        self._first_frame(key.data)
                else:
                    self._serve(key.data)
            self._expire_pending()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._calls_lock:
            calls, self._calls = self._calls, []
        for fn in calls:
            fn()

    def _accept(self, listener: socket.socket) -> None:
        """Take a new connection; its first frame is read as it arrives (``_first_frame``)."""
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, OSError):
            return
        pend, evicted = self._incoming.admit(sock)
        if evicted is not None:
            self._close_pending(evicted, f"{self._incoming.max_pending} connections were opening a link; "
                                         "closed the one waiting longest")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sel.register(sock, selectors.EVENT_READ, pend)

    def _close_pending(self, pend: Pending, why: object) -> None:
        self._incoming.release(pend)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(pend.sock)
        pend.sock.close()
        self._refusals.warning("rejected an incoming connection: %s", why)

    def _first_frame(self, pend: Pending) -> None:
        try:
            msg = pend.feed()
        except (OSError, wire.WireError) as exc:
            self._close_pending(pend, exc)
            return
        if msg is None:
            return
        self._incoming.release(pend)
        self._sel.unregister(pend.sock)
        sock = pend.sock
        sock.settimeout(self.engine.timeout_ms / 1000.0)
        try:
            secret = self.engine.options.link_secret
            if isinstance(msg, wire.Attach):
                reply = self.engine.accept_attach(msg, sock)
            elif secret is None:  # an opening asks for a secret this engine does not hold
                reply = _refusal() if _opening(msg) else self.engine.accept_hello(msg, sock)
            elif pend.auth is None:  # the opening: answer with a challenge, then wait for the proof
                state = (ServerAuth.start(secret, msg.nonce, str(msg.cluster_id).encode(),
                                          str(self.engine.cluster_id).encode())
                         if _opening(msg) and msg.remote_cluster_id == self.engine.cluster_id else None)
                if state is None:
                    sock.sendall(wire.encode(_refusal()))
                    raise wire.WireError("an unauthenticated HELLO")
                nonce, proof = state.challenge()
                sock.sendall(wire.encode(wire.HelloAck(challenge=True, nonce=nonce, proof=proof)))
                again, evicted = self._incoming.admit(sock)
                again.auth = (state, msg.cluster_id)
                if evicted is not None:
                    self._close_pending(evicted, "too many connections opening a link")
                self._sel.register(sock, selectors.EVENT_READ, again)
                return
            elif (msg.cluster_id, msg.remote_cluster_id) == (pend.auth[1], self.engine.cluster_id) \
                    and pend.auth[0].check(msg.nonce, msg.proof):
                reply = self.engine.accept_hello(msg, sock)
            else:
                reply = _refusal()
            sock.sendall(wire.encode(reply))
        except Exception as exc:  # whatever a hostile frame provokes costs its sender the connection only
            self._refusals.warning("rejected an incoming connection: %s: %s", type(exc).__name__, exc)
            sock.close()
            return
        if getattr(reply, "status", 0):
            sock.close()
        elif isinstance(msg, wire.Attach):
            link = self.engine.links.get((msg.cluster_id, False))
            if link is not None:
                self.engine.after_attach(link)

    def _expire_pending(self) -> None:
        for pend in self._incoming.expired():
            self._close_pending(pend, f"no complete first frame in {self._incoming.handshake_s:.1f} s")

    # -- serving --------------------------------------------------------------------------
    def _serve(self, link: Link) -> None:
        sock = link.serve_sock
        try:
            with contextlib.ExitStack() as self._request_scope:  # staging buffers of this request
                msg = wire.read_message(sock, _SERVED)
                reply = self._handle(link, msg, sock)
                if isinstance(msg, wire.Unlink):
                    # Forgotten before it is confirmed: once the peer's unlink returns, this
                    # end has no link either (a switch_role right after must not see one).
                    # The socket itself closes on the next turn of the loop, after the reply.
                    self._unregister(link)
                    self.engine.drop_link(link, notify=False)
                if reply is not None:  # a pull's payload follows its reply in the same writev
                    native.sock_send(sock.fileno(), self._pending_plan or _NO_PAYLOAD, self.engine.timeout_ms,
                                     wire.encode(reply))
        except Exception as exc:  # a bad request ends this link only, never the agent thread
            self._unregister(link)
            if not isinstance(exc, (OSError, RuntimeError, wire.WireError, ValueError)):
                self._refusals.warning("request from cluster %d failed: %s: %s", link.remote_cluster_id,
                                       type(exc).__name__, exc)
            link.retire("peer closed the connection" if isinstance(exc, ConnectionError) else str(exc))
        finally:
            self._pending_plan = None
            self._request_scope = None

    _pending_plan: Optional[Plan] = None
    _request_scope: Optional[contextlib.ExitStack] = None

    def _handle(self, link: Link, msg: wire.Message, sock: socket.socket) -> Optional[wire.Message]:
        reg: Registry = self.engine.registry
        if isinstance(msg, wire.Resolve):
            try:
                rec, row = reg.resolve(msg.kind, cluster_id=msg.cluster_id, cache_id=msg.cache_id,
                                       batch_index=msg.batch_index, req_id=msg.req_id, model_id=msg.model_id,
                                       prefix_id=msg.prefix_id)
            except EngineError as exc:
                return wire.Resolved(status=int(exc.fault), message=str(exc))
            return wire.Resolved(cache_id=rec.cache_id, row=row, num_tensors=rec.num_tensors,
                                 tensor_size=rec.tensor_size, batch_size=rec.batch_size, is_blocks=rec.is_blocks,
                                 dtype=rec.dtype, epoch=reg.epoch, watched=reg.watched(rec.cache_id) is not None,
                                 device=rec.device, ipc=[r.to_wire() for r in rec.ipc], arrays=[rec.addrs])
        if isinstance(msg, wire.ReleaseKey):
            # Only keys of pool-allocated caches are consumed by a pull (as in CANN);
            # keys of registered memory stay until the owner removes them.
            try:
                rec, _ = reg.resolve("key", cluster_id=msg.cluster_id, req_id=msg.req_id,
                                     model_id=msg.model_id, prefix_id=msg.prefix_id)
            except EngineError:
                return wire.Reply()
            if rec.release is not None:
                reg.remove_key(msg)
            return wire.Reply()
        if isinstance(msg, (wire.Push, wire.Pull)):
            rec = reg.get(msg.cache_id)
            status, why = self._check_request(reg, rec, msg)
            bases, offs, lens = msg.arrays
            device = "cpu" if status else _device_of(reg, rec, bases, offs)
            if msg.via == VIA_COLLECTIVE:
                return self._serve_collective(link, msg, sock, status, why, device)
            if isinstance(msg, wire.Pull):
                if status:
                    return wire.Reply(status=status, message=why)
                # Sent after this returns, from a host copy if the cache is device memory.
                self._pending_plan = self._request_scope.enter_context(
                    host_side(Plan(bases, bases, offs, offs, lens, device, device), local_is_src=True))
                return wire.Reply()
            if status:
                _drain(sock, msg.nbytes, self.engine.timeout_ms)
                return wire.Reply(status=status, message=why)
            with host_side(Plan(bases, bases, offs, offs, lens, device, device), local_is_src=False) as plan:
                native.sock_recv(sock.fileno(), plan, self.engine.timeout_ms)
            self._arrived(link, rec, msg)
            return wire.Reply()
        if isinstance(msg, wire.Unlink):
            link.closing = True  # the peer ends both streams next: expected, not a failure
            return wire.Reply()
        if isinstance(msg, wire.Notify):
            reg.record_arrival(Notice(cluster_id=msg.cluster_id, cache_id=msg.cache_id, tensors=range(msg.t_lo, msg.t_hi),
                                       nbytes=msg.nbytes, status=Fault.of(msg.status), message=msg.message))
            return None
        if isinstance(msg, wire.Note):
            self.engine.notes.record(link.remote_cluster_id, msg.text)
            return None
        raise wire.WireError(f"unexpected request {type(msg).__name__}")

    def _serve_collective(self, link: Link, msg: wire.Push, sock: socket.socket, status: int,
                          why: str, device: str) -> Optional[wire.Reply]:
        """A validated transfer whose bytes go through the link's process group: answer
        "ready" first, so the initiator never posts an operation that has no partner."""
        transport = link.transport
        if not status and not isinstance(transport, CollectiveTransport):
            status, why = int(Fault.PARAM_INVALID), "this link has no process group"
        sock.sendall(wire.encode(wire.Reply(status=status, message=why)))
        if status:
            return None
        bases, offs, lens = msg.arrays
        if isinstance(msg, wire.Pull):
            transport.serve_pull(bases, offs, lens, msg.nbytes, self.engine.timeout_ms, device)
            return None
        try:
            transport.serve_push(bases, offs, lens, msg.nbytes, self.engine.timeout_ms, device)
        except RuntimeError as exc:  # torch.distributed: the initiator gave up or died
            return wire.Reply(status=int(Fault.LINK_FAILED), message=f"collective receive failed: {exc}")
        self._arrived(link, self.engine.registry.get(msg.cache_id), msg)
        return wire.Reply()

    def _arrived(self, link: Link, rec: Optional[CacheRecord], msg: wire.Push) -> None:
        """A push this agent received went through: record it if the cache is watched
        (socket and collective pushes need no notice message)."""
        if rec is None or self.engine.registry.watched(rec.cache_id) is None:
            return
        lo, hi = tensor_span(rec.addrs, *msg.arrays)
        self.engine.registry.record_arrival(Notice(cluster_id=link.remote_cluster_id, cache_id=rec.cache_id,
                                                    tensors=range(lo, hi), nbytes=msg.nbytes,
                                                    status=Fault.OK))

    @staticmethod
    def _check_request(reg: Registry, rec: Optional[CacheRecord], msg: wire.Push) -> tuple[int, str]:
        if len(msg.arrays) != 3:
            return int(Fault.PARAM_INVALID), "malformed plan"
        if msg.cache_id == ANY_CACHE:
            # Raw addresses (TransferConfig.dst_addrs): no lookup that could be stale; the
            # plan must lie inside the caches registered right now.
            bases, offs, lens = msg.arrays
            if int(lens.sum()) * bases.shape[0] != msg.nbytes or not runs_inside_any(reg.all(), bases, offs, lens):
                return int(Fault.PARAM_INVALID), f"plan reaches outside every cache of cluster {reg.cluster_id}"
            return 0, ""
        if msg.epoch != reg.epoch:  # first: a freed cache id may simply mean a stale lookup
            return STALE, "caches changed since the lookup"
        if rec is None:
            return int(Fault.CACHE_NOT_FOUND), f"cache {msg.cache_id} does not exist (freed?)"
        bases, offs, lens = msg.arrays
        if int(lens.sum()) * bases.shape[0] != msg.nbytes or not runs_inside(rec, bases, offs, lens):
            return int(Fault.PARAM_INVALID), f"plan reaches outside cache {rec.cache_id}"
        return 0, ""


def runs_inside(rec: CacheRecord, bases: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> bool:
    """True if every run of the plan half lies inside the cache's tensors (tensors that
    sit back to back count as one span, since coalesced runs may cross them)."""
    if lens.shape[0] == 0:
        return True
    if bases.shape[0] <= 256 and bases.any():
        # Factored plan over tensor bases: the common case, checked without numpy setup.
        known = rec.addr_set
        return all(b in known for b in bases.tolist()) and int((offs + lens).max()) <= rec.tensor_size
    return _inside_spans([rec], bases, offs, lens)


def runs_inside_any(recs: list[CacheRecord], bases: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> bool:
    """True if every run of the plan half lies inside the tensors of the caches ``recs``
    (raw addresses, which no lookup tied to one cache)."""
    if lens.shape[0] == 0:
        return True
    return bool(recs) and _inside_spans(recs, bases, offs, lens)


def _inside_spans(recs: list[CacheRecord], bases: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> bool:
    """Whether every run lies inside one span of memory covered by the tensors of ``recs``;
    tensors that touch or overlap merge into one span."""
    starts = np.add.outer(bases, offs).ravel()
    ends = starts + np.tile(lens, bases.shape[0])
    lo = np.concatenate([r.addrs for r in recs])
    hi = np.concatenate([r.addrs + np.uint64(r.tensor_size) for r in recs])
    order = np.argsort(lo, kind="stable")
    lo, reach = lo[order], np.maximum.accumulate(hi[order])
    seg_first = np.ones(lo.shape[0], dtype=bool)
    seg_first[1:] = lo[1:] > reach[:-1]
    seg_start = lo[seg_first]
    seg_end = reach[np.append(np.flatnonzero(seg_first)[1:] - 1, lo.shape[0] - 1)]
    seg = np.searchsorted(seg_start, starts, side="right") - 1
    if (seg < 0).any():
        return False
    return bool((ends <= seg_end[seg]).all())


def _device_of(reg: Registry, rec: Optional[CacheRecord], bases: np.ndarray, offs: np.ndarray) -> str:
    """Where the (validated) runs of a request live: the cache's memory, or for raw
    addresses (``ANY_CACHE``) that of the cache holding the first run (a plan never spans
    host and device memory: they are different allocations)."""
    if rec is not None:
        return rec.device
    if bases.shape[0] == 0 or offs.shape[0] == 0:
        return "cpu"
    first = np.uint64(int(bases[0]) + int(offs[0]))
    for r in reg.all():
        if ((r.addrs <= first) & (first < r.addrs + np.uint64(r.tensor_size))).any():
            return r.device
    return "cpu"


def _drain(sock: socket.socket, nbytes: int, timeout_ms: int) -> None:
    """Read and discard a payload that is not wanted, keeping the stream in step."""
    scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK)))
    left = nbytes
    while left > 0:
        n = min(left, len(scratch))
        native.recv_exact(sock.fileno(), scratch[:n], timeout_ms)
        left -= n
