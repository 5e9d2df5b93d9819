"""The agent's order of service over real socket pairs: with several links watched, a link
it has just served does not go first again while another link's request waits (one fast
peer must not keep the agent while the others wait)."""
from __future__ import annotations

import selectors
import socket
from typing import Iterator

import pytest
from waiting import until

from datadist.engine import polling
from datadist.engine.polling import SpinPolicy
from datadist.engine.agent import SERVE_SPIN_US, Agent, _Served
from datadist.engine.link import Link

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def two_links(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Agent, Link, Link, list[Link], socket.socket, socket.socket]]:
    """An agent's serving loop state (no thread of its own) watching links A and B; serving a
    link reads one byte (one request) of it.  Yields the agent, both links, the links served
    in order, and the peers' ends of A and B."""
    agent = Agent.__new__(Agent)  # the loop's state only: these tests call its steps themselves
    agent._sel = selectors.DefaultSelector()
    agent._stop = False
    agent._watched = 0
    socks = []
    links = []
    for cluster in (1, 2):
        ours, peer = socket.socketpair()
        socks += [ours, peer]
        link = Link(remote_cluster_id=cluster, remote_role=0, peer_pid=0, timeout_ms=5000, is_client=False,
                    serve_sock=ours)
        agent._sel.register(ours, selectors.EVENT_READ, _Served(link, SpinPolicy(SERVE_SPIN_US)))
        agent._watched += 1
        links.append(link)
    served: list[Link] = []

    def serve(link: Link) -> bool:
        served.append(link)
        assert link.serve_sock is not None
        link.serve_sock.recv(1)
        return True  # served (the agent's _serve: False when the request is set aside)

    monkeypatch.setattr(agent, "_serve", serve)
    monkeypatch.setattr(polling.LOAD, "busy", lambda: False)  # an idle machine: the agent may spin
    try:
        yield agent, links[0], links[1], served, socks[1], socks[3]
    finally:
        agent._sel.close()
        for s in socks:
            s.close()


def test_a_link_just_served_waits_for_the_others(two_links) -> None:
    agent, a, b, served, a_peer, b_peer = two_links
    a_peer.sendall(b"12")  # A's request and its next one, already there
    b_peer.sendall(b"1")   # B's request, waiting
    agent._serve_burst(a, SpinPolicy(SERVE_SPIN_US))
    assert served == [a]   # back to the loop, which serves B next
    ready = [key.data.link for key, _ in agent._sel.select(0)]
    assert a in ready and b in ready


def test_a_lone_link_keeps_its_burst(two_links) -> None:
    agent, a, b, served, a_peer, _ = two_links
    agent._sel.unregister(b.serve_sock)
    agent._watched = 1
    a_peer.sendall(b"123")  # requests that arrive back to back are served without the loop
    agent._serve_burst(a, SpinPolicy(SERVE_SPIN_US))
    assert served == [a, a, a]


def _peek(sock: socket.socket, n: int) -> bytes:
    try:
        return sock.recv(n, socket.MSG_PEEK)
    except BlockingIOError:
        return b""


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    return ours, peer


@pytest.mark.parametrize("pair", [socket.socketpair, _tcp_pair], ids=["unix", "tcp"])
def test_a_request_is_whole_only_once_every_byte_of_its_frame_is_there(pair) -> None:
    """What the agent peeks before it reads a request while other links wait: a link whose
    request has only partly arrived is set aside instead of holding the agent."""
    from datadist.engine import native, wire
    from datadist.engine.gather import whole_request

    frame = wire.encode(wire.Resolve(kind="blocks", cluster_id=1, model_id=2))
    ours, peer = pair()
    with ours, peer:
        ours.setblocking(False)
        if peer.family != socket.AF_UNIX:
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert whole_request(ours) is None                 # nothing has arrived
        peer.sendall(frame[:5])
        assert until(lambda: _peek(ours, 64) == frame[:5])
        assert whole_request(ours) is False                # part of the header
        peer.sendall(frame[5:-1])
        assert until(lambda: _peek(ours, len(frame)) == frame[:-1])
        assert whole_request(ours) is False                # all but its last byte
        peer.sendall(frame[-1:] + frame)
        assert until(lambda: whole_request(ours) is True)  # whole, with the next frame behind it
        assert ours.recv(len(frame)) == frame               # peeked, never read
        assert until(lambda: whole_request(ours) is True) and ours.recv(len(frame)) == frame
        peer.sendall(b"\xff" * wire.HEADER_SIZE)
        assert until(lambda: whole_request(ours) is True)  # a header announcing more than 64 KiB: read as it comes
        # which the pool daemon gathers apart from the others: it is told so
        assert native.frame_arrived(ours.fileno(), 64 << 10) == native.FRAME_LARGE
        assert native.frame_arrived(ours.fileno(), 1 << 34) == native.FRAME_PART
        assert until(lambda: len(_peek(ours, 64)) == wire.HEADER_SIZE) and ours.recv(64)
        peer.close()
        assert whole_request(ours) is True                 # the end of the stream
