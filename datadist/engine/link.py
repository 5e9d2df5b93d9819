"""One link to a peer engine: its sockets, its transport, and the lookups cached on it.

Each link has two TCP connections, both opened by the client at link time: on
``req_sock`` this side sends requests and the peer's agent serves them; on ``serve_sock``
the peer sends requests and this side's agent serves them.  A connection therefore has one
initiator and one server, and no reply ever has to be matched to a request.  The agent
watches ``serve_sock``: end of stream there means the peer is gone, and the link is
marked broken at once, so waiting and later calls fail fast.  With TLS both connections
are ``ssl.SSLSocket``s: payloads then go through :mod:`.tls`, and a wait for a reply
first asks the socket for bytes it has decrypted already.

Thread rules: public calls hold the link's ``turns`` for the whole transfer (one transfer
per link at a time, taken in arrival order; a prepared transfer that finds the link busy
is run by the holder, see :mod:`.turns`; ``unlink`` during a transfer is
``LLM_LINK_BUSY``).  The agent thread touches only ``serve_sock`` and the link's state
(:mod:`.link_state`: the states and their moves).
"""
from __future__ import annotations

import logging
import socket
import time
from ssl import SSLSocket
from typing import TYPE_CHECKING, Callable, NamedTuple, NoReturn, Optional, Sequence, Union

from .errors import EngineError, Fault, fail
from .transports.base import Prepared, RemoteCache, StaleLookup, Transport
from .turns import TurnEnds, Turns, Unserved
from . import native, tls, wire
from .polling import LOAD, SpinPolicy
from .keys import CacheRef
from .layout import Plan, tensor_span
from .link_state import LinkLife, LinkState
from .lookups import PeerLookups
from .metrics import EngineMetrics, LinkMeter

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

__all__ = ["Link", "shut_down"]

log = logging.getLogger("datadist")

# Errors that a stale cached lookup can cause; they are retried once with a fresh lookup.
_RETRYABLE = (Fault.PARAM_INVALID, Fault.CACHE_NOT_FOUND)


def _retry(outcome: bool | Exception, from_cache: bool) -> bool:
    """Whether a batched step's failure is worth one more try on its own: the peer's
    caches changed since the lookup it was planned on, or may have (an error that a
    cached lookup can cause)."""
    return isinstance(outcome, StaleLookup) or (
        from_cache and isinstance(outcome, EngineError) and outcome.fault in _RETRYABLE)


class _Job(NamedTuple):
    """A transfer as :meth:`Link.transfer` takes it, with its deadline."""

    key: Union[CacheRef, RemoteCache]
    planner: Callable[[RemoteCache], Plan]
    push: bool
    prepared: Optional[Prepared]
    deadline: float
    op: str
    start: float


