"""A request frame read as its bytes come (:mod:`datadist.engine.gather`), over real socket
pairs: nothing is waited for, the frame comes back whole and alone (what follows it stays
in the stream), a header the codec refuses and an end mid-frame are errors."""
from __future__ import annotations

import socket
from typing import Iterator, Tuple

import numpy as np
import pytest

from datadist.engine import wire
from datadist.engine.gather import Gathering
from datadist.engine.requests import SERVED

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair() -> Iterator[Tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    b.settimeout(5.0)  # as a link's serve socket has one: gathering must not wait on it
    yield a, b
    a.close()
    b.close()


def _pull(n_runs: int) -> bytes:
    runs = np.arange(n_runs, dtype=np.uint64)
    return wire.encode(wire.Pull(cache_id=1, epoch=2, nbytes=n_runs * 8, arrays=[runs[:1], runs * 8, runs * 0 + 8]))


def test_a_frame_is_gathered_piece_by_piece_and_what_follows_stays(pair) -> None:
    ours, theirs = pair
    frame, after = _pull(5_000), wire.encode(wire.Resolve())
    assert len(frame) > 64 << 10
    g = Gathering(0.0, SERVED)
    assert g.feed(theirs) is None  # nothing yet: no wait
    cuts = [0, 5, wire.HEADER_SIZE, 70_000, len(frame)]
    got = None
    for lo, hi in zip(cuts, cuts[1:]):
        assert got is None
        ours.sendall(frame[lo:hi] + (after if hi == len(frame) else b""))
        got = g.feed(theirs)
    assert got == frame
    assert wire.read_message(theirs) == wire.Resolve()  # the next frame is still in the stream


def test_a_refused_header_and_an_end_mid_frame_are_errors(pair) -> None:
    ours, theirs = pair
    ours.sendall(wire.encode(wire.Resolve())[:wire.HEADER_SIZE - 4])
    g = Gathering(0.0, [int(wire.MsgType.PUSH)])  # a RESOLVE is not among those allowed
    assert g.feed(theirs) is None
    ours.sendall(wire.encode(wire.Resolve())[wire.HEADER_SIZE - 4:wire.HEADER_SIZE])
    with pytest.raises(wire.WireError):
        g.feed(theirs)
    ours2, theirs2 = socket.socketpair()
    try:
        ours2.sendall(_pull(4)[:30])
        ours2.close()
        g = Gathering(0.0, SERVED)
        with pytest.raises(ConnectionResetError):
            g.feed(theirs2)
            g.feed(theirs2)
    finally:
        theirs2.close()
