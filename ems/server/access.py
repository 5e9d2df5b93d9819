"""Who may use the pool, from what ``ems-server serve`` was given: tenants (credentials
file), the pool secret and TLS, each read and checked once at start, its error naming the
option that was wrong."""
from __future__ import annotations

from typing import NamedTuple, Optional

from datadist.engine.auth import Secret, load_secret
from datadist.engine.tls import TlsConfig
from datadist.engine.tls import from_settings as tls_from_settings

from ..config import ENV_TLS_FILES
from .config import ServerConfig
from .tenants import Tenants

__all__ = ["Access", "access_of"]


class Access(NamedTuple):
    """The daemon's access settings."""

    tenants: Tenants
    secret: Optional[Secret]
    tls: Optional[TlsConfig]


def access_of(cfg: ServerConfig) -> Access:
    """Read ``cfg``'s credentials, secret and TLS files; ``ValueError`` naming the option
    (``--credentials``, ``--secret-file``, the TLS options or their environment) otherwise."""
    try:
        tenants = Tenants.from_file(cfg.credentials)
    except OSError as exc:
        raise ValueError(f"--credentials {cfg.credentials}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"--credentials: {exc}") from None
    try:
        secret = load_secret(None, cfg.secret_file) if cfg.secret_file else None
    except ValueError as exc:
        raise ValueError(f"--secret-file: {exc}") from None
    try:
        tls = tls_from_settings(list(zip(("--tls-cert-file", "--tls-key-file", "--tls-ca-file"), cfg.tls_files)),
                                ENV_TLS_FILES)
    except ValueError as exc:
        raise ValueError(f"TLS: {exc}") from None
    return Access(tenants, secret, tls)
