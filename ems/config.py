"""Configuration dataclasses of the client API, validated in ``__post_init__``.

``EmsConfig`` carries the vendor's fields plus ours (how to reach the pool).  Every invalid
field raises ``EmsException(EMS_INVALID_ARGUMENT)`` whose message names the field.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional, Union

from ._errors import invalid, to_ems

__all__ = ["EmsConfig", "CcConfig", "CcConfig_v1", "KVCACHE_TYPES", "ENV_SERVER", "Layout"]

#: The kvcache_type values the vendor defines.
KVCACHE_TYPES = ("GQA", "MHA", "MLA", "MQA")
#: Environment variable naming the pool when ``EmsConfig.server`` is not given.
ENV_SERVER = "EMS_SERVER"

_ID_RE = re.compile(r"[0-9a-z._-]{1,512}")
_KEY_RE = re.compile(r"[0-9A-Za-z+/=]{32,256}")


def _int(name: str, value: object, lo: int, hi: Optional[int] = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(name, f"must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value >= hi):
        rng = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise invalid(name, f"must be in {rng}, got {value}")


def _ident(name: str, value: object) -> None:
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise invalid(name, f"must be 1..512 characters of [0-9a-z._-], got {value!r}")


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: the fields of ``CcConfig_v1`` that namespace its keys."""

    rank_id: int
    device_id: int
    model_id: str
    tp_world_size: int
    pp_world_size: int
    rank_in_tp_group: int
    rank_in_pp_group: int
    llm_engine: str
    kvcache_type: str


@dataclass(frozen=True)
class CcConfig:
    """Context-caching config of the vendor's first form (no engine / kvcache_type)."""

    rank_id: int
    device_id: int
    model_id: str
    tp_world_size: int = 1
    pp_world_size: int = 1

    def __post_init__(self) -> None:
        try:
            _check_common(self)
        except Exception as exc:
            raise to_ems(exc) from None

    def layout(self) -> Layout:
        """This config as a :class:`Layout` (tp/pp index 0, engine vllm, MHA)."""
        return Layout(self.rank_id, self.device_id, self.model_id, self.tp_world_size,
                      self.pp_world_size, 0, 0, "vllm", "MHA")


@dataclass(frozen=True)
class CcConfig_v1:  # noqa: N801 - the vendor's name
    """Context-caching config with the parallel layout, engine and kvcache type."""

    rank_id: int
    device_id: int
    model_id: str
    tp_world_size: int = 1
    pp_world_size: int = 1
    rank_in_tp_group: int = 0
    rank_in_pp_group: int = 0
    llm_engine: str = "vllm"
    kvcache_type: str = "MHA"

    def __post_init__(self) -> None:
        try:
            _check_common(self)
            _int("rank_in_tp_group", self.rank_in_tp_group, 0, self.tp_world_size)
            _int("rank_in_pp_group", self.rank_in_pp_group, 0, self.pp_world_size)
            if (not isinstance(self.llm_engine, str) or not 0 < len(self.llm_engine) <= 64
                    or not self.llm_engine.isprintable() or "|" in self.llm_engine):
                raise invalid("llm_engine", f"must be a printable str of 1..64 characters "
                              f"without '|', got {self.llm_engine!r}")
            if self.kvcache_type not in KVCACHE_TYPES:
                raise invalid("kvcache_type", f"must be one of {', '.join(KVCACHE_TYPES)}, "
                              f"got {self.kvcache_type!r}")
        except Exception as exc:
            raise to_ems(exc) from None

    def layout(self) -> Layout:
        """This config as a :class:`Layout`."""
        return Layout(self.rank_id, self.device_id, self.model_id, self.tp_world_size,
                      self.pp_world_size, self.rank_in_tp_group, self.rank_in_pp_group,
                      self.llm_engine, self.kvcache_type)


def _check_common(cfg: Union[CcConfig, CcConfig_v1]) -> None:
    _int("rank_id", cfg.rank_id, 0)
    _int("device_id", cfg.device_id, 0)
    _ident("model_id", cfg.model_id)
    _int("tp_world_size", cfg.tp_world_size, 1)
    _int("pp_world_size", cfg.pp_world_size, 1)


@dataclass(frozen=True)
class EmsConfig:
    """Configuration of :meth:`ems.Ems.init`.

    Vendor fields: ``cc_config`` / ``cc_config_v1`` (exactly one; either field takes either
    config class), ``access_id`` (1..512 of ``[0-9a-z._-]``) and ``access_key`` (32..256 of
    ``[0-9A-Za-z+/=]``), given together or not at all.

    Our fields:
        server: ``"auto"`` (default; env ``EMS_SERVER`` overrides the default), a socket
            directory, ``unix://PATH`` (socket file or directory) or ``tcp://HOST:PORT``.
        connect_timeout: ms allowed to connect and handshake at init and on reconnects.
        max_inflight: worker threads (and pool connections) serving async_save/async_load.
        verify_reads: check each loaded value's checksum (a mismatch is a miss).
    """

    cc_config: Optional[Union[CcConfig, CcConfig_v1]] = None
    cc_config_v1: Optional[Union[CcConfig, CcConfig_v1]] = None
    access_id: Optional[str] = None
    access_key: Optional[str] = field(default=None, repr=False)
    server: Optional[str] = None
    connect_timeout: int = 3000
    max_inflight: int = 4
    verify_reads: bool = True

    def __post_init__(self) -> None:
        try:
            self._check()
        except Exception as exc:
            raise to_ems(exc) from None

    def _check(self) -> None:
        for name in ("cc_config", "cc_config_v1"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (CcConfig, CcConfig_v1)):
                raise invalid(name, f"must be a CcConfig or CcConfig_v1, got {type(value).__name__}")
        if self.cc_config is not None and self.cc_config_v1 is not None:
            raise invalid("cc_config", "give cc_config or cc_config_v1, not both")
        if self.access_id is not None:
            _ident("access_id", self.access_id)
        if self.access_key is not None and (not isinstance(self.access_key, str)
                                            or not _KEY_RE.fullmatch(self.access_key)):
            raise invalid("access_key", "must be 32..256 characters of [0-9A-Za-z+/=]")
        if (self.access_id is None) != (self.access_key is None):
            raise invalid("access_key" if self.access_key is None else "access_id",
                          "access_id and access_key go together")
        if self.server is not None and (not isinstance(self.server, str) or not self.server):
            raise invalid("server", f"must be a non-empty str, got {self.server!r}")
        _int("connect_timeout", self.connect_timeout, 1)
        _int("max_inflight", self.max_inflight, 1, 257)
        if not isinstance(self.verify_reads, bool):
            raise invalid("verify_reads", f"must be a bool, got {self.verify_reads!r}")

    def cc(self) -> Optional[Union[CcConfig, CcConfig_v1]]:
        """The context-caching config given (either field), or None."""
        return self.cc_config if self.cc_config is not None else self.cc_config_v1

    def server_address(self) -> str:
        """The pool address: ``server``, else env ``EMS_SERVER``, else ``"auto"``."""
        return self.server or os.environ.get(ENV_SERVER) or "auto"
