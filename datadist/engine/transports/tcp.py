"""Socket links: the peer's agent streams bytes straight into or out of the cache memory.

A push is one ``PUSH`` frame carrying the peer's half of the plan, the payload right
behind it (``writev`` of the local runs), and one ``REPLY``; a pull is a ``PULL`` frame, a
``REPLY`` and the payload (``readv`` into the local runs).  One round trip per call; no
payload byte passes through a Python object.

The serve half (:func:`serve_push`, :func:`pull_payload`, :func:`drain`) is what the peer's
agent runs for those requests once they are validated
(:mod:`datadist.engine.requests`).  Device memory cannot be read or written by
the socket calls: such a side is staged through one host buffer on either end
(:func:`~datadist.engine.transports.local.host_side`).

With ``transfer_checksum`` the link's transport is :mod:`.checked`'s subclass: requests
ask for the payload's checksum behind it (``summed``), and both ends sum the payload while
moving it.

A link whose sockets are TLS (:mod:`datadist.engine.tls`) moves the same bytes in the same
order through a staging buffer instead (``tls.send_plan`` / ``tls.recv_plan``): the C
loops write raw descriptors, which would bypass TLS.
"""
from __future__ import annotations

import contextlib
import socket
import time
from ssl import SSLSocket
from typing import NoReturn

from ..errors import EngineError, Fault, fail
from .. import native, tls, wire
from ..layout import Plan
from .base import Channel, RemoteCache, StaleLookup, Step, Transport, check_reply
from .local import host_side

__all__ = ["TcpTransport", "PushStep", "push_frame", "pull_frame", "request_sock", "stream_failed", "serve_push",
           "pull_payload", "drain"]

_DRAIN_CHUNK = 1 << 20


def request_sock(link: Channel) -> socket.socket:
    """The link's request stream; ``LLM_NOT_YET_LINK`` before it has one."""
    sock = link.req_sock
    if sock is None:
        fail(Fault.NOT_LINKED, f"link to cluster {link.remote_cluster_id} is not ready yet")
    return sock


def stream_failed(link: Channel, exc: OSError, what: str) -> NoReturn:
    """A payload ``what`` (a push or a pull) failed mid-stream: the link is broken (the
    stream can no longer be trusted); ``LLM_TIMEOUT`` at the deadline, else ``LLM_LINK_FAILED``."""
    if isinstance(exc, TimeoutError):
        link.mark_broken(f"deadline passed mid-{what}")
        fail(Fault.TIMEOUT,
             f"{what} on the link to cluster {link.remote_cluster_id} did not finish within sync_kv_timeout "
             f"({link.timeout_ms} ms); the link is marked broken")
    link.mark_broken(f"connection failed: {exc}")
    fail(Fault.LINK_FAILED, f"link to cluster {link.remote_cluster_id} is broken: {exc}")


class PushStep:
    """A prepared push of a host plan: its frame encoded once (the peer's agent, in turn,
    recognizes a frame it admitted before).  Pipelines with others (:meth:`TcpTransport.run_batch`:
    :meth:`send` each, then read the answers)."""

    __slots__ = ("link", "frame", "plan")

    def __init__(self, link: Channel, frame: bytes, plan: Plan) -> None:
        self.link, self.frame, self.plan = link, frame, plan

    def send(self, deadline: float) -> None:
        """Send the frame and the payload, not reading the answer."""
        self.link.send_request(self.frame, deadline, self.plan)

    def __call__(self, deadline: float) -> bool:
        check_reply(self.link, self.link.rpc(self.frame, deadline, send_plan=self.plan))
        return True


