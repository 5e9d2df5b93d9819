"""The agent: one thread per engine that accepts links and serves peers' requests.

It owns a selector over the listening socket (servers only), every link's
``serve_sock`` and a wake-up socket pair (for registration and shutdown from other
threads).  Requests are served in order on this thread: lookups, key releases, and the
socket transport's payloads, which stream straight between the socket and cache memory.
End of stream on a ``serve_sock`` means the peer died or unlinked: the link is marked
broken and its sockets are shut down, which also wakes any call blocked on them.

With TLS (:mod:`.tls`) every accepted connection takes its TLS handshake in the selector
too, non-blocking, within the deadline of its first frame; a link's TLS socket may hold
decrypted requests that the selector cannot see, so a served link is served again while
it does (:func:`.tls.buffered`).
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from typing import Any, Callable, NamedTuple, Optional, Protocol, Union, cast

import numpy as np

from . import native, npu, tls, wire
from .errors import Fault
from .auth import Secret
from .handshake import REFUSAL, ServerAuth
from .gather import Gatherings, arrived_of, whole_request
from .handoff import Deferred, HandOffs
from .incoming import Incoming, NotTls, Pending, RateLimitedLog, tls_refusal
from .layout import Plan
from .link import Link
from .notes import NoteBox
from .options import EngineSettings
from .polling import LOAD, SpinPolicy
from .registry import Registry
from .requests import OK, SERVED, RequestHandler
from .transports import checked

__all__ = ["Agent", "AgentHost", "Handshakes", "warn_if_unauthenticated"]

log = logging.getLogger("datadist")

#: Least time a new connection has to deliver its first frame (more if sync_kv_timeout is longer).
_HANDSHAKE_S = 5.0
_EMPTY = np.zeros(0, dtype=np.uint64)
_NO_PAYLOAD = Plan(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)
#: More than a frame that opens a link may hold (taken from a refused plaintext peer).
_OPENING_BYTES = 1 << 17
#: How often links whose next request has only partly arrived are looked at again.
_PARTIAL_POLL_S = 0.01


_warned_open = False


def _opening(msg: wire.Hello) -> bool:
    """An authenticated opening: a nonce and no proof yet (:mod:`datadist.engine.handshake`)."""
    return bool(msg.nonce) and not msg.proof


def _refusal() -> wire.HelloAck:
    """A refusal that names nothing of this engine."""
    return wire.HelloAck(status=int(Fault.LINK_FAILED), message=REFUSAL)


def warn_if_unauthenticated(addr: tuple[str, int], secret: object, tls_config: object = None) -> None:
    """Once per process: listening beyond loopback without a link secret or TLS (whose
    peers prove a certificate of the CA) lets anyone who reaches the address link, read
    and write this engine's caches."""
    global _warned_open
    if secret is not None or tls_config is not None or _warned_open or ipaddress.ip_address(addr[0]).is_loopback:
        return
    _warned_open = True
    log.warning("listening on %s:%d without a link secret or TLS: any host that reaches it can link and read "
                "or write registered caches; set LLMConfig.link_secret (or DATADIST_LINK_SECRET), or "
                "LLMConfig.tls_cert_file, tls_key_file and tls_ca_file, on every engine", addr[0], addr[1])


#: How long the agent polls for a link's next request after answering one, at most: half of
#: what a caller spins for its reply (whether either spins at all: :mod:`.polling`).
SERVE_SPIN_US = native.SPIN_US // 2


class _Served(NamedTuple):
    """A watched link and the agent's polling state for it (the agent's alone)."""

    link: Link
    spin: SpinPolicy


