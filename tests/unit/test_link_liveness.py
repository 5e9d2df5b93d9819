"""``Link.check_peer``: after a one-sided copy, a peer whose request stream has ended is
gone (its mapped memory took the bytes, but nobody will read them)."""
from __future__ import annotations

import socket

import pytest

from datadist.engine.errors import EngineError, Fault
from datadist.engine.link import Link


def _link(sock: socket.socket, lost: list) -> Link:
    link = Link(remote_cluster_id=7, remote_role=1, peer_pid=0, timeout_ms=1000, is_client=True,
                on_broken=lambda cluster, why: lost.append((cluster, why)))
    link.req_sock = sock
    return link


def test_live_peer_passes_even_with_bytes_pending() -> None:
    here, there = socket.socketpair()
    with here, there:
        lost: list = []
        link = _link(here, lost)
        link.check_peer()
        there.sendall(b"x")  # a reply in flight is not an end of stream
        link.check_peer()
        assert link.broken is None and not lost


@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_ended_stream_breaks_the_link(how: str) -> None:
    here, there = socket.socketpair()
    with here:
        lost: list = []
        link = _link(here, lost)
        if how == "close":
            there.close()
        else:
            there.shutdown(socket.SHUT_WR)
        with pytest.raises(EngineError) as caught:
            link.check_peer()
        assert caught.value.fault == Fault.LINK_FAILED
        assert lost == [(7, "peer process exited")]
        there.close()


def test_deadline_mid_request_ends_the_stream_for_the_peer() -> None:
    """A request whose deadline passed breaks the link, and the peer reads the end of the
    stream: a peer that was only slow learns that its end is broken too."""
    here, there = socket.socketpair()
    with here, there:
        lost: list = []
        link = _link(here, lost)
        with pytest.raises(EngineError) as caught:
            link._fail(TimeoutError("timed out"))
        assert caught.value.fault == Fault.TIMEOUT
        assert lost == [(7, "sync_kv_timeout passed mid-request")]
        there.settimeout(5)
        assert there.recv(1) == b"", "the peer did not see the stream end"
