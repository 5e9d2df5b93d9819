"""The states of a link and their moves (``datadist.engine.link_state``), and the one
teardown path (``Link.close``) on a link over a socket pair."""
from __future__ import annotations

import socket
from typing import Iterator

import pytest

from datadist.engine.link import Link
from datadist.engine.link_state import LinkState


@pytest.fixture
def told() -> list[tuple[int, str]]:
    return []


@pytest.fixture
def link(told: list[tuple[int, str]]) -> Iterator[Link]:
    ours, peer = socket.socketpair()
    made = Link(remote_cluster_id=7, remote_role=0, peer_pid=0, timeout_ms=2000, is_client=True,
                on_broken=lambda cluster, reason: told.append((cluster, reason)), req_sock=ours)
    yield made
    made.close()
    peer.close()


def test_a_link_opens_once_and_an_ended_one_never_reopens(link: Link) -> None:
    assert link.state is LinkState.OPENING and not link.ever_opened and not link.up
    assert not link.wait_opened(0)
    link.opened()
    assert link.state is LinkState.READY and link.ever_opened and link.up and link.broken is None
    link.close()
    link.opened()
    assert link.state is LinkState.CLOSED and link.broken == "link closed" and not link.up


def test_a_failure_breaks_a_live_link_and_is_told_once(link: Link, told: list[tuple[int, str]]) -> None:
    link.opened()
    link.mark_broken("peer process exited")
    link.mark_broken("a second reason")
    assert link.state is LinkState.BROKEN and link.broken == "peer process exited"
    assert told == [(7, "peer process exited")]


def test_this_ends_unlink_fails_transfers_and_tells_nobody(link: Link, told: list[tuple[int, str]]) -> None:
    link.opened()
    link.mark_closing("the link was unlinked")
    link.mark_broken("peer closed the connection")  # the end of stream that follows
    assert link.state is LinkState.CLOSING and link.broken == "the link was unlinked" and told == []


def test_the_peers_unlink_is_an_expected_end(link: Link, told: list[tuple[int, str]]) -> None:
    link.opened()
    link.mark_closing()
    assert link.state is LinkState.CLOSING and link.broken is None  # transfers may still finish
    link.mark_broken("peer closed the connection")
    assert link.state is LinkState.CLOSING and told == [(7, "peer closed the connection")]


def test_closing_a_busy_link_without_waiting_releases_it_when_the_holder_leaves(link: Link) -> None:
    link.opened()
    assert link.turns.acquire(blocking=False)
    link.close("peer gone", wait=False)
    assert link.state is LinkState.BROKEN and link.broken == "peer gone"
    assert link.req_sock is not None and link.req_sock.fileno() >= 0  # still held: not given back yet
    link.let_go()
    assert link.state is LinkState.CLOSED and link.req_sock.fileno() == -1
