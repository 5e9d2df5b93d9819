"""Configuration dataclasses of the client API, validated in ``__post_init__``.

``EmsConfig`` carries the vendor's fields plus ours (how to reach the pool).  Every invalid
field raises ``EmsException(EMS_INVALID_ARGUMENT)`` whose message names the field.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Self, Union

from datadist.engine.auth import Secret, load_secret
from datadist.engine.tls import TlsConfig
from datadist.engine.tls import from_settings as tls_from_settings

from ._errors import invalid, to_ems

__all__ = ["EmsConfig", "CcConfig", "CcConfig_v1", "KVCacheType", "KVCACHE_TYPES", "ENV_SERVER", "ID_RE",
           "Layout"]

#: The kvcache_type values the vendor defines.
KVCACHE_TYPES = ("GQA", "MHA", "MLA", "MQA")
#: Environment variable naming the pool when ``EmsConfig.server`` is not given.
ENV_SERVER = "EMS_SERVER"
#: Environment variable holding the pool secret when ``EmsConfig.secret`` is not given.
ENV_SECRET = "EMS_SECRET"
#: Environment variables giving the TLS files (certificate, key, CA) when none of
#: ``EmsConfig.tls_*_file`` is set; ``ems-server`` reads them too.
ENV_TLS_FILES = ("EMS_TLS_CERT_FILE", "EMS_TLS_KEY_FILE", "EMS_TLS_CA_FILE")

#: Ids (model, tenant, engine): printable ASCII without white space or path separators, so
#: the vendor's own defaults (``cc_kvstore@_@ds_default_ns_001``) pass; key text escapes
#: the characters it uses itself (``ems.keys``).
ID_RE = re.compile(r"[\x21-\x2e\x30-\x5b\x5d-\x7e]{1,512}")
_KEY_RE = re.compile(r"[0-9A-Za-z+/=]{32,256}")
_ID_RULE = "1..512 printable ASCII characters without white space, '/' or '\\'"


class KVCacheType(str, Enum):
    """The vendor's kvcache types; members equal their text ("MLA" == KVCacheType.MLA),
    so configs and keys that hold the text keep working."""

    MHA = "MHA"
    MLA = "MLA"
    GQA = "GQA"
    MQA = "MQA"

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:  # as the text's, not Enum's (which names the member)
        return str.__format__(self, format_spec)


def _int(name: str, value: object, lo: int, hi: Optional[int] = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(name, f"must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value >= hi):
        rng = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise invalid(name, f"must be in {rng}, got {value}")


def _ident(name: str, value: object, limit: int = 512) -> None:
    if not isinstance(value, str) or not ID_RE.fullmatch(value) or len(value) > limit:
        rule = _ID_RULE.replace("512", str(limit))
        raise invalid(name, f"must be {rule}, got {value!r}")


def _kvcache_type(value: object) -> str:
    text = value.value if isinstance(value, KVCacheType) else value
    if text not in KVCACHE_TYPES:
        raise invalid("kvcache_type", f"must be one of {', '.join(KVCACHE_TYPES)}, got {value!r}")
    return str(text)


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: the fields of ``CcConfig_v1`` that namespace its keys (a
    snapshot taken at :meth:`ems.Ems.init`, plain text throughout)."""

    rank_id: int
    device_id: int
    model_id: str
    tp_world_size: int
    pp_world_size: int
    rank_in_tp_group: int
    rank_in_pp_group: int
    llm_engine: str
    kvcache_type: str


