"""TLS links between engine processes: the right bytes over TLS (pushes, pulls, a scattered
transfer several times the staging buffer, pipelined pushes, requests that arrive in one
TLS record), and every mismatch (a CA that does not know the peer, a client without a
certificate, a plaintext engine on either side) refused within the link timeout while the
serving engine goes on serving legitimate TLS peers."""
from __future__ import annotations

import contextlib
import socket
import ssl
import time
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from datadist.engine import wire
from datadist.engine.incoming import TLS_REFUSAL
from harness import DECODER_ID, PROMPT_ID, Desc, Ref, base_config, blocks_key, expect_blocks, free_port
from tls_helpers import Pki, make_pki, tls_config

pytestmark = pytest.mark.timeout(180)

BLOCKS = Desc(2, (4, 8, 32), "fp16")
#: Rows of 100000 bytes: 48 per tensor, two tensors; 40 scattered blocks move 8 MB, twice
#: the 4 MiB staging buffer, with windows that cut rows in the middle.
BIG = Desc(2, (48, 50000), "fp16")
SECRET = "tls and a secret"
#: A refused link must fail within this (the link timeout is 3 s; refusals are immediate).
REFUSED_WITHIN_S = 3.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _config(transport: str, tls: Optional[Dict[str, str]], port: Optional[int] = None, **extra: Any) -> Dict[str, Any]:
    return base_config(transport, listen_port=port, **(tls or {}), **extra)


def _server(peer_factory: Any, tls: Optional[Dict[str, str]], transport: str = "tcp", desc: Desc = BLOCKS,
            **extra: Any) -> Tuple[Any, int, np.ndarray]:
    port = free_port()
    peer = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID, _config(transport, tls, port, **extra))
    peer.alloc("kv", desc, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    return peer, port, peer.fill("kv", desc, 21)


def _client(peer_factory: Any, name: str, cluster_id: int, tls: Optional[Dict[str, str]], transport: str = "tcp",
            desc: Desc = BLOCKS, **extra: Any) -> Tuple[Any, np.ndarray]:
    dec = peer_factory("peer", name, "DECODER", cluster_id, _config(transport, tls, **extra))
    dec.alloc("dst", desc, blocks=True, bkey=blocks_key(cluster_id, 1))
    return dec, dec.fill("dst", desc, cluster_id)


def _refused(client: Any, server: Any, port: int) -> None:
    ret, rets, took = client.call("timed_link", [(server.cluster_id, "127.0.0.1", port)], 3000)
    assert rets == [S.LLM_LINK_FAILED], (ret, rets)
    assert took < REFUSED_WITHIN_S, f"a refused link took {took:.2f} s"


def _serves(peer_factory: Any, server: Any, port: int, data: np.ndarray, pki: Pki, rounds: list) -> None:
    """A legitimate TLS decoder links, pulls two blocks (bytes checked) and unlinks."""
    rounds.append(1)
    cid = DECODER_ID + 10 + len(rounds)
    dec, base = _client(peer_factory, f"legit{len(rounds)}", cid, tls_config(pki, "b"))
    dec.link(server, port=port)
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [1, 3], [0, 2])
    np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, data, [1, 3], [0, 2], BLOCKS.row_bytes))
    dec.call("unlink", [(PROMPT_ID, "127.0.0.1", port)])
    dec.shutdown()