class Link(PeerLookups, LinkLife, TurnEnds):
    """A link to one peer engine: this end's request stream (``req_sock``), the stream the
    agent serves the peer's requests on (``serve_sock``), the transport its plans move by,
    and the cache of the peer's lookups.  It is the :class:`~.transports.base.Channel`
    its transport talks through.  Made by :mod:`.linking` (what a server-side link gets
    only once the peer attaches: see there); usable once READY (:mod:`.link_state`); one
    transfer at a time (``turns``)."""

    def __init__(self, *, remote_cluster_id: int, remote_role: int, peer_pid: int, timeout_ms: int,
                 is_client: bool, local_cluster_id: int = 0,
                 on_broken: Optional[Callable[[int, str], None]] = None,
                 transport: Optional[Transport] = None, peer_epoch_addr: Optional[int] = None,
                 req_sock: Optional[socket.socket] = None, serve_sock: Optional[socket.socket] = None,
                 attach_token: str = "", metrics: Optional[EngineMetrics] = None, may_map_here: bool = False) -> None:
        LinkLife.__init__(self, on_broken)  # ``on_broken``: told once when the link breaks
        self.local_cluster_id = local_cluster_id
        self.remote_cluster_id = remote_cluster_id
        self.remote_role = remote_role
        self.peer_pid = peer_pid
        self.timeout_ms = timeout_ms
        self.is_client = is_client
        self.req_sock = req_sock       # this end's requests (the client's: set once ATTACHed)
        self.serve_sock = serve_sock   # the peer's requests, served by the agent
        self.transport = transport     # collective links: set once the process group exists
        self.peer_epoch_addr = peer_epoch_addr   # mapped epoch page of a same-host peer
        self.store: Optional[TCPStore] = None    # collective links: the server's TCPStore
        self.collective: str = ""                # collective links: their process group's backend
        self.attach_token = attach_token         # what the client's ATTACH carried (the server's HELLO_ACK gave it)
        self.turns: Turns[_Job] = Turns(self._serve_jobs)
        #: Whether the peer may copy into and out of this engine's memory itself (same host):
        #: memory this engine frees waits for its copies (:mod:`.fences`).
        self.may_map_here = may_map_here
        TurnEnds.__init__(self)
        PeerLookups.__init__(self)
        self._release_when_idle = False  # closed while a transfer held the link: it releases
        self.req_spin = SpinPolicy(native.SPIN_US)   # waits for this end's replies (turn holder)
        #: The engine's counts (told of a break and of the release), if any, and this link's
        #: transfer counts (written only by the holder of ``lock``, :mod:`.metrics`).
        self.metrics = metrics
        self.meter = metrics.link_meter(self._path) if metrics is not None else LinkMeter(self._path)

    # -- state ---------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self.transport.name if self.transport is not None else "none"

    def _path(self) -> str:
        return self.path

    def check_alive(self) -> None:
        """Raise ``LLM_LINK_FAILED`` if the link is broken (peer gone, stream lost)."""
        if self.broken is not None:
            fail(Fault.LINK_FAILED,
                        f"link to cluster {self.remote_cluster_id} is broken ({self.broken}); "
                        "unlink_clusters and link_clusters again")

    def check_peer(self) -> None:
        """After a one-sided copy: raise ``LLM_LINK_FAILED`` if the peer has died.  Its
        memory stays mapped here after it dies, so a copy into it "succeeds"; but the
        kernel ends the peer's sockets when it exits, and nothing else is ever pending on
        the request connection between requests, so a readable end of stream there means
        the peer is gone (one poll, no wait)."""
        sock = self.req_sock
        if self.broken is None and sock is not None and native.peer_closed(sock.fileno()):
            self.mark_broken("peer process exited")
        self.check_alive()

    def protocol_error(self, msg: wire.Message, why: str = "") -> NoReturn:
        """Break the link over ``msg``, a frame that should not have come (or, with ``why``,
        one whose content cannot be right)."""
        self.mark_broken(why or f"unexpected {type(msg).__name__} frame")
        fail(Fault.LINK_FAILED, f"protocol error on link to cluster {self.remote_cluster_id}" + (f": {why}" if why else ""))

    # -- requests ------------------------------------------------------------------------
    def rpc(self, msg: Union[wire.Message, bytes], deadline: float, send_plan: Optional[Plan] = None,
            summed: bool = False) -> wire.Message:
        """Send ``msg`` (a message, or one encoded before) and the source runs of
        ``send_plan`` right after it on the request connection, and read the answer, all
        before ``deadline``.  A timeout or socket error breaks the link (the stream can
        no longer be trusted).  A frame encoded before goes out over a plain socket in one
        C call that writes it with the runs and reads the answer's first bytes; ``summed``
        (only for such a call: a plain socket and an encoded frame) puts the runs'
        checksum behind them in it."""
        sock = self._request_sock()
        if not isinstance(msg, bytes) or isinstance(sock, SSLSocket):
            if summed:  # sent without its checksum, the peer would wait for one until its deadline
                raise ValueError("a summed request needs an encoded frame on a plain socket")
            self.send_request(msg, deadline, send_plan)
            return self.read_reply(deadline)
        try:
            spin = self.req_spin.spin_us(LOAD.busy())
            started = time.perf_counter()
            head = native.request(sock.fileno(), msg, send_plan, len(wire.OK_FRAME), native.ms_until(deadline), spin,
                                  summed)
            self.req_spin.outcome(spin, (time.perf_counter() - started) * 1e6)
            if head == wire.OK_FRAME:
                return wire.OK
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            return wire.finish_answer(sock, head)
        except (OSError, wire.WireError) as exc:  # TimeoutError is an OSError
            self._fail(exc)

    def send_request(self, msg: Union[wire.Message, bytes], deadline: float, send_plan: Optional[Plan] = None) -> None:
        """The sending half of :meth:`rpc`."""
        sock = self._request_sock()
        try:
            frame = msg if isinstance(msg, bytes) else wire.encode(msg)
            if send_plan is not None and isinstance(sock, SSLSocket):
                tls.send_plan(sock, send_plan, deadline, frame)
            elif send_plan is not None:
                native.sock_send(sock.fileno(), send_plan, native.ms_until(deadline), frame)
            else:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.sendall(frame)
        except (OSError, wire.WireError) as exc:  # TimeoutError is an OSError
            self._fail(exc)

    def read_reply(self, deadline: float) -> wire.Message:
        """Read the next frame from the request connection before ``deadline``."""
        sock = self._request_sock()
        try:
            if not (isinstance(sock, SSLSocket) and sock.pending()):  # TLS: bytes poll() cannot see
                spin = self.req_spin.spin_us(LOAD.busy())
                started = time.perf_counter()
                native.wait_readable(sock.fileno(), native.ms_until(deadline), spin)
                self.req_spin.outcome(spin, (time.perf_counter() - started) * 1e6)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            return wire.read_answer(sock)
        except (OSError, wire.WireError) as exc:  # TimeoutError is an OSError
            self._fail(exc)

    def _request_sock(self) -> socket.socket:
        """The request connection; a link is not ready for requests before it has one."""
        sock = self.req_sock
        if sock is None:
            fail(Fault.NOT_LINKED, f"link to cluster {self.remote_cluster_id} is not ready yet")
        return sock

    def _fail(self, exc: BaseException) -> NoReturn:
        """Map a failure on the request connection to the contract's error; the link is
        broken either way (the stream can no longer be trusted)."""
        if isinstance(exc, (TimeoutError, socket.timeout)):
            self.mark_broken("sync_kv_timeout passed mid-request")
            # End the stream for the peer too: a peer that was only slow (stopped, swapped
            # out) would otherwise go on using its end and never learn to link again.
            self._shutdown()
            fail(Fault.TIMEOUT,
                        f"request to cluster {self.remote_cluster_id} did not finish within sync_kv_timeout "
                        f"({self.timeout_ms} ms); the link is marked broken")
        self.mark_broken(f"connection failed: {exc}")
        fail(Fault.LINK_FAILED, f"link to cluster {self.remote_cluster_id} is broken: {exc}")

    def transfer(self, key: Union[CacheRef, RemoteCache], planner: Callable[[RemoteCache], Plan],
                 push: bool, prepared: Optional[Prepared] = None, op: str = "") -> Prepared:
        """Resolve ``key``, plan against it and move the bytes, within ``sync_kv_timeout``.

        ``planner`` validates the remote geometry and returns a plan whose peer side is in
        the peer's address space.  Returns the transfer as prepared, which a caller
        repeating the same call gives back as ``prepared``: while the peer's cache stays
        the same (its epoch, for a same-host peer; a socket peer checks each request
        itself and answers a stale one, which is then planned again), it runs again
        without a lookup or a plan.  ``key`` may also be a :class:`RemoteCache` that
        describes raw peer addresses (``cache_id`` ``ANY_CACHE``,
        ``transfer_cache_async``): nothing is looked up, and the peer checks the plan
        against all its caches.

        Transfers take turns on the link in arrival order; a ``prepared`` transfer of host
        memory that has to wait is run by the thread ahead of it (:mod:`.turns`).  ``op``
        names the call in the link's counts (:mod:`.metrics`; default ``push_blocks`` or
        ``pull_blocks``), kept by whichever thread holds the lock while it moves."""
        start = time.monotonic()
        deadline = start + self.timeout_ms / 1000.0
        op = op or ("push_blocks" if push else "pull_blocks")
        if prepared is not None and prepared.plan.on_host:
            if not self.turns.acquire(blocking=False):
                served, outcome = self._queue(_Job(key, planner, push, prepared, deadline, op, start))
                if served:
                    return outcome
        else:
            self._take(op, start, deadline)
        try:
            self.check_alive()
            done = self._transfer_locked(key, planner, push, deadline, prepared)
        except BaseException as exc:
            self.meter.failed(op, exc, start)
            raise
        else:
            self.meter.moved(op, done.nbytes, start)
            return done
        finally:
            self.let_go()

    def _queue(self, job: _Job) -> tuple[bool, Prepared]:
        """Wait in line for the link (:mod:`.turns`): whether the holder ran ``job`` (and
        counted it), with its outcome then (an error is raised); not served: this thread
        holds the lock now."""
        try:
            served, outcome = self.turns.submit(job, max(0.0, job.deadline - time.monotonic()))
        except Unserved:
            self.meter.refused(job.op, job.start, self._busy_error())
        if served:
            if isinstance(outcome, Unserved):  # the thread that took it was interrupted
                self.meter.refused(job.op, job.start, EngineError(
                    Fault.FAILED, f"a transfer queued on the link to cluster {self.remote_cluster_id} "
                                  f"did not run: {outcome}"))
            if isinstance(outcome, BaseException):
                raise outcome
        return served, outcome

    def _take(self, op: str, start: float, deadline: float, transfers: int = 1) -> None:
        """Take the link's lock before ``deadline``, else count ``transfers`` failed and raise."""
        if not self.turns.acquire(blocking=False) and \
                not self.turns.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self.meter.refused(op, start, self._busy_error(), transfers)

    def transfer_batch(self, key: Union[CacheRef, RemoteCache], planners: Sequence[Callable[[RemoteCache], Plan]],
                       push: bool, prepared: Sequence[Optional[Prepared]], op: str = "") -> list[Prepared]:
        """:meth:`transfer` of several plans against one peer cache in one go (over a
        socket, pushes pipeline: one round trip for all); ``prepared[i]`` as ``prepared`` of
        :meth:`transfer`.  A plan refused as stale, or planned from a cached lookup the
        peer no longer agrees with, is done again on its own; the first other error is
        raised once the batch is through (the other plans have moved).  Every plan is made
        before any moves, so a planner's refusal moves nothing.  Each plan counts as one
        transfer of ``op``, its latency the batch's."""
        start = time.monotonic()
        deadline = start + self.timeout_ms / 1000.0
        op = op or ("push_blocks" if push else "pull_blocks")
        jobs = [_Job(key, planner, push, p, deadline, op, start) for planner, p in zip(planners, prepared)]
        self._take(op, start, deadline, len(jobs))
        try:
            try:
                self.check_alive()
                current = [self._reuse_or_plan(job) for job in jobs]
                outcomes: Sequence[Union[Prepared, BaseException]] = self._move(jobs, current, deadline)
            except BaseException as exc:
                outcomes = [exc] * len(jobs)
            self.meter.settled(jobs, outcomes)
        finally:
            self.let_go()
        errors = [outcome for outcome in outcomes if not isinstance(outcome, Prepared)]
        if errors:
            raise errors[0]
        return outcomes  # type: ignore[return-value]

    def _serve_jobs(self, jobs: list[_Job]) -> list[Union[Prepared, BaseException]]:
        """What the link's holder runs for the transfers queued behind it (:mod:`.turns`):
        one outcome per job, each planned (if its plan went stale) and moved as
        :meth:`transfer` would, the moves in one batch, and counted.  Never raises."""
        outcomes: list[Union[Prepared, BaseException]] = []
        try:
            self.check_alive()
            current: list[Union[tuple[Prepared, bool], BaseException]] = []
            for job in jobs:
                try:
                    current.append(self._reuse_or_plan(job))
                except Exception as exc:
                    current.append(exc)
            planned = [(job, c) for job, c in zip(jobs, current) if not isinstance(c, BaseException)]
            moved = iter(self._move([j for j, _ in planned], [c for _, c in planned],
                                    min(job.deadline for job in jobs)))
            outcomes = [c if isinstance(c, BaseException) else next(moved) for c in current]
        except Exception as exc:
            outcomes += [exc] * (len(jobs) - len(outcomes))
        self.meter.settled(jobs, outcomes)
        return outcomes

    def _move(self, jobs: Sequence[_Job], current: Sequence[tuple[Prepared, bool]],
              deadline: float) -> list[Union[Prepared, Exception]]:
        """Run prepared transfers as one batch of the transport (the link held): each one's
        prepared transfer, or its error.  A step refused as stale, or failing in a way a
        cached lookup can cause, is looked up, planned and run again on its own."""
        outcomes = self._bound().run_batch(self, [p.step for p, _ in current], deadline)
        done: list[Union[Prepared, Exception]] = []
        for job, (prepared, from_cache), outcome in zip(jobs, current, outcomes):
            if _retry(outcome, from_cache):
                try:
                    done.append(self._transfer_locked(job.key, job.planner, job.push, job.deadline, None))
                except Exception as exc:
                    done.append(exc)
                continue
            error = self._settle(prepared, outcome, job.push)
            done.append(prepared if error is None else error)
        return done

    def _reuse_or_plan(self, job: _Job) -> tuple[Prepared, bool]:
        """The job's prepared transfer while the peer's cache is as it was planned against,
        else a new plan; with whether it rests on a cached lookup.  A planner that refuses
        a cached lookup is asked again with a fresh one, and what it refuses then is
        raised, before anything moves."""
        prepared = job.prepared
        if prepared is not None and self._current(prepared.remote):
            return prepared, True
        got = self._plan(job.key, job.planner, job.push, job.deadline, True) or \
            self._plan(job.key, job.planner, job.push, job.deadline, False)
        assert got is not None  # a fresh lookup's refusal raises
        return got

    def _settle(self, prepared: Prepared, outcome: bool | Exception, push: bool) -> Optional[EngineError]:
        """Tell the receiver of a one-sided push into a watched cache how it went; the
        error of a failed step (None if it went through)."""
        error = outcome if isinstance(outcome, EngineError) else None
        if push and prepared.remote.watched and (error is not None or not outcome):
            self._notify(prepared.remote, prepared.plan, error.fault if error else Fault.OK, str(error or ""))
        return error

    def prepare(self, key: Union[CacheRef, RemoteCache], planner: Callable[[RemoteCache], Plan],
                push: bool) -> Prepared:
        """Look ``key`` up and plan against it, moving nothing (errors as :meth:`transfer`
        would raise them); :meth:`transfer` runs the result as ``prepared``."""
        deadline = time.monotonic() + self.timeout_ms / 1000.0
        self.take_turn(deadline)
        try:
            self.check_alive()
            remote = key if isinstance(key, RemoteCache) else self.lookup(key, deadline)[0]
            return self._bind(remote, planner(remote), push)
        finally:
            self.let_go()

    def take_turn(self, deadline: float) -> None:
        """Hold the link (in turn) before ``deadline``, else raise ``LLM_TIMEOUT``."""
        if not self.turns.acquire(blocking=False) and \
                not self.turns.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise self._busy_error()

    def _busy_error(self) -> EngineError:
        return EngineError(Fault.TIMEOUT, f"link to cluster {self.remote_cluster_id} stayed busy with other "
                                          f"transfers for sync_kv_timeout ({self.timeout_ms} ms)")

    def let_go(self) -> None:
        """Let go of the link (serving the transfers queued behind it); a link closed
        while this thread held it is released now.  Every holder but :meth:`close` itself
        lets go through here."""
        self.turns.release()
        self.turn_over()  # after release(): the rounds it served have moved too
        if self._release_when_idle:
            self.close(wait=False)

    def _bound(self) -> Transport:
        """The link's transport (a collective link gets one once its process group exists)."""
        transport = self.transport
        if transport is None:
            fail(Fault.NOT_LINKED, f"link to cluster {self.remote_cluster_id} has no transport yet")
        return transport

    def _bind(self, remote: RemoteCache, plan: Plan, push: bool) -> Prepared:
        return Prepared(remote, plan, self._bound().prepare(self, plan, remote, push))

    def _plan(self, key: Union[CacheRef, RemoteCache], planner: Callable[[RemoteCache], Plan], push: bool,
              deadline: float, cached: bool) -> Optional[tuple[Prepared, bool]]:
        """Look ``key`` up (from the cache of lookups if ``cached``) and plan against it:
        the prepared transfer and whether the lookup came from the cache; None if the
        planner refused a cached lookup (the peer may have replaced that cache since)."""
        if isinstance(key, RemoteCache):
            remote, from_cache = key, False
        else:
            remote, from_cache = self.lookup(key, deadline, cached=cached)
        try:
            plan = planner(remote)
        except Exception:
            if not from_cache:
                raise
            return None
        return self._bind(remote, plan, push), from_cache

    def _transfer_locked(self, key: Union[CacheRef, RemoteCache], planner: Callable[[RemoteCache], Plan],
                         push: bool, deadline: float, prepared: Optional[Prepared]) -> Prepared:
        """:meth:`transfer` with the link's lock held: look up, plan, move; a lookup found
        stale is redone (the peer's caches changed), at most twice."""
        stale_retries = 2
        cached = True
        while True:
            if prepared is not None and self._current(prepared.remote):
                current, from_cache = prepared, True
            else:
                got = self._plan(key, planner, push, deadline, cached)
                cached = True
                if got is None:
                    cached = False  # the planner refused a cached lookup: ask the peer
                    continue
                current, from_cache = got
            prepared = None
            try:
                if not current.step(deadline) and push and current.remote.watched:
                    self._notify(current.remote, current.plan, Fault.OK, "")
                return current
            except StaleLookup:
                # The peer's caches changed between lookup and request: look again.
                stale_retries -= 1
                if not stale_retries:
                    fail(Fault.CACHE_NOT_FOUND, f"cache behind {key} on cluster {self.remote_cluster_id} kept changing")
                cached = False
            except EngineError as exc:
                # A cached lookup may describe a cache the peer has since replaced
                # (socket peers share no epoch to check before planning): ask once
                # more before reporting the error.
                if not from_cache or exc.fault not in _RETRYABLE:
                    if push and current.remote.watched:
                        self._notify(current.remote, current.plan, exc.fault, str(exc))
                    raise
                cached = False

    def _notify(self, remote: RemoteCache, plan: Plan, status: Fault, message: str) -> None:
        """Tell the receiver what a push wrote (one-way; see ``datadist._arrivals``).  A
        notice that cannot be sent is dropped: the link is broken then, and the receiver's
        waits on this cluster fail by that."""
        if self.broken is not None or self.req_sock is None or plan.lens.shape[0] == 0:
            return
        lo, hi = tensor_span(remote.addrs, plan.dst_bases, plan.dst_offs, plan.lens)
        frame = wire.encode(wire.Notify(cluster_id=self.local_cluster_id, cache_id=remote.cache_id, t_lo=lo, t_hi=hi,
                                        nbytes=plan.nbytes, status=int(status), message=message[:200]))
        try:
            self.req_sock.settimeout(self.timeout_ms / 1000.0)
            self.req_sock.sendall(frame)
        except OSError as exc:
            self.mark_broken(f"connection failed: {exc}")

    def send_note(self, text: str) -> None:
        """Send an application note to the peer (one-way, in order with this link's
        requests); a link that cannot carry it is broken and the error says so."""
        if not self.is_client:
            fail(Fault.NOT_LINKED,
                        f"cluster {self.remote_cluster_id} linked to this engine, not the other way round; "
                        "notifications go from the engine that called link_clusters to the one it linked to")
        deadline = time.monotonic() + self.timeout_ms / 1000.0
        self.turns.acquire()
        try:
            self.check_alive()
            sock = self._request_sock()
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.sendall(wire.encode(wire.Note(text=text)))
            except OSError as exc:
                self._fail(exc)
        finally:
            self.let_go()

    def release_key(self, key: CacheRef) -> None:
        """Tell the owner that ``key`` was consumed (pull_cache through a CacheKey)."""
        deadline = time.monotonic() + self.timeout_ms / 1000.0
        self.turns.acquire()
        try:
            reply = self.rpc(key.release_message(), deadline)
        finally:
            self.let_go()
        if not isinstance(reply, wire.Reply):
            self.protocol_error(reply)

    # -- teardown ------------------------------------------------------------------------
    def close(self, reason: Optional[str] = None, *, wait: bool = True, goodbye: bool = False) -> None:
        """The one way a link ends (-> CLOSED, :mod:`.link_state`): end both streams,
        which makes a transfer in flight fail fast, then give back sockets, mappings and
        transport (which otherwise keep a dead peer's pool memory alive); the link stays
        known, so later calls name the cause.  Idempotent, any thread.

        ``reason``: the link failed first (the peer is gone: :meth:`mark_broken`).
        ``wait``: wait (bounded by the transfer deadline) for a transfer in flight, so no
        copy ever runs against an unmapped peer arena; without it (the agent thread, which
        must not block) a transfer in flight gives them back as it lets go of the link.
        ``goodbye`` (``finalize``): first tell a live, idle peer with a one-way ``UNLINK``
        whose answer is not awaited (a stalled peer cannot delay the caller; the peer
        takes the end of the streams as a normal unlink)."""
        if goodbye:
            self._say_goodbye()
        if reason is not None:
            self.mark_broken(reason)
        if self.state is LinkState.CLOSED:
            return
        self._shutdown()
        got = self.turns.acquire(blocking=False) or \
            (wait and self.turns.acquire(timeout=self.timeout_ms / 1000.0 + 1.0))
        if not got and not wait:
            self._release_when_idle = True
            # The holder may have let go between the try above and the flag (it checks the
            # flag after letting go): try once more, else whoever holds the link now sees it.
            if not self.turns.acquire(blocking=False):
                return
            got = True
        try:
            self._release()
        finally:
            if got:
                self.turns.release()

    def _say_goodbye(self) -> None:
        if self.broken is not None or self.req_sock is None or not self.turns.acquire(blocking=False):
            return
        try:
            self.mark_closing()
            self.req_sock.settimeout(0.1)
            self.req_sock.sendall(wire.encode(wire.Unlink(cluster_id=self.local_cluster_id)))
        except OSError:
            pass  # the peer is gone or stuck: it finds out from the closed stream
        finally:
            self.turns.release()

    def _shutdown(self) -> None:
        for sock in (self.req_sock, self.serve_sock):
            if sock is not None:
                shut_down(sock)

    def _release(self) -> None:
        self._release_when_idle = False
        if not self.closed():
            return
        if self.metrics is not None:
            self.metrics.released(self.meter)  # its counts stay in the engine's totals
        self.peer_epoch_addr = None
        for sock in (self.req_sock, self.serve_sock):
            if sock is not None and not (sock is self.serve_sock and self.leave_serve(sock)):
                sock.close()
        if self.transport is not None:
            self.transport.close()
        self.store = None


def shut_down(sock: socket.socket) -> None:
    """End both directions of ``sock``'s connection, so that a thread blocked on it fails
    at once.  A TLS socket is shut down beneath its TLS state (``SSLSocket.shutdown`` drops
    that state, and a thread still reading would then take raw ciphertext for data)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass
