"""The TLS payload path on its own: plans sent and received through the staging buffer over
a real TLS connection (a socket pair, both ends in this process), byte for byte against
what the plain C loop moves; windows smaller than runs, runs smaller than windows, a frame
in front, empty plans, deadlines, and a peer that stops mid-payload."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Tuple

import numpy as np
import pytest

from datadist.engine import native, tls
from datadist.engine.layout import Plan
from tls_helpers import Pki, make_pki

pytestmark = pytest.mark.timeout(60)

U64 = np.uint64


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def pair(pki: Pki) -> Iterator[Tuple[socket.socket, socket.socket]]:
    """A connected (client, server) pair of TLS sockets with timeouts."""
    a = tls.TlsConfig(pki.cert("a"), pki.key("a"), pki.ca())
    b = tls.TlsConfig(pki.cert("b"), pki.key("b"), pki.ca())
    raw_c, raw_s = socket.socketpair()
    raw_c.settimeout(10)
    raw_s.settimeout(10)
    server: list = []
    t = threading.Thread(target=lambda: server.append(b.server.wrap_socket(raw_s, server_side=True)))
    t.start()
    client = a.connect(raw_c)
    t.join(10)
    try:
        yield client, server[0]
    finally:
        client.close()
        server[0].close()


def _plan(rng: np.random.Generator, src: np.ndarray, dst: np.ndarray, tensors: int, runs: int,
          max_run: int) -> Plan:
    """A factored plan: ``tensors`` bases on each side (disjoint slices), ``runs`` runs of
    random length per tensor at random non-overlapping offsets."""
    span = src.nbytes // tensors
    slots = span // max_run
    runs = min(runs, slots)
    lens = rng.integers(1, max_run, size=runs).astype(U64)
    src_offs = (rng.choice(slots, size=runs, replace=False) * max_run).astype(U64)
    dst_offs = (rng.choice(slots, size=runs, replace=False) * max_run).astype(U64)
    src_bases = (np.arange(tensors, dtype=U64) * U64(span)) + U64(src.ctypes.data)
    dst_bases = (np.arange(tensors, dtype=U64) * U64(span)) + U64(dst.ctypes.data)
    return Plan(src_bases, dst_bases, src_offs, dst_offs, lens)


def _both(send: Callable[[], None], recv: Callable[[], None]) -> None:
    failed: list = []

    def run() -> None:
        try:
            send()
        except BaseException as exc:  # surfaced below
            failed.append(exc)

    t = threading.Thread(target=run)
    t.start()
    recv()
    t.join(20)
    assert not t.is_alive() and not failed, failed


@pytest.mark.parametrize("staging, max_run", [(64 << 10, 40000), (64 << 10, 300), (4 << 20, 200000)])
def test_plans_arrive_byte_for_byte(pair: Tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch,
                                    staging: int, max_run: int) -> None:
    monkeypatch.setattr(tls, "STAGING_BYTES", staging)
    client, server = pair
    rng = np.random.default_rng(staging + max_run)
    for trial in range(4):
        src = rng.integers(0, 256, size=8 << 20, dtype=np.uint8)
        dst = np.zeros(8 << 20, dtype=np.uint8)
        plan = _plan(rng, src, dst, tensors=1 + trial, runs=int(rng.integers(1, 40)), max_run=max_run)
        head = bytes(rng.integers(0, 256, size=int(rng.integers(0, 3000)), dtype=np.uint8))
        expected = dst.copy()
        native.copy_plan(plan.rebase(dst_delta=expected.ctypes.data - dst.ctypes.data))
        got_head = bytearray(len(head))
        deadline = time.monotonic() + 10

        def recv() -> None:
            if head:
                tls.recv_exact(server, got_head, 10)
            tls.recv_plan(server, plan, deadline)

        _both(lambda: tls.send_plan(client, plan, deadline, head), recv)
        assert bytes(got_head) == head
        np.testing.assert_array_equal(dst, expected)


def test_a_frame_larger_than_half_the_staging_goes_first(pair: Tuple[socket.socket, socket.socket],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tls, "STAGING_BYTES", 64 << 10)
    client, server = pair
    head = bytes(range(256)) * 200  # 51200 bytes
    src = np.arange(100000, dtype=np.uint8)
    dst = np.zeros_like(src)
    plan = Plan(np.zeros(1, U64), np.zeros(1, U64), np.array([src.ctypes.data], U64),
                np.array([dst.ctypes.data], U64), np.array([src.nbytes], U64))
    got = bytearray(len(head))
    deadline = time.monotonic() + 10

    def recv() -> None:
        tls.recv_exact(server, got, 10)
        tls.recv_plan(server, plan, deadline)

    _both(lambda: tls.send_plan(client, plan, deadline, head), recv)
    assert bytes(got) == head
    np.testing.assert_array_equal(dst, src)


def test_an_empty_plan_sends_its_frame_only(pair: Tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    empty = np.zeros(0, U64)
    plan = Plan(empty, empty, empty, empty, empty)
    tls.send_plan(client, plan, time.monotonic() + 5, b"frame")
    tls.recv_plan(server, plan, time.monotonic() + 5)
    got = bytearray(5)
    tls.recv_exact(server, got, 5)
    assert got == b"frame"


def test_reads_keep_the_deadline_and_the_socket_timeout(pair: Tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    server.settimeout(7.0)
    dst = np.zeros(1000, dtype=np.uint8)
    plan = Plan(np.zeros(1, U64), np.zeros(1, U64), np.zeros(1, U64), np.array([dst.ctypes.data], U64),
                np.array([1000], U64))
    client.sendall(b"x" * 10)  # the peer stops mid-payload
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        tls.recv_plan(server, plan, time.monotonic() + 0.3)
    assert 0.25 < time.monotonic() - t0 < 3.0
    assert server.gettimeout() == 7.0
    client.close()
    with pytest.raises(OSError):  # end of stream (or the ssl module's EOF error)
        tls.discard(server, 10000, time.monotonic() + 5)


def test_buffered_sees_decrypted_bytes_that_poll_does_not(pair: Tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    client.sendall(b"0123456789")
    assert not tls.buffered(server)
    first = bytearray(2)
    tls.recv_exact(server, first, 5)
    assert tls.buffered(server)  # 8 bytes decrypted, nothing left on the descriptor
    assert not native.spin_readable(server.fileno(), 1000)
    rest = bytearray(8)
    tls.recv_exact(server, rest, 5)
    assert bytes(first + rest) == b"0123456789" and not tls.buffered(server)
    assert not tls.buffered(None)


def test_config_shows_and_pickles_paths_only(pki: Pki, tmp_path: Path) -> None:
    import pickle

    cfg = tls.TlsConfig(pki.cert("a"), pki.key("a"), pki.ca())
    key_text = Path(pki.key("a")).read_text()
    assert key_text.splitlines()[1] not in repr(cfg)
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and repr(again) == repr(cfg)