class _Checked:
    """Configs are plain mutable objects, as the vendor's: clients set fields after
    construction.  Fields are checked at construction and again at use (``validate``)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> Self:
        """Check every field; raises ``EmsException(EMS_INVALID_ARGUMENT)`` naming it."""
        try:
            self._check()
        except Exception as exc:
            raise to_ems(exc) from None
        return self

    def _check(self) -> None:
        raise NotImplementedError


@dataclass
class CcConfig(_Checked):
    """Context-caching config of the vendor's first form (no engine / kvcache_type)."""

    rank_id: int
    device_id: int
    model_id: str
    tp_world_size: int = 1
    pp_world_size: int = 1

    def _check(self) -> None:
        _check_common(self)

    def layout(self) -> Layout:
        """This config, checked again, as a :class:`Layout` (tp/pp index 0, engine vllm, MHA)."""
        self.validate()
        return Layout(self.rank_id, self.device_id, self.model_id, self.tp_world_size,
                      self.pp_world_size, 0, 0, "vllm", "MHA")


@dataclass
class CcConfig_v1(_Checked):  # noqa: N801 - the vendor's name
    """Context-caching config with the parallel layout, engine and kvcache type
    (``kvcache_type``: a :class:`KVCacheType` or its text)."""

    rank_id: int
    device_id: int
    model_id: str
    tp_world_size: int = 1
    pp_world_size: int = 1
    rank_in_tp_group: int = 0
    rank_in_pp_group: int = 0
    llm_engine: str = "vllm"
    kvcache_type: Union[str, KVCacheType] = "MHA"

    def _check(self) -> None:
        _check_common(self)
        _int("rank_in_tp_group", self.rank_in_tp_group, 0, self.tp_world_size)
        _int("rank_in_pp_group", self.rank_in_pp_group, 0, self.pp_world_size)
        _ident("llm_engine", self.llm_engine, 64)
        _kvcache_type(self.kvcache_type)

    def layout(self) -> Layout:
        """This config, checked again, as a :class:`Layout`."""
        self.validate()
        return Layout(self.rank_id, self.device_id, self.model_id, self.tp_world_size,
                      self.pp_world_size, self.rank_in_tp_group, self.rank_in_pp_group,
                      self.llm_engine, _kvcache_type(self.kvcache_type))


def _check_common(cfg: Union[CcConfig, CcConfig_v1]) -> None:
    _int("rank_id", cfg.rank_id, 0)
    _int("device_id", cfg.device_id, 0)
    _ident("model_id", cfg.model_id)
    _int("tp_world_size", cfg.tp_world_size, 1)
    _int("pp_world_size", cfg.pp_world_size, 1)


