"""Tenants: who may use the pool, from a credentials file of ``access_id: access_key`` lines.

Without a file the daemon runs open: every client is the single tenant ``""`` (clients
still namespace their keys by ``access_id``).  With one, HELLO must carry a listed id and
its key; each tenant gets its own index and its own shared-memory arena.
"""
from __future__ import annotations

import hmac
import re
from typing import Dict, Optional

from ..config import ID_RE

__all__ = ["Tenants", "AuthError"]

_KEY_RE = re.compile(r"[0-9A-Za-z+/=]{32,256}")
#: A trailing comment: ``#`` after white space (ids and keys hold none).
_COMMENT_RE = re.compile(r"\s#.*$", re.DOTALL)


class AuthError(Exception):
    """Unknown tenant or wrong key."""


class Tenants:
    """The credentials the daemon accepts (``None`` file: open mode)."""

    def __init__(self, creds: Optional[Dict[str, str]] = None) -> None:
        self._creds = creds

    @property
    def open(self) -> bool:
        return self._creds is None

    @classmethod
    def from_file(cls, path: Optional[str]) -> "Tenants":
        """Parse ``access_id: access_key`` lines; blank lines and comments are skipped.

        Ids may hold ``#`` and ``:`` (any printable ASCII but white space and path
        separators), keys neither: a comment is a line that starts with ``#`` or the rest of
        a line from a ``#`` after white space, and the pair splits at the last ``:``.
        """
        if path is None:
            return cls(None)
        creds: Dict[str, str] = {}
        with open(path, encoding="utf-8") as f:
            for lineno, raw in enumerate(f, 1):
                line = _COMMENT_RE.sub("", raw).strip()
                if not line or line.startswith("#"):
                    continue
                ident, sep, key = (part.strip() for part in line.rpartition(":"))
                if not sep or not ID_RE.fullmatch(ident) or not _KEY_RE.fullmatch(key):
                    raise ValueError(f"{path}:{lineno}: expected 'access_id: access_key'")
                if ident in creds:
                    raise ValueError(f"{path}:{lineno}: access_id {ident!r} listed twice")
                creds[ident] = key
        return cls(creds)

    def authenticate(self, access_id: Optional[str], access_key: Optional[str]) -> str:
        """The tenant name for these credentials; raises :class:`AuthError`."""
        if self._creds is None:
            return ""
        if not access_id or access_key is None:
            raise AuthError("this pool requires access_id and access_key")
        expected = self._creds.get(access_id)
        if expected is None or not hmac.compare_digest(expected.encode(), access_key.encode()):
            raise AuthError(f"unknown access_id or wrong access_key for {access_id!r}")
        return access_id
