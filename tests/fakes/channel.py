"""A link's control channel in memory: what a transport sent, and scripted answers."""
from __future__ import annotations

import socket
from collections import deque
from typing import Callable, Deque, List, NoReturn, Optional, Tuple, Union

from datadist.engine import wire
from datadist.engine.errors import Fault, fail
from datadist.engine.layout import Plan

Answer = Union[wire.Message, Callable[[wire.Message, Optional[Plan]], wire.Message]]


class FakeChannel:
    """Implements :class:`~datadist.engine.transports.base.Channel`.

    ``answers`` are replies in order: a message, or a function of (request, plan whose
    bytes followed it) that returns one (e.g. one that copies the plan's bytes somewhere).
    ``sent`` records every request with its payload plan; ``broken`` the reason the
    transport gave up on the stream, if it did."""

    def __init__(self, answers: Tuple[Answer, ...] = (), remote_cluster_id: int = 2, timeout_ms: int = 1000,
                 peer_alive: bool = True) -> None:
        self.remote_cluster_id = remote_cluster_id
        self.timeout_ms = timeout_ms
        self.req_sock: Optional[socket.socket] = None
        self.answers: Deque[Answer] = deque(answers)
        self.sent: List[Tuple[wire.Message, Optional[Plan]]] = []
        self.broken: Optional[str] = None
        self.peer_alive = peer_alive
        self.pending: Deque[wire.Message] = deque()  # answers to requests sent, not yet read

    def _next(self, msg: wire.Message, plan: Optional[Plan]) -> wire.Message:
        if not self.answers:
            fail(Fault.LINK_FAILED, f"no scripted answer for {type(msg).__name__}")
        answer = self.answers.popleft()
        return answer(msg, plan) if callable(answer) else answer

    def rpc(self, msg: wire.Message | bytes, deadline: float, send_plan: Optional[Plan] = None,
            summed: bool = False) -> wire.Message:
        if isinstance(msg, bytes):  # a frame encoded before: recorded as the message it carries
            cls, blen, _ = wire.parse_header(msg[:wire.HEADER_SIZE])
            msg = wire.decode_frame(cls, msg[wire.HEADER_SIZE:], blen)
        self.sent.append((msg, send_plan))
        return self._next(msg, send_plan)

    def send_request(self, msg: wire.Message | bytes, deadline: float, send_plan: Optional[Plan] = None) -> None:
        self.pending.append(self.rpc(msg, deadline, send_plan))

    def read_reply(self, deadline: float) -> wire.Message:
        if self.pending:
            return self.pending.popleft()
        return self._next(wire.Reply(), None)

    def mark_broken(self, reason: str) -> None:
        self.broken = self.broken or reason

    def check_peer(self) -> None:
        if not self.peer_alive:
            self.mark_broken("peer process exited")
            fail(Fault.LINK_FAILED, f"link to cluster {self.remote_cluster_id} is broken (peer process exited)")

    def protocol_error(self, msg: wire.Message) -> NoReturn:
        self.mark_broken(f"unexpected {type(msg).__name__} frame")
        fail(Fault.LINK_FAILED, f"protocol error on link to cluster {self.remote_cluster_id}")
