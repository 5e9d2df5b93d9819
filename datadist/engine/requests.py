"""What a linked peer may ask of this engine, and how each request is answered.

The agent reads one frame from a link's serve stream and hands it to
:class:`RequestHandler`, which looks the message type up in a table: lookups
(``RESOLVE``), key releases, the checksums of one-sided copies (``SUM``), transfers
(``PUSH``/``PULL``: validated here against the registry, then served by the serve half of
the transport that carries the bytes: the stream's (:mod:`.transports.tcp`) or the link's
process group (:mod:`.transports.collective`)), ``UNLINK``, and the one-way ``NOTIFY``/``NOTE``.

A handler returns the reply to send (None: nothing), and for a pull the host plan whose
bytes follow the reply in the same ``writev`` (:attr:`RequestHandler.payload`).  Anything
a hostile request provokes raises, and the agent retires that one link.
"""
from __future__ import annotations

import contextlib
import functools
import socket
from ssl import SSLSocket
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Union

import numpy as np

from . import fences, native, wire
from .arrivals import Notice
from .errors import EngineError, Fault
from .layout import Plan, tensor_span
from .link import Link
from .memo import remember
from .peer_plans import device_holding, runs_inside
from .registry import CacheRecord, Registry
from .transports import checked, tcp
from .transports.base import ANY_CACHE, STALE
from .transports.collective import VIA_COLLECTIVE, CollectiveTransport

if TYPE_CHECKING:
    from .notes import NoteBox

__all__ = ["RequestHandler", "SERVED", "OK"]

#: What a linked peer may send on its request stream.
SERVED = (wire.MsgType.RESOLVE, wire.MsgType.RELEASE_KEY, wire.MsgType.PUSH, wire.MsgType.PULL,
          wire.MsgType.SUM, wire.MsgType.UNLINK, wire.MsgType.NOTIFY, wire.MsgType.NOTE, wire.MsgType.FENCE)


#: The answer to a request that went through (sent as ``wire.OK_FRAME``).
OK = wire.OK
#: Transfer frames remembered once admitted, and the largest remembered (whole frame).
_ADMIT_MEMO = 256
_ADMIT_FRAME = 4096


class _Admitted(NamedTuple):
    """A socket transfer request that passed its checks: the registry epoch it was
    checked at, the cache, the request and its local plan half."""

    epoch: int
    rec: Optional[CacheRecord]
    msg: wire.Push
    plan: Plan

    def known(self) -> "Union[_Admitted, _Served]":
        """What the memory of admitted frames keeps for this request: for a host plan the
        tuple the C fast path serves from (:func:`native.serve_known`; a summed one too,
        up to its size limit), else itself (the Python path serves it: staging device
        memory)."""
        plan, push = self.plan, not isinstance(self.msg, wire.Pull)
        bases, offs = (plan.dst_bases, plan.dst_offs) if push else (plan.src_bases, plan.src_offs)
        if not plan.on_host or not plan.lens.shape[0] or not bases.shape[0]:
            return self
        if isinstance(self.msg, wire.Sum):
            return (self.epoch, _SUM, self, bases, offs, plan.lens, _SUMMED, _SUMMED_AT)
        return (self.epoch, int(push), self, bases, offs, plan.lens, self.msg.summed)


#: ``(epoch, kind, admitted, bases, offs, lens, summed)``: an admitted host-memory transfer
#: as the C fast path serves it (kind 0 a pull, 1 a push); a ``SUM`` is
#: ``(epoch, 2, admitted, bases, offs, lens, answer, at)``: its ``SUMMED`` answer with the
#: checksum written at byte ``at``.
_Served = Union[tuple[int, int, _Admitted, np.ndarray, np.ndarray, np.ndarray, bool],
                tuple[int, int, _Admitted, np.ndarray, np.ndarray, np.ndarray, bytes, int]]
_SUM = 2
_SUMMED = wire.encode(wire.Summed(checksum=0))
_SUMMED_AT = next(i for i, (a, b) in enumerate(zip(_SUMMED, wire.encode(wire.Summed(checksum=(1 << 64) - 1))))
                  if a != b)
_Handler = Callable[[Link, wire.Message, socket.socket], Optional[wire.Message]]


