"""Socket links with end-to-end transfer integrity (option ``datadist.TransferChecksum``).

The sender of a payload sums it while it sends it, the receiver while it receives it, and
the sender's checksum follows the payload on the stream (8 bytes, little-endian: the
trailer).  A receiver whose sum differs fails the transfer: a push is answered with
``LLM_LINK_FAILED`` and its destination is not recorded as arrived; a pull raises
``LLM_LINK_FAILED`` to its caller.  Either way the message says "checksum mismatch" and
that the destination blocks were not written (whatever landed there is undefined).  The
stream itself is still in step after a mismatch, so the link stays up: the next transfer
may simply go again.

The checksum is the pool's (:mod:`datadist.engine.checksum`): per 4 KiB block of the
payload stream the sum and the position-weighted sum of its 64-bit words, then CRC-32 of
those sums, so a changed, lost, duplicated or reordered word changes it.  The C send and
receive loops add each system call's bytes to the sums right after moving them
(:func:`.native.sock_send` / :func:`.native.sock_recv` with a
:class:`~datadist.engine.checksum.StreamSum`), while they are still in the cache; a TLS
link sums its staging buffer.  The payload stream is the plan's runs in plan order on both
ends, so the two sums agree exactly when every byte arrived as it was sent.

The initiator of a transfer decides: its requests carry ``summed`` (:mod:`..wire`), and
the peer's agent honours that whatever its own setting.  Summed requests are served by
the agent's Python path, never by the C fast path for frames it admitted before.

One-sided copies (:mod:`.shm`) are checked the same way with the roles of the two sums
changed: the process that copies sums the bytes as it copies them (the plan's runs in plan
order, :func:`.native.copy_plan_stream`), and asks the owner of the other half for the
checksum of the same runs read by the owner's own reading of the request (``SUM``,
answered ``SUMMED``; :func:`sum_half` on the owner's agent thread), slice by slice
(:func:`one_sided`).  A wrong plan, a stale mapping of the peer's memory or a torn copy
gives two different sums.  A pull sends its
``SUM`` before it copies, so the owner sums while the copier copies: that checks the
bytes as they were when copied only while the owner does not write the source meanwhile,
which is how prefill/decode use a pull (the prefill's blocks are final once offered).  A
push asks after its copy, so the owner sums the destination as the copy left it.  A
mismatch fails the transfer with ``LLM_LINK_FAILED`` as above.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import struct
import time
from ssl import SSLSocket
from typing import Callable, Optional, Sequence

import numpy as np

from .. import native, tls, wire
from ..checksum import StreamSum
from ..errors import EngineError, Fault, fail
from ..layout import Plan
from .base import STALE, Channel, RemoteCache, StaleLookup, check_reply
from .device_sum import GPU_FROM, device_checksum
from .local import host_side
from .tcp import PushStep, TcpTransport, request_sock, stream_failed

__all__ = ["CheckedTcpTransport", "CheckedPushStep", "TRAILER_SIZE", "serve_push", "send_payload", "sum_half",
           "sum_request", "one_sided", "refusal"]

log = logging.getLogger("datadist")

_TRAILER = struct.Struct("<Q")
#: Bytes of the checksum behind a summed payload.
TRAILER_SIZE = _TRAILER.size
_EMPTY = np.zeros(0, dtype=np.uint64)
_NOTHING = Plan(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)
_NOT_WRITTEN = "the destination blocks of this transfer are not written (their contents are undefined)"


def _one_call(sock: socket.socket, plan: Plan) -> bool:
    """Whether a summed payload of ``plan`` and its checksum move through ``sock`` in one C
    call (a plain socket, 1 to ``native.FAST_SUMMED_MAX`` bytes), not in Python's steps."""
    return not isinstance(sock, SSLSocket) and 0 < plan.nbytes <= native.FAST_SUMMED_MAX


