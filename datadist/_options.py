"""Parsing of the options dict: :func:`parse_options`, the one place it is read, and the
typed, validated :class:`EngineOptions` it produces (SPEC-datadist section 2).

A bad value is a :class:`~datadist._status.ParamInvalidError` naming the option key, the
``LLMConfig`` property and the value.  The engine reads nothing but :class:`EngineOptions`;
no string-keyed dict travels past :func:`parse_options`.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

from ._cluster import ip_to_str
from ._option_keys import (ENV_METRICS_PORT, OPTION_METRICS_PORT, Bad, CANN_INTERNAL_KEYS, DEFAULT_LINK_RETRY_COUNT, DEFAULT_LINK_TOTAL_TIME_S,
                           DEFAULT_SYNC_KV_TIMEOUT_MS, DEVICE_TYPES, ENV_LINK_SECRET, INT32_MAX, KEY_OF_FIELD,
                           LINK_RETRY_RANGE, OPTION_BUF_POOL_CFG, OPTION_CLUSTER_INFO, OPTION_DEPLOY_RES_PATH,
                           OPTION_DEVICE_ID, OPTION_DEVICE_TYPE, OPTION_ENABLE_CACHE_MANAGER,
                           OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE, OPTION_ENABLE_SWITCH_ROLE,
                           OPTION_GLOBAL_RESOURCE_CONFIG, OPTION_HOST_MEM_POOL_CONFIG, OPTION_LINK_RETRY_COUNT,
                           OPTION_LINK_SECRET, OPTION_LINK_SECRET_FILE, OPTION_LINK_TOTAL_TIME,
                           OPTION_LISTEN_IP_INFO, OPTION_LOCAL_COMM_RES, OPTION_MEMORY_UTILIZATION,
                           OPTION_MEM_POOL_CONFIG, OPTION_OUTPUT_MAX_SIZE, OPTION_RDMA_SERVICE_LEVEL,
                           OPTION_RDMA_TRAFFIC_CLASS, OPTION_SESSION_DEVICE_ID, OPTION_SYNC_KV_TIMEOUT,
                           OPTION_TLS_CA_FILE, OPTION_TLS_CERT_FILE, OPTION_TLS_KEY_FILE, OPTION_TRANSFER_BACKEND,
                           OPTION_TRANSFER_CHECKSUM, PAGE_SHIFT_RANGE, PROPERTY_OF_KEY, RDMA_SERVICE_LEVEL_MAX, TLS_OPTIONS, TRANSFER_BACKENDS,
                           TRANSFER_BACKEND_ALIASES, UINT32_MAX, describe_key)
from ._status import ParamInvalidError
from .engine.auth import Secret, load_secret
from .engine.tls import TlsConfig
from .engine.tls import from_settings as tls_from_settings

__all__ = ["PoolConfig", "EngineOptions", "parse_options", "parse_listen_ip_info", "KNOWN_OPTION_KEYS"]

_log = logging.getLogger("datadist._config")


# ------------------------------------------------------------------ parsed options


@dataclass(frozen=True)
class PoolConfig:
    """A memory pool (``llm.MemPoolConfig`` / ``llm.HostMemPoolConfig``).

    Attributes:
        memory_size: pool bytes, > 0.
        page_shift: allocations are rounded up to ``2**page_shift`` bytes; in [10, 30]
            (CANN's ``[10, 31)``), default 16 (64 KiB).
    """

    memory_size: int
    page_shift: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.memory_size, bool) or not isinstance(self.memory_size, int):
            raise TypeError(f"memory_size must be an int, got {type(self.memory_size).__name__}")
        if isinstance(self.page_shift, bool) or not isinstance(self.page_shift, int):
            raise TypeError(f"page_shift must be an int, got {type(self.page_shift).__name__}")
        if self.memory_size <= 0:
            raise ParamInvalidError(f"memory_size = {self.memory_size} is invalid, must be > 0 (bytes)")
        lo, hi = PAGE_SHIFT_RANGE
        if not lo <= self.page_shift <= hi:
            raise ParamInvalidError(f"page_shift = {self.page_shift} is invalid, must be in [{lo}, {hi}]")

    @property
    def page_size(self) -> int:
        return 1 << self.page_shift


@dataclass(frozen=True)
class EngineOptions:
    """Everything the engine reads from the options dict, typed and validated.

    Attributes:
        device_id: accelerator index (``ge.exec.deviceId``; the first of several); ignored on CPU.
        device_ids: every id ``ge.exec.deviceId`` names (CANN joins several with ";"; an
            engine runs on one, so ``init`` refuses more); () when unset.
        sync_kv_timeout_ms: deadline of every pull/push/copy, ms, in [1, 2**31-1].
        listen_ip, listen_port: the server address from ``llm.listenIpInfo`` ("ip:port";
            port 0 lets the system pick), or both None for a client-only engine.
        mem_pool, host_mem_pool: pools for ``allocate_*`` with DEVICE / HOST placement;
            None: that allocation raises ``LLM_PARAM_INVALID`` (as CANN).
        link_total_time_s: link deadline in seconds. CANN's default applies when the
            option is unset or 0: ``HCCL_CONNECT_TIMEOUT`` from the environment, else 120.
        link_retry_count: link attempts within that deadline, in [1, 100], default 1.
        transfer_backend: one of :data:`TRANSFER_BACKENDS`.
        device_type: one of :data:`DEVICE_TYPES` ("auto" is resolved by the engine).
        enable_cache_manager, enable_remote_cache_accessible: accepted for compatibility;
            CacheManager mode is the only mode and caches are remotely accessible.
        local_comm_res: the ``llm.LocalCommRes`` JSON, kept as given (None: unset).
        rdma_traffic_class: in [0, 255], a multiple of 4 (None: unset).
        rdma_service_level: in [0, 7] (None: unset).
        link_secret: the shared secret that turns on mutual authentication of links
            (``datadist.LinkSecret``, else the file ``datadist.LinkSecretFile``, else the
            environment ``DATADIST_LINK_SECRET``); None: links are not authenticated.
        tls: mutual TLS on every link connection (``datadist.TlsCertFile``,
            ``datadist.TlsKeyFile``, ``datadist.TlsCaFile``: all three or none; else the
            environment ``DATADIST_TLS_CERT_FILE``, ``..._KEY_FILE``, ``..._CA_FILE``);
            None: links are plain TCP.  Not with a collective ``transfer_backend``, whose
            payloads would bypass it.
        metrics_host, metrics_port: where the Prometheus endpoint listens
            (``datadist.MetricsPort`` "[host:]port", else the environment
            ``DATADIST_METRICS_PORT``; host 0.0.0.0 when only a port is given; port 0: the
            system picks); both None: no endpoint (``LLMDataDist.metrics()`` counts anyway).
        transfer_checksum: end-to-end integrity of the transfers this engine starts
            (``datadist.TransferChecksum``, default False): the sender sums each payload
            while sending it, the receiver while receiving it (a one-sided shm copy: the
            copier while copying, the owner by its own reading), and a mismatch fails the
            transfer with ``LLM_LINK_FAILED`` (docs/security.md); not with a collective
            ``transfer_backend``, whose payloads would bypass it.

    Constructing one directly validates it the same way (``__post_init__``).
    """

    device_id: int = 0
    device_ids: Tuple[int, ...] = ()
    sync_kv_timeout_ms: int = DEFAULT_SYNC_KV_TIMEOUT_MS
    listen_ip: Optional[str] = None
    listen_port: Optional[int] = None
    mem_pool: Optional[PoolConfig] = None
    host_mem_pool: Optional[PoolConfig] = None
    link_total_time_s: float = DEFAULT_LINK_TOTAL_TIME_S
    link_retry_count: int = DEFAULT_LINK_RETRY_COUNT
    transfer_backend: str = "auto"
    device_type: str = "auto"
    enable_cache_manager: bool = True
    enable_remote_cache_accessible: bool = True
    local_comm_res: Optional[str] = None
    rdma_traffic_class: Optional[int] = None
    rdma_service_level: Optional[int] = None
    link_secret: Optional[Secret] = None
    tls: Optional[TlsConfig] = None
    metrics_host: Optional[str] = None
    metrics_port: Optional[int] = None
    transfer_checksum: bool = False

    def __post_init__(self) -> None:
        self._check_int("device_id", 0, INT32_MAX)
        self._check_device_ids()
        self._check_int("sync_kv_timeout_ms", 1, INT32_MAX, unit=" ms")
        if (self.listen_ip is None) != (self.listen_port is None):
            self._bad("listen_ip", f"listen_ip={self.listen_ip!r} and listen_port={self.listen_port!r} "
                                   "must be given together")
        if self.listen_ip is not None:
            self._check_type("listen_ip", str)
            try:
                canonical = ip_to_str(self.listen_ip)
            except ParamInvalidError as exc:
                self._bad("listen_ip", str(exc))
            if canonical != self.listen_ip:
                self._bad("listen_ip", f"write the address as {canonical!r}")
            self._check_int("listen_port", 0, 65535)
        for name in ("mem_pool", "host_mem_pool"):
            if getattr(self, name) is not None:
                self._check_type(name, PoolConfig)
        self._check_type("link_total_time_s", (int, float))
        if not 0 < self.link_total_time_s <= UINT32_MAX:
            self._bad("link_total_time_s", f"must be in (0, {UINT32_MAX}] seconds")
        self._check_int("link_retry_count", *LINK_RETRY_RANGE)
        self._check_choice("transfer_backend", TRANSFER_BACKENDS)
        self._check_choice("device_type", DEVICE_TYPES)
        self._check_type("enable_cache_manager", bool)
        self._check_type("enable_remote_cache_accessible", bool)
        if self.local_comm_res is not None:
            self._check_type("local_comm_res", str)
        if self.rdma_traffic_class is not None:
            self._check_int("rdma_traffic_class", 0, 255)
            if self.rdma_traffic_class % 4:
                self._bad("rdma_traffic_class", "must be a multiple of 4 (bits 0-1 of the ToS byte are 0)")
        if self.rdma_service_level is not None:
            self._check_int("rdma_service_level", 0, RDMA_SERVICE_LEVEL_MAX)
        if self.link_secret is not None:
            self._check_type("link_secret", Secret)
        if self.tls is not None:
            self._check_type("tls", TlsConfig)
        self._check_type("transfer_checksum", bool)
        self._check_collective()

        self._check_optional_int("metrics_port", 0, 65535)

    def _check_device_ids(self) -> None:
        self._check_type("device_ids", tuple)
        if any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= INT32_MAX for d in self.device_ids):
            self._bad("device_ids", f"every id must be an int in [0, {INT32_MAX}]")

    def _check_collective(self) -> None:
        """A collective backend moves payloads through torch.distributed, past TLS and past
        the transfer checksums: refused with either."""
        if self.transfer_backend not in ("gloo", "nccl", "hccl"):
            return
        if self.tls is not None:
            self._bad("transfer_backend", f"a collective backend moves payloads through torch.distributed, "
                                          f"outside TLS ({OPTION_TLS_CERT_FILE}, {OPTION_TLS_KEY_FILE}, "
                                          f"{OPTION_TLS_CA_FILE} are set): use auto, shm or tcp with TLS")
        if self.transfer_checksum:
            self._bad("transfer_backend", f"a collective backend moves payloads through torch.distributed, which "
                                          f"{OPTION_TRANSFER_CHECKSUM} does not cover: use tcp with it")

    # -- derived views

    @property
    def is_server(self) -> bool:
        """Whether ``llm.listenIpInfo`` was given (this engine listens for links)."""
        return self.listen_ip is not None

    @property
    def listen_address(self) -> Optional[Tuple[str, int]]:
        return None if self.listen_ip is None else (self.listen_ip, int(self.listen_port or 0))

    @property
    def metrics_address(self) -> Optional[Tuple[str, int]]:
        """Where the Prometheus endpoint listens; None: nowhere."""
        return None if self.metrics_port is None else (self.metrics_host or "0.0.0.0", self.metrics_port)

    @property
    def sync_kv_timeout_s(self) -> float:
        return self.sync_kv_timeout_ms / 1000.0

    def replace(self, **changes: Any) -> "EngineOptions":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # -- validation helpers

    def _bad(self, name: str, reason: str) -> None:
        key = KEY_OF_FIELD[name]
        raise ParamInvalidError(f"option {key!r} (LLMConfig.{PROPERTY_OF_KEY[key]}, EngineOptions.{name}) = "
                                f"{getattr(self, name)!r} is invalid: {reason}")

    def _check_type(self, name: str, cls: Union[type, Tuple[type, ...]]) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) and cls is not bool:
            ok = False
        else:
            ok = isinstance(value, cls)
        if not ok:
            names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
            raise TypeError(f"EngineOptions.{name} must be {names}, got {type(value).__name__}")

    def _check_int(self, name: str, lo: int, hi: int, unit: str = "") -> None:
        self._check_type(name, int)
        if not lo <= getattr(self, name) <= hi:
            self._bad(name, f"must be in [{lo}, {hi}]{unit}")

    def _check_optional_int(self, name: str, lo: int, hi: int) -> None:
        if getattr(self, name) is not None:
            self._check_int(name, lo, hi)

    def _check_choice(self, name: str, choices: Tuple[str, ...]) -> None:
        self._check_type(name, str)
        if getattr(self, name) not in choices:
            self._bad(name, f"must be one of {', '.join(choices)}")


# ------------------------------------------------------------------------- parsing


def _to_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise Bad("expected an integer, got a bool")
    if isinstance(raw, str):
        text = raw.strip()
        if re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        raise Bad("expected an integer")
    if isinstance(raw, float):
        if raw.is_integer():
            return int(raw)
        raise Bad("expected an integer")
    if hasattr(raw, "__index__"):
        index: int = raw.__index__()
        return index
    raise Bad(f"expected an integer, got {type(raw).__name__}")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str):
        text = raw.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise Bad('expected "1" or "0"')


def _to_choice(choices: Tuple[str, ...]) -> Callable[[Any], str]:
    def convert(raw: Any) -> str:
        if not isinstance(raw, str) or raw.strip().lower() not in choices:
            raise Bad(f"must be one of {', '.join(choices)}")
        return raw.strip().lower()
    return convert


def _to_backend(raw: Any) -> str:
    if isinstance(raw, str) and not raw.strip():
        return "auto"  # CANN's LLMConfig reads "" while unset
    if isinstance(raw, str) and raw.strip().lower() in TRANSFER_BACKEND_ALIASES:
        return TRANSFER_BACKEND_ALIASES[raw.strip().lower()]
    try:
        return _to_choice(TRANSFER_BACKENDS)(raw)
    except Bad:
        raise Bad(f"must be one of {', '.join(TRANSFER_BACKENDS)} (or CANN's hixl / adxl, meaning auto)") from None


def _to_fraction(raw: Any) -> float:
    if isinstance(raw, bool):
        raise Bad("expected a number in [0, 1], got a bool")
    try:
        value = float(raw.strip() if isinstance(raw, str) else raw)
    except (TypeError, ValueError):
        raise Bad("expected a number in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise Bad("must be in [0, 1]")
    return value


def _to_text(raw: Any) -> str:
    if not isinstance(raw, str):
        raise Bad(f"expected a string, got {type(raw).__name__}")
    return raw


def parse_listen_ip_info(value: Any) -> Tuple[str, int]:
    """Split an ``"ip:port"`` listen address (``llm.listenIpInfo``) into a dotted-quad IPv4
    address and a port in [0, 65535] (0: the system picks one).

    Raises:
        ParamInvalidError: naming the option and the value, if it is not of that form.
    """
    try:
        return _split_ip_port(value)
    except Bad as bad:
        raise ParamInvalidError(f"{describe_key(OPTION_LISTEN_IP_INFO)} = {value!r} is invalid: {bad}") from None


def _split_ip_port(value: Any) -> Tuple[str, int]:
    if not isinstance(value, str):
        raise Bad(f'expected a string "ip:port", got {type(value).__name__}')
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not host:
        raise Bad('expected "ip:port", e.g. "10.0.0.1:26000"')
    try:
        ip = ip_to_str(host)
    except ParamInvalidError as exc:
        raise Bad(str(exc)) from None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise Bad(f"port {port_text!r} is not an integer in [0, 65535]")
    return ip, int(port_text)


def _metrics_address(raw: Any) -> Dict[str, Any]:
    """``"[host:]port"`` of the metrics endpoint (an int: the port)."""
    text = str(raw).strip() if isinstance(raw, (str, int)) and not isinstance(raw, bool) else None
    if text is None:
        raise Bad(f'expected "[host:]port", got {type(raw).__name__}')
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise Bad(f'expected "[host:]port" with a port in [0, 65535], e.g. "9400" or "127.0.0.1:9400"')
    return {"metrics_host": host or None, "metrics_port": int(port)}


def _to_device_ids(raw: Any) -> Tuple[int, Tuple[int, ...]]:
    """``(first id, all ids)``: CANN joins several device ids with ";" (an engine here runs
    on one: ``LLMDataDist.init`` refuses more)."""
    parts = [part for part in raw.split(";") if part.strip()] if isinstance(raw, str) and ";" in raw else [raw]
    if not parts:
        raise Bad("names no device id")
    ids = tuple(_to_int(part) for part in parts)
    return ids[0], ids


def _to_pool(raw: Any) -> PoolConfig:
    if isinstance(raw, str):
        try:
            cfg = json.loads(raw)
        except ValueError as exc:
            raise Bad(f"not valid JSON ({exc})") from None
    else:
        cfg = raw
    if not isinstance(cfg, Mapping):
        raise Bad('expected a JSON object like {"memory_size": 1073741824, "page_shift": 16}')
    if "memory_size" not in cfg:
        raise Bad('"memory_size" (bytes) is required')
    try:
        memory_size = _to_int(cfg["memory_size"])
        page_shift = _to_int(cfg.get("page_shift", 16))
    except Bad as bad:
        raise Bad(f"memory_size and page_shift must be integers ({bad})") from None
    try:
        return PoolConfig(memory_size=memory_size, page_shift=page_shift)
    except ParamInvalidError as exc:
        raise Bad(str(exc)) from None


def _to_json_text(raw: Any) -> str:
    if isinstance(raw, Mapping):
        return json.dumps(raw)
    if not isinstance(raw, str):
        raise Bad(f"expected a JSON string, got {type(raw).__name__}")
    if raw.strip():
        try:
            json.loads(raw)
        except ValueError as exc:
            raise Bad(f"not valid JSON ({exc})") from None
    return raw


def _link_total_time(raw: Any) -> float:
    seconds = _to_int(raw)
    if not 0 <= seconds <= UINT32_MAX:
        raise Bad(f"must be an integer in [0, {UINT32_MAX}] seconds (0: default)")
    return float(seconds) if seconds else _default_link_total_time()


def _default_link_total_time() -> float:
    env = os.environ.get("HCCL_CONNECT_TIMEOUT", "").strip()
    if env.isdigit() and 0 < int(env) <= UINT32_MAX:
        return float(env)
    return DEFAULT_LINK_TOTAL_TIME_S


def _secret_text(raw: Any) -> str:
    # The message never shows the value: it is a secret.
    if not isinstance(raw, str) or not raw:
        raise Bad("expected a non-empty string")
    return raw


def _path_text(raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise Bad("expected a non-empty string (a file path)")
    return raw


def _checked(convert: Callable[[Any], Any]) -> Callable[[Any], Dict[str, Any]]:
    """Parser of an option that is validated but sets nothing (no effect in this library)."""
    def parse(raw: Any) -> Dict[str, Any]:
        convert(raw)
        return {}
    return parse


def _fields(*names: str, convert: Callable[[Any], Any]) -> Callable[[Any], Dict[str, Any]]:
    def parse(raw: Any) -> Dict[str, Any]:
        value = convert(raw)
        values = value if len(names) > 1 else (value,)
        return dict(zip(names, values))
    return parse


_PARSERS: Dict[str, Callable[[Any], Dict[str, Any]]] = {
    OPTION_DEVICE_ID: _fields("device_id", "device_ids", convert=_to_device_ids),
    OPTION_SYNC_KV_TIMEOUT: _fields("sync_kv_timeout_ms", convert=_to_int),
    OPTION_LISTEN_IP_INFO: _fields("listen_ip", "listen_port", convert=_split_ip_port),
    OPTION_ENABLE_CACHE_MANAGER: _fields("enable_cache_manager", convert=_to_bool),
    OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE: _fields("enable_remote_cache_accessible", convert=_to_bool),
    OPTION_MEM_POOL_CONFIG: _fields("mem_pool", convert=_to_pool),
    OPTION_HOST_MEM_POOL_CONFIG: _fields("host_mem_pool", convert=_to_pool),
    OPTION_LINK_TOTAL_TIME: _fields("link_total_time_s", convert=_link_total_time),
    OPTION_LINK_RETRY_COUNT: _fields("link_retry_count", convert=_to_int),
    OPTION_LOCAL_COMM_RES: _fields("local_comm_res", convert=_to_json_text),
    OPTION_RDMA_TRAFFIC_CLASS: _fields("rdma_traffic_class", convert=_to_int),
    OPTION_RDMA_SERVICE_LEVEL: _fields("rdma_service_level", convert=_to_int),
    OPTION_TRANSFER_BACKEND: _fields("transfer_backend", convert=_to_backend),
    OPTION_DEVICE_TYPE: _fields("device_type", convert=_to_choice(DEVICE_TYPES)),
    OPTION_LINK_SECRET: _checked(_secret_text),       # resolved with the file and the environment
    OPTION_LINK_SECRET_FILE: _checked(_secret_text),  # in parse_options, first set wins
    OPTION_TLS_CERT_FILE: _checked(_path_text),       # the three together, in parse_options
    OPTION_TLS_KEY_FILE: _checked(_path_text),
    OPTION_TLS_CA_FILE: _checked(_path_text),
    OPTION_METRICS_PORT: _metrics_address,
    OPTION_TRANSFER_CHECKSUM: _fields("transfer_checksum", convert=_to_bool),
    OPTION_SESSION_DEVICE_ID: _checked(_to_int),
    OPTION_DEPLOY_RES_PATH: _checked(_to_text),
    OPTION_CLUSTER_INFO: _checked(_to_json_text),
    OPTION_OUTPUT_MAX_SIZE: _checked(_to_int),
    OPTION_ENABLE_SWITCH_ROLE: _checked(_to_bool),
    OPTION_MEMORY_UTILIZATION: _checked(_to_fraction),
    OPTION_BUF_POOL_CFG: _checked(_to_json_text),
    OPTION_GLOBAL_RESOURCE_CONFIG: _checked(_to_json_text),
}

#: Option keys a warning never names: ours, and every key CANN's LLMConfig emits or its
#: LLMDataDist adds.
KNOWN_OPTION_KEYS = frozenset(_PARSERS) | CANN_INTERNAL_KEYS
_warned_keys: set[str] = set()


def _warn_unknown_key(key: str) -> None:
    """One warning per unknown key and process: GE ignores unknown options, so do we, but a
    misspelt key would otherwise be lost without a word."""
    if key in _warned_keys:
        return
    _warned_keys.add(key)
    close = difflib.get_close_matches(key, sorted(KNOWN_OPTION_KEYS), n=1)
    _log.warning("option %r is not known to datadist and is ignored%s", key,
                 f"; did you mean {close[0]!r}?" if close else "")


def _link_secret(options: Mapping[str, Any]) -> Optional[Secret]:
    """The link secret: the option, else the option's file, else the environment."""
    try:
        return load_secret(options.get(OPTION_LINK_SECRET), options.get(OPTION_LINK_SECRET_FILE), ENV_LINK_SECRET)
    except ValueError as exc:  # names the file, never its contents
        raise ParamInvalidError(f"{describe_key(OPTION_LINK_SECRET_FILE)} is invalid: {exc}") from None


def _tls(options: Mapping[str, Any]) -> Optional[TlsConfig]:
    """TLS from the three file options (all or none), else from the three environment
    variables (all or none); None when neither gives any.  An incomplete set or an
    unusable file is a ParamInvalidError naming the option (or variable) and the path,
    never a file's contents."""
    try:
        return tls_from_settings([(describe_key(key), options.get(key) or None) for key, _, _ in TLS_OPTIONS],
                                 [env for _, env, _ in TLS_OPTIONS])
    except ValueError as exc:
        raise ParamInvalidError(str(exc)) from None


def parse_options(options: Mapping[str, Any], base: Optional[EngineOptions] = None) -> EngineOptions:
    """Read an options dict (from :meth:`LLMConfig.generate_options` or written by hand).

    Values are normally strings; ints, bools and (for the pool options) dicts are accepted
    when they convert cleanly. Every key CANN's ``LlmConfig`` emits is known: those without
    an effect here are still checked. A key known to neither library is ignored, as GE
    ignores unknown options, with one warning per key naming it (and a close match).

    Args:
        options: the dict.
        base: options to start from (e.g. the engine's current ones for ``switch_role``);
            keys absent from ``options`` keep their ``base`` value. None: the defaults.

    Returns:
        The validated :class:`EngineOptions`.

    Raises:
        TypeError: ``options`` is not a mapping, or has a non-str key.
        ParamInvalidError: a bad value; the message names the key, the LLMConfig property
            and the value.
    """
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict of str to str, got {type(options).__name__}")
    fields: Dict[str, Any] = {}
    for key, raw in options.items():
        if not isinstance(key, str):
            raise TypeError(f"option keys must be str, got {key!r} ({type(key).__name__})")
        parser = _PARSERS.get(key)
        if parser is None:
            if key not in CANN_INTERNAL_KEYS:
                _warn_unknown_key(key)
            continue
        try:
            fields.update(parser(raw))
        except Bad as bad:
            shown = "<hidden>" if key == OPTION_LINK_SECRET else repr(raw)
            raise ParamInvalidError(f"{describe_key(key)} = {shown} is invalid: {bad}") from None
    secret = _link_secret(options)
    if secret is not None:
        fields["link_secret"] = secret
    tls = _tls(options)
    if tls is not None:
        fields["tls"] = tls
    if OPTION_METRICS_PORT not in options and os.environ.get(ENV_METRICS_PORT):
        try:
            fields.update(_metrics_address(os.environ[ENV_METRICS_PORT]))
        except Bad as bad:
            raise ParamInvalidError(f"environment variable {ENV_METRICS_PORT} = "
                                    f"{os.environ[ENV_METRICS_PORT]!r} is invalid: {bad}") from None
    if base is None:
        fields.setdefault("link_total_time_s", _default_link_total_time())
        return EngineOptions(**fields)
    return dataclasses.replace(base, **fields)
