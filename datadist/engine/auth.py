"""Shared-secret mutual authentication: the one HMAC handshake of datadist links and ems.

Both sides hold the same secret.  The exchange, before anything else is served:

1. client -> server: ``client_nonce`` (32 random bytes) and ``client_id`` (bytes naming it).
2. server -> client: ``server_nonce``, ``server_id`` and
   ``mac(secret, SERVER, client_nonce, server_nonce, client_id, server_id)``.
3. client checks the server's proof, then sends
   ``mac(secret, CLIENT, client_nonce, server_nonce, client_id, server_id)``.
4. server checks the client's proof; only then does it serve.

Each proof covers both fresh nonces and both identities, so a recorded exchange replayed
against a new nonce fails, and the direction label keeps a proof from being reflected back.
Proofs are compared in constant time.  A :class:`Secret` never shows its bytes in ``repr``
or ``str``, so it cannot leak through logs or exception messages.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from typing import NoReturn, Optional

__all__ = ["NONCE_BYTES", "MAC_BYTES", "CLIENT", "SERVER", "Secret", "new_nonce", "mac",
           "verify", "load_secret"]

NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
#: Direction labels: a client's proof can never pass as a server's, or the reverse.
CLIENT = b"datadist-auth-v1 client"
SERVER = b"datadist-auth-v1 server"


class Secret:
    """A shared secret; its bytes are reachable only through :meth:`key`."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or not key:
            raise ValueError("a link secret must be non-empty bytes")
        self._key = bytes(key)

    def key(self) -> bytes:
        return self._key

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:  # never pickled into a child's arguments or a log record
        raise TypeError("a Secret cannot be pickled")


def new_nonce() -> bytes:
    """A fresh random challenge."""
    return os.urandom(NONCE_BYTES)


def _framed(part: bytes) -> bytes:
    # Length-prefixed, so (b"ab", b"c") and (b"a", b"bc") never give the same transcript.
    return len(part).to_bytes(4, "big") + part


def mac(secret: Secret, label: bytes, client_nonce: bytes, server_nonce: bytes,
        client_id: bytes, server_id: bytes) -> bytes:
    """The proof of one direction over the whole transcript."""
    h = hmac.new(secret.key(), digestmod=hashlib.sha256)
    for part in (label, client_nonce, server_nonce, client_id, server_id):
        h.update(_framed(bytes(part)))
    return h.digest()


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(bytes(expected), bytes(got))


def load_secret(value: Optional[str | bytes] = None, path: Optional[str] = None,
                env_var: Optional[str] = None) -> Optional[Secret]:
    """The first of ``value``, the contents of the file ``path`` and the environment variable
    ``env_var`` that is set, as a :class:`Secret`; ``None`` when none is.

    A file's trailing newline is dropped.  Raises ``ValueError`` (naming the file, never its
    contents) when the file cannot be read or is empty.
    """
    if value:
        return Secret(value.encode() if isinstance(value, str) else bytes(value))
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 16).rstrip(b"\r\n")
        except OSError as e:
            raise ValueError(f"secret file {path!r} cannot be read: {e.strerror}") from None
        if not data:
            raise ValueError(f"secret file {path!r} is empty")
        return Secret(data)
    if env_var:
        env = os.environ.get(env_var)
        if env:
            return Secret(env.encode())
    return None