@dataclass
class EmsConfig(_Checked):
    """Configuration of :meth:`ems.Ems.init`.

    Vendor fields: ``cc_config`` / ``cc_config_v1`` (exactly one; either field takes either
    config class), ``access_id`` (1..512 printable ASCII characters without white space or
    path separators) and ``access_key`` (32..256 of ``[0-9A-Za-z+/=]``, or empty: no
    credential, for a pool without tenants); an ``access_id`` needs an ``access_key``.  An
    empty ``access_id`` is the same as none: with an empty or absent ``access_key`` it
    means "no tenant" (a pool with tenants refuses it at init).  Fields may be set after
    construction; :meth:`ems.Ems.init` checks them again.

    Our fields:
        server: ``"auto"`` (default; env ``EMS_SERVER`` overrides the default), a socket
            directory, ``unix://PATH`` (socket file or directory) or ``tcp://HOST:PORT``.
        connect_timeout: ms allowed to connect and handshake at init and on reconnects.
        max_inflight: worker threads (and pool connections) serving async_save/async_load.
        verify_reads: check each loaded value's checksum (a mismatch is a miss).
        secret: the pool secret (else env ``EMS_SECRET``), for a daemon started with
            ``--secret-file``: both prove they hold it before credentials or memory are
            exchanged.  Never shown in ``repr``.
        tls_cert_file, tls_key_file, tls_ca_file: TLS for a ``tcp://`` pool, all three
            or none (else env ``EMS_TLS_CERT_FILE``, ``EMS_TLS_KEY_FILE``,
            ``EMS_TLS_CA_FILE``, all or none): this client's certificate, its key, and
            the CA that must have signed the daemon's (mutual TLS, as links do; see
            docs/security.md).  Unused on a unix socket.
    """

    cc_config: Optional[Union[CcConfig, CcConfig_v1]] = None
    cc_config_v1: Optional[Union[CcConfig, CcConfig_v1]] = None
    access_id: Optional[str] = None
    access_key: Optional[str] = field(default=None, repr=False)
    server: Optional[str] = None
    connect_timeout: int = 3000
    max_inflight: int = 4
    verify_reads: bool = True
    secret: Optional[str] = field(default=None, repr=False)
    tls_cert_file: Optional[str] = None
    tls_key_file: Optional[str] = None
    tls_ca_file: Optional[str] = None

    def _check(self) -> None:
        self._check_cc()
        self._check_credentials()
        self._check_pool()

    def _check_cc(self) -> None:
        """``cc_config`` / ``cc_config_v1``: at most one, of a config class, itself valid."""
        for name in ("cc_config", "cc_config_v1"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (CcConfig, CcConfig_v1)):
                raise invalid(name, f"must be a CcConfig or CcConfig_v1, got {type(value).__name__}")
            if value is not None:
                value._check()
        if self.cc_config is not None and self.cc_config_v1 is not None:
            raise invalid("cc_config", "give cc_config or cc_config_v1, not both")

    def _check_credentials(self) -> None:
        """``access_id`` and ``access_key``: each well formed; an ``access_id`` comes with an
        ``access_key`` (which may be empty).  An empty or absent ``access_id`` with an empty
        or absent ``access_key`` means "no tenant" (SPEC section 1: the serving adapters pass
        empty strings by default); a pool with tenants refuses it at init."""
        if self.access_id is not None and self.access_id != "":
            _ident("access_id", self.access_id)
        if self.access_key is not None and (not isinstance(self.access_key, str)
                                            or (self.access_key and not _KEY_RE.fullmatch(self.access_key))):
            raise invalid("access_key", "must be empty or 32..256 characters of [0-9A-Za-z+/=]")
        if not self.access_id:
            if self.access_key:
                raise invalid("access_id", f"access_key is given but access_id is {self.access_id!r}: "
                              "access_id and access_key go together")
        elif self.access_key is None:
            raise invalid("access_key", "access_id and access_key go together")

    def _check_pool(self) -> None:
        """Our fields: how to reach the pool and use it."""
        if self.server is not None and (not isinstance(self.server, str) or not self.server):
            raise invalid("server", f"must be a non-empty str, got {self.server!r}")
        _int("connect_timeout", self.connect_timeout, 1)
        _int("max_inflight", self.max_inflight, 1, 257)
        if not isinstance(self.verify_reads, bool):
            raise invalid("verify_reads", f"must be a bool, got {self.verify_reads!r}")
        if self.secret is not None and (not isinstance(self.secret, str) or not self.secret):
            raise invalid("secret", "must be a non-empty str")  # the value is never shown
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise invalid(name, f"must be a non-empty str (a file's path), got {value!r}")

    def cc(self) -> Optional[Union[CcConfig, CcConfig_v1]]:
        """The context-caching config given (either field), or None."""
        return self.cc_config if self.cc_config is not None else self.cc_config_v1

    def pool_secret(self) -> Optional[Secret]:
        """The pool secret: ``secret``, else env ``EMS_SECRET``, else None."""
        return load_secret(self.secret, None, ENV_SECRET)

    def pool_tls(self) -> Optional[TlsConfig]:
        """TLS for a ``tcp://`` pool: the three ``tls_*_file`` fields, else the three
        environment variables, else None; ``InvalidArgument`` naming the field (or
        variable) for an incomplete set or an unusable file."""
        try:
            return tls_from_settings([(name, getattr(self, name)) for name in
                                      ("tls_cert_file", "tls_key_file", "tls_ca_file")], ENV_TLS_FILES)
        except ValueError as exc:
            raise invalid("tls_cert_file", str(exc)) from None

    def server_address(self) -> str:
        """The pool address: ``server``, else env ``EMS_SERVER``, else ``"auto"``."""
        return self.server or os.environ.get(ENV_SERVER) or "auto"