# -- the right bytes -------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_push_and_pull_blocks_over_tls(peer_factory: Any, pki: Pki, transport: str) -> None:
    server, port, data = _server(peer_factory, tls_config(pki, "a"), transport)
    dec, base = _client(peer_factory, "decoder", DECODER_ID, tls_config(pki, "b"), transport)
    dec.link(server, port=port)
    assert dec.call("links")[PROMPT_ID]["path"] == transport
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0, 3], [1, 2])
    base = expect_blocks(base, data, [0, 3], [1, 2], BLOCKS.row_bytes)
    np.testing.assert_array_equal(dec.read("dst"), base)
    dec.cm("push_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [1, 2], [2, 0])
    np.testing.assert_array_equal(server.read("kv"), expect_blocks(data, base, [1, 2], [2, 0], BLOCKS.row_bytes))


def test_a_scattered_transfer_larger_than_the_staging_buffer(peer_factory: Any, pki: Pki) -> None:
    server, port, data = _server(peer_factory, tls_config(pki, "a"), desc=BIG)
    dec, base = _client(peer_factory, "decoder", DECODER_ID, tls_config(pki, "b"), desc=BIG, sync_kv_timeout=20000)
    dec.link(server, port=port)
    rng = np.random.default_rng(5)
    src_blocks = [int(b) for b in rng.permutation(48)[:40]]
    dst_blocks = [int(b) for b in rng.permutation(48)[:40]]
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), src_blocks, dst_blocks, timeout=60)
    base = expect_blocks(base, data, src_blocks, dst_blocks, BIG.row_bytes)
    np.testing.assert_array_equal(dec.read("dst"), base)
    back_src = [int(b) for b in rng.permutation(48)[:40]]
    back_dst = [int(b) for b in rng.permutation(48)[:40]]
    dec.cm("push_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), back_src, back_dst, timeout=60)
    np.testing.assert_array_equal(server.read("kv"), expect_blocks(data, base, back_src, back_dst, BIG.row_bytes))


def test_pipelined_pushes_over_tls(peer_factory: Any, pki: Pki) -> None:
    server, port, data = _server(peer_factory, tls_config(pki, "a"))
    dec, base = _client(peer_factory, "decoder", DECODER_ID, tls_config(pki, "b"))
    dec.link(server, port=port)
    dec.call("prepare", "h", "prepare_push_blocks", [blocks_key(PROMPT_ID, 1), Ref("dst")], {})
    pairs = [([0], [3]), ([1], [2]), ([2, 3], [0, 1])]
    dec.call("run_batch", "h", pairs)
    for src_blocks, dst_blocks in pairs:
        data = expect_blocks(data, base, src_blocks, dst_blocks, BLOCKS.row_bytes)
    np.testing.assert_array_equal(server.read("kv"), data)


def _tls_socket(pki: Pki, port: int, name: str = "b") -> ssl.SSLSocket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(pki.ca())
    ctx.load_cert_chain(pki.cert(name), pki.key(name))
    return ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5))


def test_requests_that_arrive_in_one_tls_record_are_all_served(peer_factory: Any, pki: Pki) -> None:
    """Two requests decrypted at once: the second waits inside the TLS socket, where the
    agent's selector cannot see it; it must be served all the same."""
    server, port, _ = _server(peer_factory, tls_config(pki, "a"))
    hello = wire.Hello(cluster_id=7, remote_cluster_id=PROMPT_ID, host="elsewhere", pid=1, backend="tcp",
                       ctrl={"fd": 3, "size": 4096, "base": 4096, "nonce": 1})
    with _raw_link(pki, port, 7) as (first, _second):
        resolve = wire.encode(wire.Resolve(kind="blocks", cluster_id=PROMPT_ID, model_id=1))
        first.sendall(resolve + resolve)  # one write: one TLS record holding both
        answers = [wire.read_message(first), wire.read_message(first)]
    assert all(isinstance(a, wire.Resolved) and not a.status for a in answers), answers


@contextlib.contextmanager
def _raw_link(pki: Pki, port: int, cluster_id: int) -> Iterator[Tuple[ssl.SSLSocket, ssl.SSLSocket]]:
    """A link opened by hand over TLS: its request stream (the engine serves it) and the
    attached second stream."""
    hello = wire.Hello(cluster_id=cluster_id, remote_cluster_id=PROMPT_ID, host="elsewhere", pid=1, backend="tcp",
                       ctrl={"fd": 3, "size": 4096, "base": 4096, "nonce": 1})
    with _tls_socket(pki, port) as first, _tls_socket(pki, port) as second:
        first.sendall(wire.encode(hello))
        ack = wire.read_message(first)
        assert isinstance(ack, wire.HelloAck) and not ack.status, ack
        second.sendall(wire.encode(wire.Attach(cluster_id=cluster_id, token=ack.attach_token)))
        assert wire.read_message(second).status == 0
        yield first, second


