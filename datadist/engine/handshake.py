"""The authenticated opening of a link, when the engines share a secret.

Without a secret a link opens with one ``HELLO`` / ``HELLO_ACK`` exchange.  With one, the
client's first ``HELLO`` carries only its cluster ids and a fresh nonce; the server answers
with a challenge (its own nonce and its proof, :mod:`datadist.engine.auth`); the client
checks the proof and only then sends its real ``HELLO`` (pid, host, memory of its pools)
with its own proof, which the server checks before it answers with anything of its own.
A peer without the secret learns nothing but a generic refusal, and neither side maps or
hands out memory before both proofs check.  A recorded exchange cannot be replayed: each
side's nonce is fresh.

Identities in the proofs are the two cluster ids as decimal text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .._status import LLMStatusCode
from . import auth, wire

__all__ = ["REFUSAL", "ClientAuth", "ServerAuth", "refusal", "opening_hello"]

#: The one message an unauthenticated peer ever gets.
REFUSAL = "authentication failed"
_NONCE_HEX = 2 * auth.NONCE_BYTES


def _ids(client_cluster: int, server_cluster: int) -> tuple[bytes, bytes]:
    return str(client_cluster).encode(), str(server_cluster).encode()


def _hex(text: str, size: int) -> Optional[bytes]:
    if not isinstance(text, str) or len(text) != 2 * size:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


class ClientAuth:
    """The client's side: its nonce, the check of the server's proof, its own proof."""

    def __init__(self, secret: auth.Secret, cluster_id: int, remote_cluster_id: int) -> None:
        self.secret = secret
        self.nonce = auth.new_nonce()
        self.clusters = (cluster_id, remote_cluster_id)
        self.ids = _ids(cluster_id, remote_cluster_id)

    def opening(self) -> wire.Hello:
        """The first HELLO: identity and nonce, nothing that grants access to memory."""
        return wire.Hello(cluster_id=self.clusters[0], remote_cluster_id=self.clusters[1], nonce=self.nonce.hex())

    def answer(self, challenge: wire.Message) -> Optional[str]:
        """The client's proof (hex) if ``challenge`` proves the server holds the secret."""
        if not isinstance(challenge, wire.HelloAck) or not challenge.challenge or challenge.status:
            return None
        server_nonce = _hex(challenge.nonce, auth.NONCE_BYTES)
        proof = _hex(challenge.proof, auth.MAC_BYTES)
        if server_nonce is None or proof is None:
            return None
        expected = auth.mac(self.secret, auth.SERVER, self.nonce, server_nonce, *self.ids)
        if not auth.verify(expected, proof):
            return None
        return auth.mac(self.secret, auth.CLIENT, self.nonce, server_nonce, *self.ids).hex()


@dataclass
class ServerAuth:
    """The server's side of one opening, kept between the challenge and the proof."""

    secret: auth.Secret
    client_cluster: int
    client_nonce: bytes
    server_nonce: bytes
    server_cluster: int

    @classmethod
    def challenge(cls, secret: auth.Secret, hello: wire.Hello,
                  own_cluster: int) -> tuple[Optional["ServerAuth"], wire.HelloAck]:
        """Answer an opening HELLO: the challenge, or (None, a generic refusal)."""
        nonce = _hex(hello.nonce, auth.NONCE_BYTES)
        if nonce is None or hello.proof or hello.remote_cluster_id != own_cluster:
            return None, refusal()
        state = cls(secret, hello.cluster_id, nonce, auth.new_nonce(), own_cluster)
        proof = auth.mac(secret, auth.SERVER, nonce, state.server_nonce, *state.ids)
        return state, wire.HelloAck(challenge=True, nonce=state.server_nonce.hex(), proof=proof.hex())

    @property
    def ids(self) -> tuple[bytes, bytes]:
        return _ids(self.client_cluster, self.server_cluster)

    def check(self, hello: wire.Message) -> bool:
        """Whether ``hello`` is the same client's real HELLO with a valid proof."""
        if not isinstance(hello, wire.Hello) or hello.cluster_id != self.client_cluster:
            return False
        if hello.remote_cluster_id != self.server_cluster or _hex(hello.nonce, auth.NONCE_BYTES) != self.client_nonce:
            return False
        proof = _hex(hello.proof, auth.MAC_BYTES)
        expected = auth.mac(self.secret, auth.CLIENT, self.client_nonce, self.server_nonce, *self.ids)
        return proof is not None and auth.verify(expected, proof)


def refusal() -> wire.HelloAck:
    """A refusal that names nothing of this engine."""
    return wire.HelloAck(status=int(LLMStatusCode.LLM_LINK_FAILED), message=REFUSAL)


def opening_hello(msg: wire.Hello) -> bool:
    """Whether a HELLO is an authenticated opening (nonce, no proof yet)."""
    return bool(msg.nonce) and not msg.proof
