"""With a link secret, strangers cannot link, read or write: mutual proofs in both
directions, a refusal that names nothing of the engine, no replay of a recorded opening,
no hijack of a link's second connection."""
from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from datadist.engine import auth, handshake, wire
from harness import DECODER_ID, PROMPT_ID, Desc, Ref, base_config, blocks_key, expect_blocks, free_port

pytestmark = pytest.mark.timeout(120)

BLOCKS = Desc(2, (4, 8, 32), "fp16")
SECRET = "correct horse battery staple"


def _prompt(peer_factory: Any, secret: str = SECRET, transport: str = "shm") -> tuple:
    port = free_port()
    peer = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID,
                        base_config(transport, listen_port=port, link_secret=secret or None))
    peer.register("kv", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    return peer, port, peer.fill("kv", BLOCKS, 21)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_same_secret_links_and_moves_bytes(peer_factory: Any, transport: str) -> None:
    prompt, port, data = _prompt(peer_factory, transport=transport)
    dec = peer_factory("peer", "decoder", "DECODER", DECODER_ID, base_config(transport, link_secret=SECRET))
    dec.alloc("dst", BLOCKS, blocks=True)
    base = dec.fill("dst", BLOCKS, 1)
    dec.link(prompt, port=port)
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0, 3], [1, 2])
    np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, data, [0, 3], [1, 2], BLOCKS.row_bytes))


@pytest.mark.parametrize("server, client", [(SECRET, ""), ("", SECRET), (SECRET, "another secret")])
def test_missing_or_wrong_secret_cannot_link(peer_factory: Any, server: str, client: str) -> None:
    prompt, port, data = _prompt(peer_factory, secret=server)
    dec = peer_factory("peer", "decoder", "DECODER", DECODER_ID, base_config("shm", link_secret=client or None))
    ret, rets = dec.link(prompt, port=port, expect_ok=False)
    assert rets == [S.LLM_LINK_FAILED]
    np.testing.assert_array_equal(prompt.read("kv"), data)
    assert prompt.call("links") == {}


def _exchange(port: int, *frames: bytes) -> wire.Message:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for frame in frames:
            s.sendall(frame)
        return wire.read_message(s)


def test_refusal_names_nothing_of_the_engine(peer_factory: Any) -> None:
    prompt, port, _ = _prompt(peer_factory)
    stranger = wire.Hello(cluster_id=5, remote_cluster_id=PROMPT_ID, host="stranger", pid=4242,
                          ctrl={"fd": 3, "size": 4096, "base": 4096, "nonce": 1})
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(wire.encode(stranger))
        head = s.recv(wire.HEADER_SIZE, socket.MSG_PEEK | socket.MSG_WAITALL)
        assert len(head) == wire.HEADER_SIZE
        reply = wire.read_message(s)
    assert isinstance(reply, wire.HelloAck) and reply.status == S.LLM_LINK_FAILED
    assert reply.message == handshake.REFUSAL
    assert (reply.cluster_id, reply.pid, reply.host, reply.ctrl, reply.arenas, reply.device_regions,
            reply.nonce, reply.proof, reply.attach_token) == (0, 0, "", {}, [], [], "", "", "")
    raw = wire.encode(reply)
    assert str(prompt.pid).encode() not in raw and socket.gethostname().encode() not in raw
    # an opening to the wrong cluster id is refused the same way, before any challenge
    opening = wire.Hello(cluster_id=5, remote_cluster_id=PROMPT_ID + 1, nonce=auth.new_nonce().hex())
    assert _exchange(port, wire.encode(opening)).message == handshake.REFUSAL


def test_recorded_opening_cannot_be_replayed(peer_factory: Any) -> None:
    prompt, port, _ = _prompt(peer_factory)
    secret = auth.Secret(SECRET.encode())
    client = handshake.ClientAuth(secret, b"9", str(PROMPT_ID).encode())
    opening = wire.Hello(cluster_id=9, remote_cluster_id=PROMPT_ID, nonce=client.nonce_hex)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(wire.encode(opening))
        challenge = wire.read_message(s)
        proof = client.answer(challenge.nonce, challenge.proof)
        assert proof is not None  # the server proved it holds the secret
    recorded = [wire.encode(opening),
                wire.encode(wire.Hello(cluster_id=9, remote_cluster_id=PROMPT_ID, nonce=client.nonce_hex,
                                       proof=proof))]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(recorded[0])
        fresh = wire.read_message(s)
        assert fresh.challenge and fresh.nonce != challenge.nonce
        s.sendall(recorded[1])  # the old proof answers the old nonce, not this one
        reply = wire.read_message(s)
    assert reply.status == S.LLM_LINK_FAILED and reply.message == handshake.REFUSAL
    assert prompt.call("links") == {}


@pytest.mark.parametrize("secret", [SECRET, ""])
def test_attach_needs_the_token_of_the_link(peer_factory: Any, secret: str) -> None:
    prompt, port, _ = _prompt(peer_factory, secret=secret)
    reply = _exchange(port, wire.encode(wire.Attach(cluster_id=DECODER_ID, token="00" * 16)))
    assert isinstance(reply, wire.Reply) and reply.status == S.LLM_LINK_FAILED