def test_pipelined_requests_behind_a_push_served_off_the_agent(peer_factory: Any, pki: Pki) -> None:
    """With a second link watched, a 200 KB push whose payload has not all arrived is
    received on a thread of its own; its TLS reads decrypt the next pushes the peer sent
    without waiting (one write), where the agent's selector cannot see them.  They are
    served all the same, in order, and land."""
    server, port, _ = _server(peer_factory, tls_config(pki, "a"), desc=BIG)
    with _raw_link(pki, port, 7) as (req, _), _raw_link(pki, port, 8):
        req.sendall(wire.encode(wire.Resolve(kind="blocks", cluster_id=PROMPT_ID, model_id=1)))
        where = wire.read_message(req)
        assert isinstance(where, wire.Resolved) and not where.status, where
        a0 = int(where.arrays[0][0])
        payloads = [bytes(np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8))
                    for i, n in enumerate((200_000, 1024, 512))]
        stream, off = b"", 0
        for payload in payloads:
            plan = [np.array([a0], np.uint64), np.array([off], np.uint64), np.array([len(payload)], np.uint64)]
            stream += wire.encode(wire.Push(cache_id=where.cache_id, epoch=where.epoch, nbytes=len(payload),
                                            arrays=plan)) + payload
            off += len(payload)
        req.sendall(stream)
        req.settimeout(5)
        answers = [wire.read_message(req) for _ in payloads]
    assert all(isinstance(a, wire.Reply) and not a.status for a in answers), answers
    assert bytes(server.read("kv")[0][:off]) == b"".join(payloads)


# -- refusals --------------------------------------------------------------------------------
def test_a_peer_of_another_ca_cannot_link_either_way(peer_factory: Any, pki: Pki) -> None:
    server, port, data = _server(peer_factory, tls_config(pki, "a"))
    rounds: list = []
    stranger, _ = _client(peer_factory, "stranger", DECODER_ID, tls_config(pki, "x", ca="other"))
    _refused(stranger, server, port)  # neither side trusts the other's CA
    distrustful, _ = _client(peer_factory, "distrustful", DECODER_ID + 1, tls_config(pki, "b", ca="other"))
    _refused(distrustful, server, port)  # the server's certificate is not of the CA it trusts
    _serves(peer_factory, server, port, data, pki, rounds)
    assert server.call("links") == {}
    np.testing.assert_array_equal(server.read("kv"), data)


def test_a_client_without_a_certificate_is_refused(peer_factory: Any, pki: Pki) -> None:
    server, port, data = _server(peer_factory, tls_config(pki, "a"))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(pki.ca())
    t0 = time.monotonic()
    with pytest.raises(OSError):  # the server's alert, at the handshake or the first read (TLS 1.3)
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5)) as s:
            s.sendall(wire.encode(wire.Hello(cluster_id=9, remote_cluster_id=PROMPT_ID)))
            wire.read_message(s)
    assert time.monotonic() - t0 < REFUSED_WITHIN_S
    _serves(peer_factory, server, port, data, pki, [])


def test_a_plaintext_engine_cannot_link_to_a_tls_engine(peer_factory: Any, pki: Pki) -> None:
    server, port, data = _server(peer_factory, tls_config(pki, "a"))
    plain, _ = _client(peer_factory, "plain", DECODER_ID, None)
    _refused(plain, server, port)
    secret_only, _ = _client(peer_factory, "secret-only", DECODER_ID + 1, None, link_secret=SECRET)
    _refused(secret_only, server, port)
    # what a plaintext peer is told, in its own protocol
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(wire.encode(wire.Hello(cluster_id=9, remote_cluster_id=PROMPT_ID)))
        reply = wire.read_message(s)
    assert isinstance(reply, wire.HelloAck) and reply.status == S.LLM_LINK_FAILED and reply.message == TLS_REFUSAL
    assert (reply.cluster_id, reply.pid, reply.host, reply.arenas) == (0, 0, "", [])
    _serves(peer_factory, server, port, data, pki, [])
    assert server.call("links") == {}