class RequestHandler:
    """Answers the requests of linked peers against one engine's registry (agent thread)."""

    def __init__(self, registry: Registry, notes: "NoteBox", timeout_ms: int) -> None:
        self.registry = registry
        self.notes = notes
        self.timeout_ms = timeout_ms
        #: The host plan whose bytes follow the current reply (a pull), if any, and whether
        #: its checksum is to follow it (:mod:`.transports.checked`).
        self.payload: Optional[Plan] = None
        self.payload_summed = False
        self._scope: Optional[contextlib.ExitStack] = None
        #: Set by the agent while other links wait: a transfer whose bytes would wait for
        #: the peer (a push's payload not all arrived, a pull's answer larger than the free
        #: send buffer) is then not served here but left in :attr:`deferred`.
        self.may_defer = False
        #: The rest of such a transfer, returning its reply (a pull's :attr:`payload`
        #: follows it), for the agent to run on a thread of its own: a peer that stops
        #: sending or reading mid-way must not hold the thread that serves every link for
        #: ``sync_kv_timeout``.
        self.deferred: Optional[Callable[[], wire.Message]] = None
        #: The socket transfer the current request was admitted as (set by ``_transfer``).
        self._admitted: Optional[_Admitted] = None
        #: Transfer frames admitted before, by their bytes (:meth:`serve_known`, :meth:`handle_frame`).
        self._known: dict[bytes, Union[_Admitted, _Served]] = {}
        self._table: dict[type[wire.Message], _Handler] = {
            wire.Resolve: self._resolve, wire.ReleaseKey: self._release_key, wire.Push: self._transfer,
            wire.Pull: self._transfer, wire.Sum: self._sum, wire.Unlink: self._unlink, wire.Notify: self._notify, wire.Note: self._note,
            wire.Fence: self._fence,
        }

    def handle(self, link: Link, msg: wire.Message, sock: socket.socket,
               scope: contextlib.ExitStack) -> Optional[wire.Message]:
        """The reply to ``msg`` (None: none is sent).  Staging buffers of the request live
        in ``scope``, which the caller closes once the reply and its payload are sent."""
        self.payload, self._scope = None, scope
        handler = self._table.get(type(msg))
        if handler is None:
            raise wire.WireError(f"unexpected request {type(msg).__name__}")
        return handler(link, msg, sock)

    def serve_known(self, link: Link, sock: socket.socket) -> Optional[wire.Frame]:
        """Serve the next request of ``link`` if it is a socket transfer whose frame is byte
        for byte one admitted before, while this engine's caches have not changed since
        (the frame names the registry's epoch it was planned at, and every change of the
        caches moves it): in one C call, the frame read, recognized and its payload moved
        (a repeated small transfer then costs the agent little more than its system calls).
        Returns None when served, else the frame as read, for :meth:`handle_frame`.  TLS
        links read their frame here and are served by :meth:`handle_frame`."""
        if isinstance(sock, SSLSocket):
            return wire.read_frame(sock, SERVED, keep=_ADMIT_FRAME)
        status, got, *sums = native.serve_known(sock.fileno(), self._known, self.registry.epoch, wire.HEADER_SIZE,
                                                _ADMIT_FRAME, self.timeout_ms, wire.OK_FRAME, self.may_defer)
        if status == 0:
            admitted: _Admitted = got
            if not isinstance(admitted.msg, (wire.Pull, wire.Sum)):
                self._arrived(link, admitted.rec, admitted.msg)
            return None
        if status == 3:  # a summed push arrived damaged: refused, and nobody learns of an arrival
            refusal = checked.refusal(self._push_from(link), got.msg.nbytes, *sums)
            sock.sendall(wire.encode(refusal))  # a served socket waits up to the engine's timeout
            return None
        return wire.read_frame(sock, SERVED, got=got, keep=_ADMIT_FRAME)

    @staticmethod
    def frame_of(data: bytes) -> wire.Frame:
        """The frame of a request read whole already (:mod:`.gather`), for :meth:`handle_frame`."""
        return wire.whole_frame(data, SERVED, keep=_ADMIT_FRAME)

    def handle_frame(self, link: Link, frame: wire.Frame, sock: socket.socket,
                     scope: contextlib.ExitStack) -> Optional[wire.Message]:
        """:meth:`handle` of a frame as read (:meth:`serve_known`).  A socket transfer whose
        frame was admitted before, while the caches have not changed since, is served
        without decoding or checking it again; one admitted now is remembered."""
        cls, key = frame.cls, frame.raw
        if key is not None and (cls is wire.Push or cls is wire.Pull):
            hit = self._known.get(key)
            admitted = hit if hit is None or isinstance(hit, _Admitted) else hit[2]
            if admitted is not None and admitted.epoch == self.registry.epoch:
                self.payload, self._scope = None, scope
                return self._serve_socket(link, admitted, sock)
        msg = wire.decode_frame(cls, frame.data, frame.blen)
        self._admitted = None
        reply = self.handle(link, msg, sock, scope)
        admitted = self._admitted
        if key is not None and admitted is not None and admitted.msg.cache_id != ANY_CACHE:
            remember(self._known, key, admitted.known(), _ADMIT_MEMO)
        return reply

    # -- lookups -------------------------------------------------------------------------
    def _resolve(self, link: Link, msg: wire.Message, sock: socket.socket) -> wire.Message:
        assert isinstance(msg, wire.Resolve)
        reg = self.registry
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

    def _release_key(self, link: Link, msg: wire.Message, sock: socket.socket) -> wire.Message:
        assert isinstance(msg, wire.ReleaseKey)
        # Only keys of pool-allocated caches are consumed by a pull (as in CANN);
        # keys of registered memory stay until the owner removes them.
        try:
            rec, _ = self.registry.resolve("key", cluster_id=msg.cluster_id, req_id=msg.req_id,
                                           model_id=msg.model_id, prefix_id=msg.prefix_id)
        except EngineError:
            return wire.Reply()
        if rec.release is not None:
            self.registry.remove_key(msg)
        return wire.Reply()

    # -- transfers -----------------------------------------------------------------------
    def _transfer(self, link: Link, msg: wire.Message, sock: socket.socket) -> Optional[wire.Message]:
        assert isinstance(msg, wire.Push)  # a Pull is a Push
        rec = self.registry.get(msg.cache_id)
        status, why, device = self._check(rec, msg)
        if msg.via == VIA_COLLECTIVE:
            return self._serve_collective(link, msg, sock, status, why, device)
        if status:
            if not isinstance(msg, wire.Pull):
                if status == int(Fault.PARAM_INVALID) and msg.nbytes > self._capacity(rec):
                    # A bad plan announcing more than this engine's caches hold: a broken or
                    # hostile peer, whose payload is not read (that could hold the agent for
                    # the whole timeout); answered, the link closes.  (A stale lookup is a
                    # race of a sound peer: drained, the link goes on.)
                    sock.sendall(wire.encode(wire.Reply(status=status, message=why)))
                    raise wire.WireError(f"refused a push of {msg.nbytes} bytes: {why}; its payload was not read")
                refusal = functools.partial(_drained, sock, msg, self.timeout_ms, wire.Reply(status=status, message=why))
                if self.may_defer and not _moves_now(sock, msg, True):
                    self.deferred = refusal  # a payload still arriving is drained off the agent thread
                    return None
                return refusal()
            return wire.Reply(status=status, message=why)
        bases, offs, lens = msg.arrays
        self._admitted = _Admitted(msg.epoch, rec, msg, Plan(bases, bases, offs, offs, lens, device, device))
        return self._serve_socket(link, self._admitted, sock)

    def _capacity(self, rec: Optional[CacheRecord]) -> int:
        """The most bytes a push into ``rec`` (None: any of this engine's caches) can carry."""
        recs = [rec] if rec is not None else self.registry.all()
        return sum(r.addrs.shape[0] * r.tensor_size for r in recs)

    def _sum(self, link: Link, msg: wire.Message, sock: socket.socket) -> wire.Message:
        """The checksum of a plan half, checked as a transfer's (:mod:`.transports.checked`:
        a one-sided copy's check), summed as this engine reads its memory now."""
        assert isinstance(msg, wire.Sum)
        rec = self.registry.get(msg.cache_id)
        status, why, device = self._check(rec, msg)
        if status:
            return wire.Summed(status=status, message=why)
        bases, offs, lens = msg.arrays
        self._admitted = _Admitted(msg.epoch, rec, msg, Plan(bases, bases, offs, offs, lens, device, device))
        return wire.Summed(checksum=checked.sum_half(bases, offs, lens, device))

    def _serve_socket(self, link: Link, admitted: _Admitted, sock: socket.socket) -> Optional[wire.Message]:
        """Serve a checked transfer whose bytes follow on the stream (push) or the reply
        (pull); one whose bytes would wait for the peer while :attr:`may_defer` is left
        in :attr:`deferred` (no reply now)."""
        msg = admitted.msg
        pull = isinstance(msg, wire.Pull)
        if pull:
            assert self._scope is not None
            self.payload = tcp.pull_payload(admitted.plan, self._scope)
            self.payload_summed = msg.summed
        if self.may_defer and not _moves_now(sock, msg, not pull):
            self.deferred = _answered if pull else functools.partial(self._receive_push, link, admitted, sock)
            return None
        return OK if pull else self._receive_push(link, admitted, sock)

    def _receive_push(self, link: Link, admitted: _Admitted, sock: socket.socket) -> wire.Message:
        """Receive a checked push's payload into its plan and answer it; a summed push
        whose checksum fails is answered ``LLM_LINK_FAILED``.  Touches nothing of this
        handler's own state: it may run off the agent thread (:attr:`deferred`)."""
        msg = admitted.msg
        if msg.summed:
            refused = checked.serve_push(sock, admitted.plan, self.timeout_ms, self._push_from(link))
            if refused is not None:
                return refused  # nothing arrived, as far as watchers of the cache learn
        else:
            tcp.serve_push(sock, admitted.plan, self.timeout_ms)
        self._arrived(link, admitted.rec, msg)
        return OK

    def _push_from(self, link: Link) -> str:
        """A push of ``link``'s peer, as messages name it."""
        return f"a push from cluster {link.remote_cluster_id} into cluster {self.registry.cluster_id}"

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
        assert isinstance(transport, CollectiveTransport)
        bases, offs, lens = msg.arrays
        if isinstance(msg, wire.Pull):
            transport.serve_pull(bases, offs, lens, msg.nbytes, self.timeout_ms, device)
            return None
        try:
            transport.serve_push(bases, offs, lens, msg.nbytes, self.timeout_ms, device)
        except RuntimeError as exc:  # torch.distributed: the initiator gave up or died
            return wire.Reply(status=int(Fault.LINK_FAILED), message=f"collective receive failed: {exc}")
        self._arrived(link, self.registry.get(msg.cache_id), msg)
        return wire.Reply()

    def _arrived(self, link: Link, rec: Optional[CacheRecord], msg: wire.Push) -> None:
        """A push this engine received went through: record it if the cache is watched
        (socket and collective pushes need no notice message)."""
        if rec is None or self.registry.watched(rec.cache_id) is None:
            return
        lo, hi = tensor_span(rec.addrs, *msg.arrays)
        self.registry.record_arrival(Notice(cluster_id=link.remote_cluster_id, cache_id=rec.cache_id,
                                            tensors=range(lo, hi), nbytes=msg.nbytes, status=Fault.OK))

    def _check(self, rec: Optional[CacheRecord], msg: wire.Push) -> tuple[int, str, str]:
        """``(0, "", device)`` for a plan half that lies inside the cache it names (or, for
        raw addresses, inside the caches of one device), the device being where its runs
        live; else the status and reason of the refusal (and ``"cpu"``)."""
        reg = self.registry
        if len(msg.arrays) != 3:
            return int(Fault.PARAM_INVALID), "malformed plan", "cpu"
        bases, offs, lens = msg.arrays
        # Bounded first (one C pass): sums of a peer's values must not wrap around 64 bits
        # and pass the bounds checks below while pointing anywhere in this process.
        extent = native.half_extent(bases, offs, lens)
        total, end = extent if extent is not None else (-1, -1)
        # One base per tensor, each once: a base named again and again multiplies what a
        # small frame makes this engine move, sum or stage.
        sized = extent is not None and total * bases.shape[0] == msg.nbytes and _distinct(bases)
        if msg.cache_id == ANY_CACHE:
            return self._check_raw(msg, sized)
        if msg.epoch != reg.epoch:  # first: a freed cache id may simply mean a stale lookup
            return STALE, "caches changed since the lookup", "cpu"
        if rec is None:
            return int(Fault.CACHE_NOT_FOUND), f"cache {msg.cache_id} does not exist (freed?)", "cpu"
        if not sized or bases.shape[0] > rec.num_tensors or not runs_inside(rec, bases, offs, lens, end):
            return int(Fault.PARAM_INVALID), f"plan reaches outside cache {rec.cache_id}", "cpu"
        if msg.nbytes > self._capacity(rec):
            return int(Fault.PARAM_INVALID), _too_much(msg.nbytes, f"cache {rec.cache_id}"), "cpu"
        return 0, "", rec.device

    def _check_raw(self, msg: wire.Push, sized: bool) -> tuple[int, str, str]:
        """:meth:`_check` of a plan half of raw addresses (``TransferConfig.dst_addrs``): no
        lookup that could be stale; the plan must lie inside the caches registered now."""
        reg = self.registry
        device = device_holding(reg.all(), *msg.arrays) if sized else None
        if device is None:
            return int(Fault.PARAM_INVALID), (f"plan reaches outside every cache of cluster {reg.cluster_id} "
                                              "(or across the memory of two devices)"), "cpu"
        if msg.nbytes > self._capacity(None):
            return int(Fault.PARAM_INVALID), _too_much(msg.nbytes, f"the caches of cluster {reg.cluster_id}"), "cpu"
        return 0, "", device

    # -- one-way and closing -------------------------------------------------------------
    def _fence(self, link: Link, msg: wire.Message, sock: socket.socket) -> Optional[wire.Message]:
        """The peer freed memory: answered once no copy of this end's that may still be
        using it is under way (one that is: answered off this thread, :mod:`.fences`)."""
        self.deferred = fences.answer_fence(link, self.timeout_ms)
        return wire.Reply() if self.deferred is None else None

    def _unlink(self, link: Link, msg: wire.Message, sock: socket.socket) -> wire.Message:
        link.mark_closing()  # the peer ends both streams next: expected, not a failure
        return wire.Reply()

    def _notify(self, link: Link, msg: wire.Message, sock: socket.socket) -> None:
        assert isinstance(msg, wire.Notify)
        rec = self.registry.get(msg.cache_id)
        if rec is None:  # freed meanwhile: nobody watches it
            return None
        if msg.cluster_id != link.remote_cluster_id or not 0 <= msg.t_lo <= msg.t_hi <= rec.num_tensors:
            # Watchers trust a notice's source and tensors (a wait intersects them): a peer
            # naming another cluster, or tensors the cache does not have, is broken or lying.
            raise wire.WireError(f"a NOTIFY from cluster {link.remote_cluster_id} named cluster {msg.cluster_id}, "
                                 f"tensors [{msg.t_lo}, {msg.t_hi}) of cache {rec.cache_id} "
                                 f"with {rec.num_tensors}")
        self.registry.record_arrival(Notice(cluster_id=msg.cluster_id, cache_id=msg.cache_id,
                                            tensors=range(msg.t_lo, msg.t_hi), nbytes=msg.nbytes,
                                            status=Fault.of(msg.status), message=msg.message))
        return None

    def _note(self, link: Link, msg: wire.Message, sock: socket.socket) -> None:
        assert isinstance(msg, wire.Note)
        self.notes.record(link.remote_cluster_id, msg.text)
        return None


