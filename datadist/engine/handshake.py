"""The authenticated opening of a connection, when both ends share a secret: the one
exchange that datadist links and ems pool connections both use.

1. The client opens with its identity and a fresh nonce, and nothing else (no memory, no
   descriptors, no credentials).
2. The server answers with its own fresh nonce and its proof over both nonces and both
   identities (:mod:`datadist.engine.auth`).
3. The client checks that proof and only then sends its real opening with its own proof.
4. The server checks the client's proof before it answers with anything of its own.

A peer without the secret learns nothing but a generic refusal; a recorded exchange cannot
be replayed, since each side's nonce is fresh.  Nonces and proofs travel as hex text in the
protocols' own messages; this module knows nothing of either protocol.
"""
from __future__ import annotations

from typing import Optional

from . import auth

__all__ = ["REFUSAL", "ClientAuth", "ServerAuth"]

#: The one message an unauthenticated peer ever gets.
REFUSAL = "authentication failed"


def _unhex(text: object, size: int) -> Optional[bytes]:
    if not isinstance(text, str) or len(text) != 2 * size:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


class ClientAuth:
    """The client's side: its nonce, the check of the server's proof, its own proof."""

    def __init__(self, secret: auth.Secret, client_id: bytes, server_id: bytes) -> None:
        self.secret = secret
        self.nonce = auth.new_nonce()
        self.ids = (client_id, server_id)

    @property
    def nonce_hex(self) -> str:
        return self.nonce.hex()

    def answer(self, server_nonce_hex: object, server_proof_hex: object) -> Optional[str]:
        """The client's proof (hex) if the server's proves it holds the secret, else None."""
        server_nonce = _unhex(server_nonce_hex, auth.NONCE_BYTES)
        proof = _unhex(server_proof_hex, auth.MAC_BYTES)
        if server_nonce is None or proof is None:
            return None
        if not auth.verify(auth.mac(self.secret, auth.SERVER, self.nonce, server_nonce, *self.ids), proof):
            return None
        return auth.mac(self.secret, auth.CLIENT, self.nonce, server_nonce, *self.ids).hex()


class ServerAuth:
    """The server's side of one opening, kept between its challenge and the client's proof."""

    def __init__(self, secret: auth.Secret, client_nonce: bytes, client_id: bytes, server_id: bytes) -> None:
        self.secret = secret
        self.client_nonce = client_nonce
        self.server_nonce = auth.new_nonce()
        self.ids = (client_id, server_id)

    @classmethod
    def start(cls, secret: auth.Secret, client_nonce_hex: object, client_id: bytes,
              server_id: bytes) -> Optional["ServerAuth"]:
        """State for a client's opening; None if its nonce is malformed (refuse it)."""
        nonce = _unhex(client_nonce_hex, auth.NONCE_BYTES)
        return None if nonce is None else cls(secret, nonce, client_id, server_id)

    def challenge(self) -> tuple[str, str]:
        """``(server nonce, server proof)``, hex, to send to the client."""
        proof = auth.mac(self.secret, auth.SERVER, self.client_nonce, self.server_nonce, *self.ids)
        return self.server_nonce.hex(), proof.hex()

    def check(self, client_nonce_hex: object, proof_hex: object) -> bool:
        """Whether the client's real opening answers this very challenge."""
        proof = _unhex(proof_hex, auth.MAC_BYTES)
        if proof is None or _unhex(client_nonce_hex, auth.NONCE_BYTES) != self.client_nonce:
            return False
        return auth.verify(auth.mac(self.secret, auth.CLIENT, self.client_nonce, self.server_nonce, *self.ids),
                           proof)
