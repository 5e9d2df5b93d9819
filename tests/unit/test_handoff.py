"""The threads that serve handed-off transfers, over real socket pairs: a thread kept idle
serves the next transfer, idle threads end after their period and at the end, a transfer
still served when the hand-offs end has its stream shut down, and nothing is started
after the end."""
from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator, List, Optional, Tuple

import pytest
from waiting import until

from datadist.engine import handoff, wire
from datadist.engine.handoff import Deferred, HandOffs

pytestmark = pytest.mark.timeout(30)


class _Link:
    """What HandOffs asks of a link: lending its serve socket, and having it back."""

    def __init__(self) -> None:
        self.lent = 0
        self.closed = False
        self.remote_cluster_id = 1

    def lend_serve(self) -> bool:
        if self.closed:
            return False
        self.lent += 1
        return True

    def give_back_serve(self) -> None:
        self.lent -= 1


class _Served:
    """The callbacks' records: replies sent (with the thread that sent them), links failed
    and links watched again."""

    def __init__(self) -> None:
        self.answered: List[Tuple[wire.Message, str]] = []
        self.failed: List[Exception] = []
        self.done = 0
        self.lock = threading.Lock()

    def answer(self, sock: socket.socket, reply: wire.Message, payload: object, summed: bool) -> None:
        sock.sendall(b"A")
        with self.lock:
            self.answered.append((reply, threading.current_thread().name))

    def on_failed(self, link: object, exc: Exception) -> None:
        with self.lock:
            self.failed.append(exc)

    def on_done(self, link: object) -> None:
        with self.lock:
            self.done += 1


@pytest.fixture
def pairs() -> Iterator[List[Tuple[socket.socket, socket.socket]]]:
    made: List[Tuple[socket.socket, socket.socket]] = []
    yield made
    for a, b in made:
        a.close()
        b.close()


def _transfer(pairs: List[Tuple[socket.socket, socket.socket]], link: Optional[_Link] = None
              ) -> Tuple[Deferred, socket.socket]:
    """A transfer whose rest waits for one byte from its peer (as a push's payload would)
    and a peer end that sends it."""
    ours, theirs = socket.socketpair()
    pairs.append((ours, theirs))
    ours.settimeout(20)

    def rest() -> wire.Message:
        if not ours.recv(1):
            raise ConnectionError("the stream ended")
        return wire.Reply(status=0)

    return Deferred(link or _Link(), ours, rest, None, False, contextlib.ExitStack()), theirs  # type: ignore[arg-type]


def _serving_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("datadist-serve")]


def test_a_kept_thread_serves_the_next_transfer(pairs) -> None:
    served = _Served()
    offs = HandOffs("cpu", served.answer, served.on_failed, served.on_done)
    names = []
    for i in range(3):
        job, peer = _transfer(pairs)
        offs.start(job)
        assert len(offs) == 1
        peer.sendall(b"x")
        assert peer.recv(1) == b"A"
        until(lambda: served.done == i + 1 and len(offs) == 0, 10, "the transfer served")
        names.append(served.answered[-1][1])
        assert job.link.lent == 0  # type: ignore[attr-defined]
    assert names == [names[0]] * 3  # one thread served all three, one after another
    offs.end(5)
    assert not _serving_threads()


def test_transfers_at_once_get_a_thread_each(pairs) -> None:
    served = _Served()
    offs = HandOffs("cpu", served.answer, served.on_failed, served.on_done)
    jobs = [_transfer(pairs) for _ in range(3)]
    for job, _peer in jobs:
        offs.start(job)
    assert len(offs) == 3 and len(_serving_threads()) == 3
    for _job, peer in jobs:
        peer.sendall(b"x")
        assert peer.recv(1) == b"A"
    until(lambda: served.done == 3 and len(offs) == 0, 10, "the three served")
    assert len({name for _reply, name in served.answered}) == 3
    offs.end(5)
    assert not _serving_threads() and not served.failed


