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
"""
from __future__ import annotations

import contextlib
import socket

from ..errors import Fault, fail
from .. import native, wire
from ..layout import Plan
from .base import Channel, RemoteCache, Step, Transport, check_reply
from .local import host_side

__all__ = ["TcpTransport", "serve_push", "pull_payload", "drain"]

_DRAIN_CHUNK = 1 << 20


class TcpTransport(Transport):
    name = "tcp"

    def push(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> bool:
        with host_side(plan, local_is_src=True) as host_plan:
            check_reply(link, link.rpc(_push_frame(plan, remote), deadline, send_plan=host_plan))
        return True

    def pull(self, link: Channel, plan: Plan, remote: RemoteCache, deadline: float) -> None:
        check_reply(link, link.rpc(_pull_frame(plan, remote), deadline))
        with host_side(plan, local_is_src=False) as host_plan:
            self._receive(link, host_plan, deadline)

    def prepare(self, link: Channel, plan: Plan, remote: RemoteCache, push: bool) -> Step:
        """A host plan's request frame is encoded once (the peer's agent, in turn,
        recognizes a frame it admitted before); device plans stage on every run."""
        if not plan.on_host:
            return super().prepare(link, plan, remote, push)
        if push:
            frame = _push_frame(plan, remote)

            def push_step(deadline: float) -> bool:
                check_reply(link, link.rpc(frame, deadline, send_plan=plan))
                return True

            return push_step
        frame = _pull_frame(plan, remote)

        def pull_step(deadline: float) -> bool:
            check_reply(link, link.rpc(frame, deadline))
            self._receive(link, plan, deadline)
            return True

        return pull_step

    @staticmethod
    def _receive(link: Channel, plan: Plan, deadline: float) -> None:
        sock = link.req_sock
        if sock is None:
            fail(Fault.NOT_LINKED, f"link to cluster {link.remote_cluster_id} is not ready yet")
        try:
            native.sock_recv(sock.fileno(), plan, native.ms_until(deadline))
        except TimeoutError:
            link.mark_broken("deadline passed mid-pull")
            fail(Fault.TIMEOUT,
                        f"pull from cluster {link.remote_cluster_id} did not finish within sync_kv_timeout "
                        f"({link.timeout_ms} ms); the link is marked broken")
        except OSError as exc:
            link.mark_broken(f"connection failed: {exc}")
            fail(Fault.LINK_FAILED, f"link to cluster {link.remote_cluster_id} is broken: {exc}")


def _push_frame(plan: Plan, remote: RemoteCache) -> bytes:
    """The ``PUSH`` frame of ``plan`` (the peer's half: where the bytes go)."""
    return wire.encode(wire.Push(cache_id=remote.cache_id, epoch=remote.epoch, nbytes=plan.nbytes,
                                 arrays=[plan.dst_bases, plan.dst_offs, plan.lens]))


def _pull_frame(plan: Plan, remote: RemoteCache) -> bytes:
    """The ``PULL`` frame of ``plan`` (the peer's half: where the bytes come from)."""
    return wire.encode(wire.Pull(cache_id=remote.cache_id, epoch=remote.epoch, nbytes=plan.nbytes,
                                 arrays=[plan.src_bases, plan.src_offs, plan.lens]))


# -- the serve half (the peer's agent thread) ---------------------------------------------
def serve_push(sock: socket.socket, plan: Plan, timeout_ms: int) -> None:
    """Receive a pushed payload from ``sock`` into the local runs of ``plan`` (a device
    cache through one host staging buffer)."""
    with host_side(plan, local_is_src=False) as host_plan:
        native.sock_recv(sock.fileno(), host_plan, timeout_ms)


def pull_payload(plan: Plan, scope: contextlib.ExitStack) -> Plan:
    """The host plan whose bytes answer a pull of ``plan`` (a device cache is copied to
    a host staging buffer that lives as long as ``scope``)."""
    return scope.enter_context(host_side(plan, local_is_src=True))


def drain(sock: socket.socket, nbytes: int, timeout_ms: int) -> None:
    """Read and discard a refused push's payload, keeping the stream in step."""
    scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK)))
    left = nbytes
    while left > 0:
        n = min(left, len(scratch))
        native.recv_exact(sock.fileno(), scratch[:n], timeout_ms)
        left -= n
