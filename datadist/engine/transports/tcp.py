"""Socket links: the peer's agent streams bytes straight into or out of the cache memory.

A push is one ``PUSH`` frame carrying the peer's half of the plan, the payload right
behind it (``writev`` of the local runs), and one ``REPLY``; a pull is a ``PULL`` frame, a
``REPLY`` and the payload (``readv`` into the local runs).  One round trip per call; no
payload byte passes through a Python object.  Device memory cannot be read or written by
the socket calls: such a side is staged through one host buffer on either end
(:func:`~datadist.engine.transports.local.host_side`).
"""
from __future__ import annotations

import time

from ..errors import Fault, fail
from .. import native, wire
from ..layout import Plan
from .base import RemoteCache, Transport, check_reply
from .local import host_side

__all__ = ["TcpTransport"]


def _left_ms(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))


class TcpTransport(Transport):
    name = "tcp"

    def push(self, link, plan: Plan, remote: RemoteCache, deadline: float) -> bool:
        msg = wire.Push(cache_id=remote.cache_id, epoch=remote.epoch, nbytes=plan.nbytes,
                        arrays=[plan.dst_bases, plan.dst_offs, plan.lens])
        with host_side(plan, local_is_src=True) as host_plan:
            check_reply(link, link.rpc(msg, deadline, send_plan=host_plan))
        return True

    def pull(self, link, plan: Plan, remote: RemoteCache, deadline: float) -> None:
        msg = wire.Pull(cache_id=remote.cache_id, epoch=remote.epoch, nbytes=plan.nbytes,
                        arrays=[plan.src_bases, plan.src_offs, plan.lens])
        check_reply(link, link.rpc(msg, deadline))
        with host_side(plan, local_is_src=False) as host_plan:
            self._receive(link, host_plan, deadline)

    @staticmethod
    def _receive(link, plan: Plan, deadline: float) -> None:
        try:
            native.sock_recv(link.req_sock.fileno(), plan, _left_ms(deadline))
        except TimeoutError:
            link.mark_broken("deadline passed mid-pull")
            fail(Fault.TIMEOUT,
                        f"pull from cluster {link.remote_cluster_id} did not finish within sync_kv_timeout "
                        f"({link.timeout_ms} ms); the link is marked broken")
        except OSError as exc:
            link.mark_broken(f"connection failed: {exc}")
            fail(Fault.LINK_FAILED, f"link to cluster {link.remote_cluster_id} is broken: {exc}")