def test_an_idle_thread_ends_after_its_period(pairs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "IDLE_S", 0.05)
    served = _Served()
    offs = HandOffs("cpu", served.answer, served.on_failed, served.on_done)
    job, peer = _transfer(pairs)
    offs.start(job)
    (thread,) = _serving_threads()
    peer.sendall(b"x")
    thread.join(10)
    assert not thread.is_alive()  # idle for its period: ended on its own
    job, peer = _transfer(pairs)
    offs.start(job)  # and a new one serves the next transfer
    peer.sendall(b"x")
    assert peer.recv(1) == b"A"
    until(lambda: served.done == 2, 10, "the second transfer served")
    assert served.answered[0][1] != served.answered[1][1]
    offs.end(5)


def test_the_end_shuts_down_a_transfer_in_flight_and_ends_idle_threads(pairs) -> None:
    served = _Served()
    offs = HandOffs("cpu", served.answer, served.on_failed, served.on_done)
    idle, peer = _transfer(pairs)
    offs.start(idle)
    peer.sendall(b"x")
    until(lambda: served.done == 1 and len(offs) == 0, 10, "the first transfer served")
    stalled, _silent = _transfer(pairs, _Link())  # its peer never sends
    stalled_link = stalled.link
    offs.start(stalled)  # taken by the idle thread
    assert len(offs) == 1
    offs.end(5)  # the stalled stream is shut down: its transfer fails at once, and is waited for
    assert not _serving_threads()
    assert len(served.failed) == 1 and served.done == 1
    assert stalled_link.lent == 0  # type: ignore[attr-defined]
    job, _peer = _transfer(pairs)
    with pytest.raises(ConnectionError, match="stopping"):
        offs.start(job)  # nothing starts after the end, and the socket is given back
    assert job.link.lent == 0  # type: ignore[attr-defined]


def test_a_closed_link_is_not_served_and_its_staging_is_given_back(pairs) -> None:
    served = _Served()
    offs = HandOffs("cpu", served.answer, served.on_failed, served.on_done)
    link = _Link()
    link.closed = True
    job, _peer = _transfer(pairs, link)
    given_back = []
    job.scope.callback(given_back.append, "staging")
    with pytest.raises(ConnectionError, match="closed"):
        offs.start(job)
    assert given_back == ["staging"]
    assert not _serving_threads() and len(offs) == 0
    offs.end(5)


def test_a_request_sent_right_after_the_answer_finds_the_thread_idle(pairs) -> None:
    """The thread is idle before its link is handed back: a next transfer handed off as
    soon as the link is watched again (here: from the done callback itself) goes to it."""
    served = _Served()
    follow: List[Tuple[Deferred, socket.socket]] = []

    def done(link: object) -> None:
        served.on_done(link)
        if len(follow) < 2:
            follow.append(_transfer(pairs))
            offs.start(follow[-1][0])
            follow[-1][1].sendall(b"x")

    offs = HandOffs("cpu", served.answer, served.on_failed, done)
    job, peer = _transfer(pairs)
    offs.start(job)
    peer.sendall(b"x")
    until(lambda: served.done == 3 and len(offs) == 0, 10, "three transfers served")
    assert len({name for _reply, name in served.answered}) == 1, served.answered
    offs.end(5)


def test_a_device_that_cannot_be_made_current_fails_the_transfer(pairs, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_device(device: str) -> None:
        raise RuntimeError(f"device {device} is gone")

    monkeypatch.setattr(handoff.npu, "set_device", no_device)
    served = _Served()
    offs = HandOffs("npu:3", served.answer, served.on_failed, served.on_done)
    job, _peer = _transfer(pairs)
    given_back = []
    job.scope.callback(given_back.append, "staging")
    offs.start(job)
    until(lambda: served.failed and len(offs) == 0, 10, "the transfer failed")
    assert "npu:3 is gone" in str(served.failed[0]) and served.done == 0
    assert given_back == ["staging"] and job.link.lent == 0  # type: ignore[attr-defined]
    offs.end(5)