def send_payload(sock: socket.socket, plan: Plan, head: bytes, deadline: float) -> None:
    """Send ``head`` (a frame), the plan's source runs summed as they go, and then their
    checksum; ``OSError`` (``TimeoutError`` at ``deadline``) as the socket calls raise it."""
    if _one_call(sock, plan):
        native.send_summed(sock.fileno(), plan, native.ms_until(deadline), head)  # all of it in one C call
        return
    summed = StreamSum(plan.nbytes)
    if isinstance(sock, SSLSocket):
        tls.send_plan(sock, plan, deadline, head, summed)
        tls.send_plan(sock, _NOTHING, deadline, _TRAILER.pack(summed.checksum()))
        return
    native.sock_send(sock.fileno(), plan, native.ms_until(deadline), head, summed)
    native.sock_send(sock.fileno(), _NOTHING, native.ms_until(deadline), _TRAILER.pack(summed.checksum()))


def _receive(sock: socket.socket, plan: Plan, deadline: float) -> tuple[int, int]:
    """Read the plan's destination runs, summing them, and the checksum behind them:
    ``(checksum of what arrived, the sender's)``."""
    if _one_call(sock, plan):
        return native.recv_summed(sock.fileno(), plan, native.ms_until(deadline))  # all of it in one C call
    summed = StreamSum(plan.nbytes)
    trailer = bytearray(TRAILER_SIZE)
    if isinstance(sock, SSLSocket):
        tls.recv_plan(sock, plan, deadline, summed)
        tls.recv_exact(sock, trailer, max(0.001, deadline - time.monotonic()))
    else:
        native.sock_recv(sock.fileno(), plan, native.ms_until(deadline), summed)
        native.recv_exact(sock.fileno(), trailer, native.ms_until(deadline))
    sent: int = _TRAILER.unpack(trailer)[0]
    return summed.checksum(), sent


def _mismatch(what: str, nbytes: int, got: int, sent: int, moved: str = "received",
              theirs: str = "the sender's") -> str:
    return (f"checksum mismatch on {what}: the {nbytes} bytes {moved} sum to {got:#018x}, {theirs} "
            f"checksum is {sent:#018x}; {_NOT_WRITTEN}")


class CheckedPushStep(PushStep):
    """A push whose payload is followed by its checksum (the peer checks it)."""

    __slots__ = ()

    def send(self, deadline: float) -> None:
        try:
            send_payload(request_sock(self.link), self.plan, self.frame, deadline)
        except OSError as exc:  # TimeoutError is an OSError
            stream_failed(self.link, exc, "push")

    def __call__(self, deadline: float) -> bool:
        if _one_call(request_sock(self.link), self.plan):
            # frame, payload summed as it goes, its checksum and the answer: one C call
            check_reply(self.link, self.link.rpc(self.frame, deadline, send_plan=self.plan, summed=True))
            return True
        self.send(deadline)
        check_reply(self.link, self.link.read_reply(deadline))
        return True


class CheckedTcpTransport(TcpTransport):
    """tcp whose every payload carries its sender's checksum, checked by its receiver
    (see the module docstring)."""

    summed = True
    _push_step = CheckedPushStep

    def _receive(self, link: Channel, plan: Plan, deadline: float) -> None:
        try:
            got, sent = _receive(request_sock(link), plan, deadline)
        except OSError as exc:  # TimeoutError is an OSError
            stream_failed(link, exc, "pull")
        if got != sent:
            fail(Fault.LINK_FAILED, _mismatch(f"a pull from cluster {link.remote_cluster_id}", plan.nbytes, got, sent))


# -- the serve half (the peer's agent thread) ---------------------------------------------
def serve_push(sock: socket.socket, plan: Plan, timeout_ms: int, what: str) -> Optional[wire.Reply]:
    """Receive a summed push (``what``, for messages) into the local runs of ``plan`` (a
    device cache through one host staging buffer) and check it: None if it arrived
    intact, else the ``LLM_LINK_FAILED`` answer that says so (logged here too)."""
    with host_side(plan, local_is_src=False) as host_plan:
        got, sent = _receive(sock, host_plan, time.monotonic() + timeout_ms / 1000.0)
    return None if got == sent else refusal(what, plan.nbytes, got, sent)