def test_a_tls_engine_cannot_link_to_a_plaintext_engine(peer_factory: Any, pki: Pki) -> None:
    server, port, data = _server(peer_factory, None)
    tls_client, _ = _client(peer_factory, "tls", DECODER_ID, tls_config(pki, "b"))
    _refused(tls_client, server, port)
    plain, base = _client(peer_factory, "plain", DECODER_ID + 1, None)
    plain.link(server, port=port)
    plain.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [2], [3])
    np.testing.assert_array_equal(plain.read("dst"), expect_blocks(base, data, [2], [3], BLOCKS.row_bytes))


# -- with a link secret ----------------------------------------------------------------------
def test_tls_and_a_link_secret_together(peer_factory: Any, pki: Pki) -> None:
    server, port, data = _server(peer_factory, tls_config(pki, "a"), link_secret=SECRET)
    wrong, _ = _client(peer_factory, "wrong", DECODER_ID + 1, tls_config(pki, "b"), link_secret="not it")
    _refused(wrong, server, port)
    dec, base = _client(peer_factory, "decoder", DECODER_ID, tls_config(pki, "b"), link_secret=SECRET)
    dec.link(server, port=port)
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0, 1], [3, 2])
    np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, data, [0, 1], [3, 2], BLOCKS.row_bytes))


# -- deadlines and dead peers ----------------------------------------------------------------
def test_a_frozen_tls_peer_times_out_within_sync_kv_timeout(peer_factory: Any, pki: Pki) -> None:
    server, port, _ = _server(peer_factory, tls_config(pki, "a"))
    dec, base = _client(peer_factory, "decoder", DECODER_ID, tls_config(pki, "b"))
    dec.link(server, port=port)
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0], [0])  # the link works
    server.stop()
    try:
        out = dec.call("timed_cm", "pull_blocks", (blocks_key(PROMPT_ID, 1), Ref("dst"), [1], [2]), {}, timeout=15)
    finally:
        server.cont()
    assert out["error"] is not None and out["status_code"] == S.LLM_TIMEOUT, out
    assert out["elapsed"] <= 1.0 + 1.0, out  # sync_kv_timeout is 1000 ms


def test_a_tls_peer_killed_mid_transfer_fails_the_calls_at_once(peer_factory: Any, pki: Pki) -> None:
    big = Desc(8, (16, 64, 256), "fp16")  # 4 MiB per pull: a staging window
    server, port, _ = _server(peer_factory, tls_config(pki, "a"), desc=big)
    dec, _ = _client(peer_factory, "decoder", DECODER_ID, tls_config(pki, "b"), desc=big)
    dec.link(server, port=port)
    loop = dec.start_call("loop", "pull_blocks", (blocks_key(PROMPT_ID, 1), Ref("dst"), list(range(16)),
                                                  list(range(16))), {}, 10)
    assert loop.note() == "running"
    t_kill = server.kill()
    out = loop.result(timeout=20)
    assert out["error"] is not None and "LLMException" in out["bases"], out
    assert 0 <= out["t_error"] - t_kill <= 1.0 + 1.0, out


def test_peers_that_stop_mid_request_do_not_starve_an_honest_decoder(peer_factory: Any, pki: Pki) -> None:
    """Three TLS links each send one byte of a request and stop.  A TLS frame cannot be
    peeked at before it is decrypted, so the agent read each one waiting up to
    sync_kv_timeout in turn, and an honest pull behind them timed out; now it reads what
    has come and serves the frame once whole, so the honest pull goes through."""
    server, port, data = _server(peer_factory, tls_config(pki, "a"), sync_kv_timeout=1000)
    dec, _ = _client(peer_factory, "decoder", DECODER_ID, tls_config(pki, "b"), sync_kv_timeout=1000)
    dec.link(server, port=port)
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [1], [0])
    with contextlib.ExitStack() as stack:
        reqs = [stack.enter_context(_raw_link(pki, port, cid))[0] for cid in (7, 8, 9)]  # all linked first
        for req in reqs:
            req.sendall(wire.encode(wire.Resolve())[:1])  # one byte of a request, then nothing
        dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [1, 3], [0, 2])
        for req in reqs:  # each stalled link is closed at its deadline
            req.settimeout(10)
            assert req.recv(1) == b""