def _moves_now(sock: socket.socket, msg: wire.Push, push: bool) -> bool:
    """Whether a transfer's bytes move without waiting for the peer: a push's payload
    (and its checksum) is all in ``sock``'s buffer already (a TLS socket: decrypted and
    waiting), a pull's answer fits the free send buffer (:func:`native.moves_now`)."""
    need = _on_stream(msg)
    if push and isinstance(sock, SSLSocket):
        return sock.pending() >= need
    return native.moves_now(sock.fileno(), push, need if push else need + len(wire.OK_FRAME))


def _drained(sock: socket.socket, msg: wire.Push, timeout_ms: int, reply: wire.Reply) -> wire.Message:
    """``reply`` to a refused push, once its payload is read and discarded (the stream
    stays in step)."""
    tcp.drain(sock, _on_stream(msg), timeout_ms)
    return reply


def _on_stream(msg: wire.Push) -> int:
    """The bytes a transfer moves on the stream besides its frames: its payload, and the
    checksum behind a summed one."""
    return msg.nbytes + (checked.TRAILER_SIZE if msg.summed else 0)


def _answered() -> wire.Message:
    """The rest of a pull handed off: its reply, which its payload follows."""
    return OK


def _too_much(nbytes: int, where: str) -> str:
    """Why a plan half naming ``nbytes`` is refused although each of its runs lies inside
    ``where``: runs named again and again (by offset; a base named twice is refused as
    such) make a small frame move, sum or stage any amount, so a plan half never names more
    bytes than the memory it lies in holds (runs repeated within that, one block pulled
    into several, stay allowed)."""
    return f"plan names {nbytes} bytes, more than {where} holds (runs repeated)"


def _distinct(bases: np.ndarray) -> bool:
    """Whether no base of a plan half repeats."""
    return bases.shape[0] < 2 or bool(np.unique(bases).shape[0] == bases.shape[0])