def refusal(what: str, nbytes: int, got: int, sent: int) -> wire.Reply:
    """The ``LLM_LINK_FAILED`` answer to a summed push (``what``, for messages) of ``nbytes``
    whose bytes arrived summing to ``got`` against the sender's ``sent``; logged here."""
    why = _mismatch(what, nbytes, got, sent)
    log.error("%s", why)
    return wire.Reply(status=int(Fault.LINK_FAILED), message=why)


# -- one-sided copies (shm) ----------------------------------------------------------------
def sum_request(plan: Plan, remote: RemoteCache, push: bool) -> bytes:
    """The ``SUM`` frame that asks the owner for the checksum of its half of ``plan``."""
    bases, offs = (plan.dst_bases, plan.dst_offs) if push else (plan.src_bases, plan.src_offs)
    return wire.encode(wire.Sum(cache_id=remote.cache_id, epoch=remote.epoch, nbytes=plan.nbytes,
                                arrays=[bases, offs, plan.lens]))


def one_sided(link: Channel, frames: Sequence[bytes], sizes: Sequence[int], push: bool,
              copies: Sequence[Callable[[float], int]], deadline: float) -> None:
    """Run ``copies`` (one-sided copies of the slices of one transfer, each returning the
    checksum of what it copied) checked against the owner's checksums that ``frames``
    (:func:`sum_request`, one per slice of ``sizes`` bytes) ask for.  A pull sends them all
    before it copies (the owner sums while the copier copies); a push sends each right after
    its slice's copy, so the owner sums slice i while the copier copies slice i + 1.  The
    answers are read
    in order after the copies.  ``LLM_LINK_FAILED`` if a pair differs; the owner's refusal
    (a stale lookup, a freed cache) as for any request."""
    got: list[int] = []
    sent = 0
    try:
        if not push:
            for frame in frames:
                link.send_request(frame, deadline)
                sent += 1
        for i, copy in enumerate(copies):
            got.append(copy(deadline))
            if push:
                link.send_request(frames[i], deadline)
                sent += 1
    except BaseException:
        with contextlib.suppress(EngineError):  # keep the stream in step (or the link is broken)
            for _ in range(sent):
                link.read_reply(time.monotonic() + link.timeout_ms / 1000.0)
        raise
    replies = [link.read_reply(deadline) for _ in frames]
    for reply, mine, nbytes in zip(replies, got, sizes):
        _compare(link, reply, mine, nbytes, push)


def _compare(link: Channel, reply: wire.Message, got: int, nbytes: int, push: bool) -> None:
    if not isinstance(reply, wire.Summed):
        check_reply(link, reply)
        link.protocol_error(reply)
    if reply.status == STALE:
        raise StaleLookup(reply.message)
    if reply.status:
        fail(Fault.of(reply.status), reply.message)
    if reply.checksum != got:
        what = f"a {'push to' if push else 'pull from'} cluster {link.remote_cluster_id} (shared memory)"
        fail(Fault.LINK_FAILED, _mismatch(what, nbytes, got, reply.checksum, "copied", "the owner's"))


def sum_half(bases: np.ndarray, offs: np.ndarray, lens: np.ndarray, device: str) -> int:
    """The checksum of the runs of a plan half of this process's memory, in plan order:
    the owner's side of a ``SUM``, and a device copy's own.  CUDA halves of
    :data:`.device_sum.GPU_FROM` bytes or more are summed on the GPU
    (:func:`.device_sum.device_checksum`); other device halves through one host staging
    buffer."""
    half = Plan(bases, bases, offs, offs, lens, device, device)
    if device.startswith("cuda") and half.nbytes >= GPU_FROM:
        return device_checksum(bases, offs, lens, device)
    summed = StreamSum(half.nbytes)
    with host_side(half, local_is_src=True) as host_plan:
        native.sum_plan(host_plan.src_bases, host_plan.src_offs, host_plan.lens, summed, native.COPY_THREADS)
    return summed.checksum()