class AgentHost(Protocol):
    """What the agent uses of its engine (:class:`~.core.Engine`): its identity and
    settings, the registry and note box that requests are served from, and ``drop_link``
    for a link the peer unlinked."""

    @property
    def cluster_id(self) -> int: ...

    @property
    def timeout_ms(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def options(self) -> EngineSettings: ...

    @property
    def notes(self) -> NoteBox: ...

    def live_registry(self) -> Registry: ...

    def drop_link(self, link: Link, notify: bool) -> None: ...


class Handshakes(Protocol):
    """The server side of opening links (:class:`~.linking.Linker`), run by the agent on
    each new connection's first frame; ``after_attach`` once the ATTACH reply went out."""

    def accept_hello(self, msg: wire.Hello, sock: socket.socket) -> wire.HelloAck: ...

    def accept_attach(self, msg: wire.Attach, sock: socket.socket) -> wire.Reply: ...

    def after_attach(self, cluster_id: int) -> None: ...


class Agent:
    """Serves peers of one engine (``engine``); new connections are opened into links by
    ``handshakes``.  See the module docstring."""

    def __init__(self, engine: AgentHost, handshakes: Handshakes, listen: Optional[tuple[str, int]]) -> None:
        self.engine = engine
        self._handshakes = handshakes
        self._sel = selectors.DefaultSelector()
        self._watched = 0  # links registered with the selector
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._partial: dict[Link, float] = {}  # links set aside with part of a request, since when
        self._gathering: Gatherings[Link] = Gatherings(SERVED)  # links whose request is read as it comes
        self._calls: list[Callable[[], None]] = []
        self._calls_lock = threading.Lock()
        #: Transfers served off this thread (their bytes would have waited for the peer).
        self._handoffs = HandOffs(engine.device, self._answer, self._failed,
                                  lambda link: self.call(lambda: self._resume(link)))
        self._stop = False
        self._incoming = Incoming(max(engine.timeout_ms / 1000.0, _HANDSHAKE_S))
        self._refusals = RateLimitedLog(log)
        self._requests = RequestHandler(engine.live_registry(), engine.notes, engine.timeout_ms)
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
        bound: tuple[str, int] = ls.getsockname()[:2]
        warn_if_unauthenticated(bound, self.engine.options.link_secret, self.engine.options.tls)
        self.listeners[bound] = ls
        self._sel.register(ls, selectors.EVENT_READ, "listen")
        return bound

    def add_listener(self, addr: tuple[str, int], timeout: float = 5.0) -> tuple[str, int]:
        """Listen on ``addr`` as well (comm domains, switch_role); returns the bound address.
        Raises ``OSError`` if the address cannot be bound."""
        done: queue.Queue[Union[tuple[str, int], OSError]] = queue.Queue()

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
        done: queue.Queue[None] = queue.Queue()

        def close() -> None:
            # tuple(): a caller's list names the same address
            ls = self.listeners.pop(cast(tuple[str, int], tuple(addr)), None)
            if ls is not None:
                self._sel.unregister(ls)
                ls.close()
            done.put(None)

        self.call(close)
        if threading.current_thread() is not self._thread:
            with contextlib.suppress(queue.Empty):  # a stopped agent has closed it already
                done.get(timeout=timeout)

    def on_thread(self) -> bool:
        """Whether the calling thread is the agent's (a user callback runs there)."""
        return threading.current_thread() is self._thread

    # -- control from other threads -------------------------------------------------------
    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the agent thread (selector changes must happen there)."""
        with self._calls_lock:
            self._calls.append(fn)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def backlog(self) -> dict[str, int]:
        """How much waits for the agent thread: calls handed to it, and connections still
        in their opening handshake; and transfers served off it because their bytes would
        have waited for the peer (gauges; read without the thread's cooperation)."""
        with self._calls_lock:
            calls = len(self._calls)
        return {"pending_calls": calls, "pending_handshakes": len(self._incoming.pending),
                "handed_off": len(self._handoffs)}

    def watch(self, link: Link) -> None:
        self.call(lambda: self._register(link))

    def _register(self, link: Link) -> None:
        sock = link.serve_sock
        if sock is not None and sock.fileno() >= 0 and link.broken is None:
            # Timeout mode keeps the descriptor non-blocking for the selector and bounds
            # every read of a request that has started arriving.
            sock.settimeout(self.engine.timeout_ms / 1000.0)
            self._sel.register(sock, selectors.EVENT_READ, _Served(link, SpinPolicy(SERVE_SPIN_US)))
            self._watched += 1

    def unwatch(self, link: Link) -> None:
        self.call(lambda: self._unregister(link))

    def _unregister(self, link: Link) -> None:
        sock = link.serve_sock
        if sock is None:
            return
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            return
        self._watched -= 1

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
        self._handoffs.end(timeout)

    def _close_selector(self) -> None:
        pending = [p.sock for p in self._incoming.pending.values()]
        self._incoming.pending = {}
        for sock in (*self.listeners.values(), *pending, self._wake_r, self._wake_w):
            sock.close()
        self.listeners = {}
        self._sel.close()

    # -- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        npu.set_device(self.engine.device)  # this thread's current device, never the caller's
        while not self._stop:
            timeout = self._incoming.next_timeout()
            if self._partial or self._gathering:
                timeout = _PARTIAL_POLL_S if timeout is None else min(timeout, _PARTIAL_POLL_S)
            try:
                events = self._sel.select(timeout)
            except (OSError, ValueError):
                if self._stop:
                    return
                raise
            for key, _ in events:
                if self._stop:
                    return
                self._guarded(self._dispatch, key)
            if self._incoming.pending:  # most turns of the loop serve links, with nobody opening one
                self._guarded(self._expire_pending)
            if self._partial or self._gathering:
                self._guarded(self._look_again)

    def _dispatch(self, key: selectors.SelectorKey) -> None:
        if key.data == "wake":
            self._drain_wake()
        elif key.data == "listen":
            self._accept(cast(socket.socket, key.fileobj))  # registered by _listen_now
        elif isinstance(key.data, Pending):
            if key.data.sock.fileno() >= 0:
                self._first_frame(key.data)
        else:
            self._serve_burst(*key.data)

    def _guarded(self, step: Callable[..., None], *args: Any) -> None:
        """Run one step of the loop; whatever it raises is logged (rate-limited) and the
        loop goes on: this thread answers every link and every new peer of the engine, so
        nothing one event provokes may end it."""
        try:
            step(*args)
        except Exception as exc:
            log.debug("agent step %s failed", getattr(step, "__name__", step), exc_info=True)
            self._refusals.warning("agent: %s in %s: %s", type(exc).__name__,
                                   getattr(step, "__name__", step), exc)

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
        pend, evicted = self._incoming.admit(sock, self.engine.options.tls)
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
            msg = pend.feed() if pend.tls is None or self._tls_opened(pend) else None
        except NotTls as exc:
            with contextlib.suppress(OSError):  # one small frame into an empty buffer; best effort
                pend.sock.send(tls_refusal())
                # Take what the peer sent: closing with unread bytes would reset the
                # connection, and the peer might lose the refusal before reading it.
                pend.sock.recv(_OPENING_BYTES)
            self._close_pending(pend, exc)
            return
        except (OSError, wire.WireError) as exc:  # ssl.SSLError is an OSError
            self._close_pending(pend, exc)
            return
        if msg is None:
            return
        self._incoming.release(pend)
        self._sel.unregister(pend.sock)
        sock = pend.sock
        sock.settimeout(self.engine.timeout_ms / 1000.0)
        try:
            reply = self._answer_first(pend, msg, sock)
            if reply is None:
                return  # a challenge went out; the connection waits for the proof
            sock.sendall(wire.encode(reply))
        except Exception as exc:  # whatever a hostile frame provokes costs its sender the connection only
            self._refusals.warning("rejected an incoming connection: %s: %s", type(exc).__name__, exc)
            sock.close()
            return
        if getattr(reply, "status", 0):
            sock.close()
        elif isinstance(msg, wire.Attach):
            self._handshakes.after_attach(msg.cluster_id)

    def _tls_opened(self, pend: Pending) -> bool:
        """Advance ``pend``'s TLS handshake; True once done (its first frame is read next,
        through TLS).  Errors as :meth:`Pending.open_tls`."""
        raw = pend.sock
        try:
            events = pend.open_tls()
        finally:
            if pend.sock is not raw:  # wrapped: the same descriptor as a TLS socket
                self._sel.unregister(raw)
                self._sel.register(pend.sock, pend.events, pend)
        if (events or selectors.EVENT_READ) != pend.events:
            pend.events = events or selectors.EVENT_READ
            self._sel.modify(pend.sock, pend.events, pend)
        return not events

    def _answer_first(self, pend: Pending, msg: wire.Message, sock: socket.socket) -> Optional[wire.Message]:
        """The answer to a connection's first frame (an ATTACH, a HELLO, or with a link
        secret the opening or the proven HELLO); None when a challenge was sent instead."""
        secret = self.engine.options.link_secret
        if isinstance(msg, wire.Attach):
            return self._handshakes.accept_attach(msg, sock)
        assert isinstance(msg, wire.Hello)
        if secret is None:  # an opening asks for a secret this engine does not hold
            return _refusal() if _opening(msg) else self._handshakes.accept_hello(msg, sock)
        if pend.auth is None:  # the opening: answer with a challenge, then wait for the proof
            self._challenge(msg, sock, secret)
            return None
        state, client = pend.auth
        if (msg.cluster_id, msg.remote_cluster_id) == (client, self.engine.cluster_id) \
                and state.check(msg.nonce, msg.proof):
            return self._handshakes.accept_hello(msg, sock)
        return _refusal()

    def _challenge(self, msg: wire.Hello, sock: socket.socket, secret: Secret) -> None:
        """Answer an authenticated opening with this engine's nonce and proof, and wait
        (without blocking) for the client's proven HELLO on the same connection."""
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

    def _expire_pending(self) -> None:
        for pend in self._incoming.expired():
            self._close_pending(pend, f"no complete first frame in {self._incoming.handshake_s:.1f} s")

    # -- serving --------------------------------------------------------------------------
    def _serve_burst(self, link: Link, policy: SpinPolicy) -> None:
        """Serve a request of ``link``, then the next ones as long as each arrives within a
        spin after the previous answer: a peer moving layer after layer (or block after
        block) then never waits for this thread to wake from the selector.  Whether and
        how long to spin is ``policy``'s decision (the agent's for this link;
        :mod:`.polling`: none while the machine has more runnable threads than cores,
        rarely after spins that caught nothing).  With other links watched the spin
        watches them all (the selector's own descriptor): a request of another link ends
        it, and the loop serves that one, so no link waits for a spin on another.  A spin
        polls without the GIL."""
        if not self._serve(link):
            return
        sock = link.serve_sock
        while not self._stop and link.broken is None and sock is not None and sock.fileno() >= 0:
            if tls.buffered(sock):
                # requests already decrypted: the selector would not wake for them
                if not self._serve(link):
                    return  # set aside, or handed off: the socket is not this thread's now
                continue
            spin = policy.spin_us(LOAD.busy())
            if not spin:
                return
            if self._watched > 1:
                # Wait for any link's request, then let the loop serve every ready link in
                # turn: serving this link again first would let one fast peer starve the rest.
                policy.spun(native.spin_readable(self._sel.fileno(), spin))
                return
            if not policy.spun(native.spin_readable(sock.fileno(), spin)) or not self._serve(link):
                return

    def _serve(self, link: Link) -> bool:
        """Serve ``link``'s next request; False when it has not arrived whole (a small plain
        frame: the link is set aside until it has, :meth:`_look_again`; a larger or TLS one:
        what came is kept, :mod:`.gather`, and the link stays watched), or was handed off.
        With other links to serve, a peer that sends part of a frame and stops must not
        hold this thread."""
        sock = link.serve_sock
        assert sock is not None  # only a link with a serve_sock is registered (_register)
        frame = None
        gathering = link in self._gathering
        if gathering or self._watched > 1:
            arrived = native.FRAME_LARGE if gathering or isinstance(sock, ssl.SSLSocket) else arrived_of(sock)
            if arrived == native.FRAME_PART:
                self._unregister(link)
                self._partial[link] = time.monotonic()
                return False
            if arrived == native.FRAME_LARGE:  # a TLS frame, or one beyond a socket buffer's
                try:
                    whole = self._gathering.feed(link, sock, time.monotonic())
                except (OSError, wire.WireError) as exc:
                    self._unregister(link)
                    self._failed(link, exc)
                    return True
                if whole is None:
                    return False  # watched still: the rest of it wakes this thread
                frame = self._requests.frame_of(whole)
        return self._serve_frame(link, sock, frame)

    def _serve_frame(self, link: Link, sock: socket.socket, frame: Optional[wire.Frame]) -> bool:
        """Serve one request of ``link``: ``frame`` as gathered, or (None) the one its socket
        holds next; False when it was handed off (the socket is not this thread's now)."""
        inflight = self._requests.registry.inflight
        serving = inflight.begin()  # before any epoch check: memory freed from now on waits for it
        try:
            self._requests.may_defer = self._watched > 1
            if frame is None:
                frame = self._requests.serve_known(link, sock)
                if frame is None:  # a transfer admitted before: served already
                    return True
            with contextlib.ExitStack() as scope:  # staging buffers of this request
                reply = self._requests.handle_frame(link, frame, sock, scope)
                rest, self._requests.deferred = self._requests.deferred, None
                if rest is not None:
                    self._unregister(link)
                    job = Deferred(link, sock, inflight.hand_off(serving, rest, scope), self._requests.payload,
                                   self._requests.payload_summed, scope.pop_all())
                    self._handoffs.start(job)
                    return False
                if frame.cls is wire.Unlink:
                    # Forgotten before it is confirmed: once the peer's unlink returns, this
                    # end has no link either (a switch_role right after must not see one).
                    # The socket itself closes on the next turn of the loop, after the reply.
                    self._unregister(link)
                    self.engine.drop_link(link, notify=False)
                if reply is not None:  # a pull's payload follows its reply in the same writev
                    self._answer(sock, reply, self._requests.payload, self._requests.payload_summed)
        except Exception as exc:  # a bad request ends this link only, never the agent thread
            self._unregister(link)
            self._failed(link, exc)
        finally:
            self._requests.payload = None
            if not serving.handed:
                inflight.end(serving)
        return True

    def _resume(self, link: Link) -> None:
        """Watch a link again after a transfer handed off was answered, and serve the
        requests its thread's TLS reads already decrypted (a peer sends its next ones
        without waiting for answers; the selector would not wake for them)."""
        self._register(link)
        sock = link.serve_sock
        while sock is not None and sock.fileno() >= 0 and link.broken is None and tls.buffered(sock):
            if not self._serve(link):
                return

    def _failed(self, link: Link, exc: Exception) -> None:
        """A request of ``link`` failed: that link ends, nothing else does."""
        if not isinstance(exc, (OSError, RuntimeError, wire.WireError, ValueError)):
            self._refusals.warning("request from cluster %d failed: %s: %s", link.remote_cluster_id,
                                   type(exc).__name__, exc)
        link.close("peer closed the connection" if isinstance(exc, ConnectionError) else str(exc), wait=False)

    def _look_again(self) -> None:
        """Links set aside with part of a request: served again once it is whole (or the
        stream ended), closed when it has not become whole within ``sync_kv_timeout``."""
        now = time.monotonic()
        for link in self._gathering.stalled(now - self.engine.timeout_ms / 1000.0):  # watched: only stalls
            self._unregister(link)
            link.close(f"a request of cluster {link.remote_cluster_id} did not arrive whole within "
                       f"sync_kv_timeout ({self.engine.timeout_ms} ms)", wait=False)
        for link, since in list(self._partial.items()):
            sock = link.serve_sock
            whole = whole_request(sock) if sock is not None and sock.fileno() >= 0 else True
            if whole is False and now - since < self.engine.timeout_ms / 1000.0:
                continue
            del self._partial[link]
            if whole is False:
                link.close(f"a request of cluster {link.remote_cluster_id} did not arrive whole within "
                           f"sync_kv_timeout ({self.engine.timeout_ms} ms)", wait=False)
            else:
                self._register(link)  # the selector reports it next

    def _answer(self, sock: socket.socket, reply: wire.Message, payload: Optional[Plan] = None,
                summed: bool = False) -> None:
        """Send ``reply`` and the payload of a pull right behind it (then, for a summed
        pull, the payload's checksum)."""
        frame = wire.OK_FRAME if reply is OK else wire.encode(reply)
        if payload is not None and summed:  # its checksum follows
            checked.send_payload(sock, payload, frame, time.monotonic() + self.engine.timeout_ms / 1000.0)
        elif isinstance(sock, ssl.SSLSocket):
            tls.send_plan(sock, payload or _NO_PAYLOAD, time.monotonic() + self.engine.timeout_ms / 1000.0, frame)
        else:
            native.sock_send(sock.fileno(), payload or _NO_PAYLOAD, self.engine.timeout_ms, frame)