class TcpTransport(Transport):
    name = "tcp"
    #: Whether requests ask for the payload's checksum behind it (:mod:`.checked`), and
    #: the step that sends a push (its frame, its payload) and reads the answer.
    summed = False
    _push_step: type[PushStep] = PushStep

    def push(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> bool:
        with host_side(plan, local_is_src=True) as host_plan:
            self._push_step(link, push_frame(plan, remote, self.summed), host_plan)(deadline)
        return True

    def pull(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> None:
        check_reply(link, link.rpc(pull_frame(plan, remote, self.summed), deadline))
        with host_side(plan, local_is_src=False) as host_plan:
            self._receive(link, host_plan, deadline)

    def prepare(self, link: Channel, plan: Plan, remote: RemoteCache, push: bool) -> Step:
        """A host plan's request frame is encoded once (the peer's agent, in turn,
        recognizes a frame it admitted before); device plans stage on every run."""
        if not plan.on_host:
            return super().prepare(link, plan, remote, push)
        if push:
            return self._push_step(link, push_frame(plan, remote, self.summed), plan)
        frame = pull_frame(plan, remote, self.summed)

        def pull_step(deadline: float) -> bool:
            check_reply(link, link.rpc(frame, deadline))
            self._receive(link, plan, deadline)
            return True

        return pull_step

    def run_batch(self, link: Channel, steps: list[Step], deadline: float) -> list[bool | Exception]:
        """Pushes go out back to back (frames and payloads), and their answers are read
        after, in order: one round trip for the batch.  Only pushes pipeline: their answers
        are a few bytes each, while a pull's payload follows its answer, and the peer
        writing payloads nobody reads yet could stall it while this end still writes
        requests.  Anything else runs step by step."""
        if len(steps) < 2 or not all(isinstance(s, PushStep) for s in steps):
            return super().run_batch(link, steps, deadline)
        for step in steps:
            assert isinstance(step, PushStep)
            step.send(deadline)
        outcomes: list[bool | Exception] = []
        for _ in steps:
            try:
                check_reply(link, link.read_reply(deadline))
                outcomes.append(True)
            except (StaleLookup, EngineError) as exc:
                outcomes.append(exc)
        return outcomes

    def _receive(self, link: Channel, plan: Plan, deadline: float) -> None:
        """Read a pull's payload (its ``REPLY`` read) into the local runs of ``plan``."""
        sock = request_sock(link)
        try:
            if isinstance(sock, SSLSocket):
                tls.recv_plan(sock, plan, deadline)
            else:
                native.sock_recv(sock.fileno(), plan, native.ms_until(deadline))
        except OSError as exc:  # TimeoutError is an OSError
            stream_failed(link, exc, "pull")


def push_frame(plan: Plan, remote: RemoteCache, summed: bool = False) -> bytes:
    """The ``PUSH`` frame of ``plan`` (the peer's half: where the bytes go); ``summed``:
    its payload is followed by its checksum."""
    return wire.encode(wire.Push(cache_id=remote.cache_id, epoch=remote.epoch, nbytes=plan.nbytes,
                                 arrays=[plan.dst_bases, plan.dst_offs, plan.lens], summed=summed))


def pull_frame(plan: Plan, remote: RemoteCache, summed: bool = False) -> bytes:
    """The ``PULL`` frame of ``plan`` (the peer's half: where the bytes come from);
    ``summed``: the peer's checksum is to follow the payload."""
    return wire.encode(wire.Pull(cache_id=remote.cache_id, epoch=remote.epoch, nbytes=plan.nbytes,
                                 arrays=[plan.src_bases, plan.src_offs, plan.lens], summed=summed))


# -- the serve half (the peer's agent thread) ---------------------------------------------
def serve_push(sock: socket.socket, plan: Plan, timeout_ms: int) -> None:
    """Receive a pushed payload from ``sock`` into the local runs of ``plan`` (a device
    cache through one host staging buffer)."""
    with host_side(plan, local_is_src=False) as host_plan:
        if isinstance(sock, SSLSocket):
            tls.recv_plan(sock, host_plan, time.monotonic() + timeout_ms / 1000.0)
        else:
            native.sock_recv(sock.fileno(), host_plan, timeout_ms)


def pull_payload(plan: Plan, scope: contextlib.ExitStack) -> Plan:
    """The host plan whose bytes answer a pull of ``plan`` (a device cache is copied to
    a host staging buffer that lives as long as ``scope``)."""
    return scope.enter_context(host_side(plan, local_is_src=True))


def drain(sock: socket.socket, nbytes: int, timeout_ms: int) -> None:
    """Read and discard a refused push's payload, keeping the stream in step, all of it
    within ``timeout_ms`` (``TimeoutError`` then: a peer trickling a large payload must
    not hold the agent, which serves every link, for longer)."""
    deadline = time.monotonic() + timeout_ms / 1000.0
    if isinstance(sock, SSLSocket):
        tls.discard(sock, nbytes, deadline)
        return
    scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK)))
    left = nbytes
    while left > 0:
        n = min(left, len(scratch))
        native.recv_exact(sock.fileno(), scratch[:n], native.ms_until(deadline))
        left -= n
