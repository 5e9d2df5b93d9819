"""Configuration: :class:`LLMConfig`, the user's builder of the options dict, and
:func:`parse_options`, the one place that dict is read (SPEC-datadist section 2).

``LLMConfig`` setters check Python types (``TypeError``); values are checked when the
dict is generated, by running it through :func:`parse_options`, so a dict built by
``generate_options()`` and one written by hand fail the same way: a
:class:`~datadist._status.ParamInvalidError` (``LLMException(LLM_PARAM_INVALID)``) naming
the option key, the ``LLMConfig`` property and the value.

The engine reads nothing but :class:`EngineOptions`; no string-keyed dict travels past
:func:`parse_options`.
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

from ._objects import ip_to_str
from ._status import ParamInvalidError
from .engine.auth import Secret, load_secret

__all__ = [
    "LLMConfig",
    "LlmConfig",
    "PoolConfig",
    "EngineOptions",
    "parse_options",
    "parse_listen_ip_info",
    "TRANSFER_BACKENDS",
    "TRANSFER_BACKEND_ALIASES",
    "DEVICE_TYPES",
    "DEFAULT_SYNC_KV_TIMEOUT_MS",
    "DEFAULT_LINK_TOTAL_TIME_S",
    "DEFAULT_LINK_RETRY_COUNT",
    "OPTION_DEVICE_ID",
    "OPTION_SYNC_KV_TIMEOUT",
    "OPTION_LISTEN_IP_INFO",
    "OPTION_ENABLE_CACHE_MANAGER",
    "OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE",
    "OPTION_MEM_POOL_CONFIG",
    "OPTION_HOST_MEM_POOL_CONFIG",
    "OPTION_LINK_TOTAL_TIME",
    "OPTION_LINK_RETRY_COUNT",
    "OPTION_LOCAL_COMM_RES",
    "OPTION_RDMA_TRAFFIC_CLASS",
    "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_TRANSFER_BACKEND",
    "OPTION_DEVICE_TYPE",
    "OPTION_LINK_SECRET",
    "OPTION_LINK_SECRET_FILE",
    "ENV_LINK_SECRET",
]

_log = logging.getLogger(__name__)

OPTION_DEVICE_ID = "ge.exec.deviceId"
OPTION_SYNC_KV_TIMEOUT = "llm.SyncKvCacheWaitTime"
OPTION_LISTEN_IP_INFO = "llm.listenIpInfo"
OPTION_ENABLE_CACHE_MANAGER = "llm.EnableCacheManager"
OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE = "llm.EnableRemoteCacheAccessible"
OPTION_MEM_POOL_CONFIG = "llm.MemPoolConfig"
OPTION_HOST_MEM_POOL_CONFIG = "llm.HostMemPoolConfig"
OPTION_LINK_TOTAL_TIME = "llm.LinkTotalTime"
OPTION_LINK_RETRY_COUNT = "llm.LinkRetryCount"
OPTION_LOCAL_COMM_RES = "llm.LocalCommRes"
OPTION_RDMA_TRAFFIC_CLASS = "llm.RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "llm.RdmaServiceLevel"
OPTION_TRANSFER_BACKEND = "llm.TransferBackend"
OPTION_DEVICE_TYPE = "llm.DeviceType"
OPTION_LINK_SECRET = "datadist.LinkSecret"
OPTION_LINK_SECRET_FILE = "datadist.LinkSecretFile"
#: Environment variable holding the link secret when neither option gives one.
ENV_LINK_SECRET = "DATADIST_LINK_SECRET"
# Options of CANN's LlmConfig that this library accepts, checks and documents as having no
# effect here (docs/migration.md says why for each).
OPTION_SESSION_DEVICE_ID = "ge.session_device_id"
OPTION_DEPLOY_RES_PATH = "llm.deployResPath"
OPTION_CLUSTER_INFO = "llm.ClusterInfo"
OPTION_OUTPUT_MAX_SIZE = "llm.OutputMaxSize"
OPTION_ENABLE_SWITCH_ROLE = "llm.EnableSwitchRole"
OPTION_MEMORY_UTILIZATION = "llm.MemoryUtilization"
OPTION_BUF_POOL_CFG = "llm.BufPoolCfg"
OPTION_GLOBAL_RESOURCE_CONFIG = "llm.GlobalResourceConfig"
# Keys CANN's LLMDataDist adds to the dict itself, or reads from it; known, not used here.
_CANN_INTERNAL_KEYS = frozenset({"llm.Role", "llm.ListenIp", "llm.ListenPort", "ge.flowGraphMemMaxSize"})

TRANSFER_BACKENDS: Tuple[str, ...] = ("auto", "shm", "tcp", "gloo", "nccl", "hccl")
#: CANN's own ``llm.TransferBackend`` values (its engines, "adxl" by default and "hixl"),
#: and the empty string, all meaning: the best transport this library has, i.e. "auto".
TRANSFER_BACKEND_ALIASES: Dict[str, str] = {"hixl": "auto", "adxl": "auto", "": "auto"}
DEVICE_TYPES: Tuple[str, ...] = ("auto", "npu", "cuda", "cpu")

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
# CANN: llm.LinkTotalTime unset or 0 means "the HCCL_CONNECT_TIMEOUT environment variable,
# else 120 s"; parse_options resolves it the same way.
DEFAULT_LINK_TOTAL_TIME_S = 120.0
DEFAULT_LINK_RETRY_COUNT = 1

_INT32_MAX = 2**31 - 1
_UINT32_MAX = 2**32 - 1
_LINK_RETRY_RANGE = (1, 100)
_PAGE_SHIFT_RANGE = (10, 30)  # CANN: [10, 31)
_RDMA_SERVICE_LEVEL_MAX = 7

# option key -> LLMConfig property, for messages
_PROPERTY_OF_KEY: Dict[str, str] = {
    OPTION_DEVICE_ID: "device_id",
    OPTION_SYNC_KV_TIMEOUT: "sync_kv_timeout",
    OPTION_LISTEN_IP_INFO: "listen_ip_info",
    OPTION_ENABLE_CACHE_MANAGER: "enable_cache_manager",
    OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE: "enable_remote_cache_accessible",
    OPTION_MEM_POOL_CONFIG: "mem_pool_cfg",
    OPTION_HOST_MEM_POOL_CONFIG: "host_mem_pool_cfg",
    OPTION_LINK_TOTAL_TIME: "link_total_time",
    OPTION_LINK_RETRY_COUNT: "link_retry_count",
    OPTION_LOCAL_COMM_RES: "local_comm_res",
    OPTION_RDMA_TRAFFIC_CLASS: "rdma_traffic_class",
    OPTION_RDMA_SERVICE_LEVEL: "rdma_service_level",
    OPTION_TRANSFER_BACKEND: "transfer_backend",
    OPTION_DEVICE_TYPE: "device_type",
    OPTION_LINK_SECRET: "link_secret",
    OPTION_LINK_SECRET_FILE: "link_secret_file",
    OPTION_SESSION_DEVICE_ID: "device_id",
    OPTION_DEPLOY_RES_PATH: "deploy_res_path",
    OPTION_CLUSTER_INFO: "cluster_info",
    OPTION_OUTPUT_MAX_SIZE: "output_max_size",
    OPTION_ENABLE_SWITCH_ROLE: "enable_switch_role",
    OPTION_MEMORY_UTILIZATION: "mem_utilization",
    OPTION_BUF_POOL_CFG: "buf_pool_cfg",
    OPTION_GLOBAL_RESOURCE_CONFIG: "global_resource_config",
}

# EngineOptions field -> option key, for messages
_KEY_OF_FIELD: Dict[str, str] = {
    "device_id": OPTION_DEVICE_ID,
    "sync_kv_timeout_ms": OPTION_SYNC_KV_TIMEOUT,
    "listen_ip": OPTION_LISTEN_IP_INFO,
    "listen_port": OPTION_LISTEN_IP_INFO,
    "mem_pool": OPTION_MEM_POOL_CONFIG,
    "host_mem_pool": OPTION_HOST_MEM_POOL_CONFIG,
    "link_total_time_s": OPTION_LINK_TOTAL_TIME,
    "link_retry_count": OPTION_LINK_RETRY_COUNT,
    "transfer_backend": OPTION_TRANSFER_BACKEND,
    "device_type": OPTION_DEVICE_TYPE,
    "link_secret": OPTION_LINK_SECRET,
    "enable_cache_manager": OPTION_ENABLE_CACHE_MANAGER,
    "enable_remote_cache_accessible": OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE,
    "local_comm_res": OPTION_LOCAL_COMM_RES,
    "rdma_traffic_class": OPTION_RDMA_TRAFFIC_CLASS,
    "rdma_service_level": OPTION_RDMA_SERVICE_LEVEL,
}


def _describe_key(key: str) -> str:
    return f"option {key!r} (LLMConfig.{_PROPERTY_OF_KEY[key]})"


class _Bad(Exception):
    """A value that does not convert; the caller adds which option it was."""


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
        lo, hi = _PAGE_SHIFT_RANGE
        if not lo <= self.page_shift <= hi:
            raise ParamInvalidError(f"page_shift = {self.page_shift} is invalid, must be in [{lo}, {hi}]")

    @property
    def page_size(self) -> int:
        return 1 << self.page_shift


@dataclass(frozen=True)
class EngineOptions:
    """Everything the engine reads from the options dict, typed and validated.

    Attributes:
        device_id: accelerator index (``ge.exec.deviceId``); ignored on CPU.
        sync_kv_timeout_ms: deadline of every pull/push/copy, ms, in [1, 2**31-1].
        listen_ip, listen_port: the server address from ``llm.listenIpInfo`` ("ip:port";
            port 0 lets the system pick), or both None for a client-only engine.
        mem_pool, host_mem_pool: pools for ``allocate_*`` with DEVICE / HOST placement;
            None: that allocation raises ``LLM_FEATURE_NOT_ENABLED``.
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

    Constructing one directly validates it the same way (``__post_init__``).
    """

    device_id: int = 0
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

    def __post_init__(self) -> None:
        self._check_int("device_id", 0, _INT32_MAX)
        self._check_int("sync_kv_timeout_ms", 1, _INT32_MAX, unit=" ms")
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
        if not 0 < self.link_total_time_s <= _UINT32_MAX:
            self._bad("link_total_time_s", f"must be in (0, {_UINT32_MAX}] seconds")
        self._check_int("link_retry_count", *_LINK_RETRY_RANGE)
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
            self._check_int("rdma_service_level", 0, _RDMA_SERVICE_LEVEL_MAX)
        if self.link_secret is not None:
            self._check_type("link_secret", Secret)

    # -- derived views

    @property
    def is_server(self) -> bool:
        """Whether ``llm.listenIpInfo`` was given (this engine listens for links)."""
        return self.listen_ip is not None

    @property
    def listen_address(self) -> Optional[Tuple[str, int]]:
        return None if self.listen_ip is None else (self.listen_ip, int(self.listen_port or 0))

    @property
    def sync_kv_timeout_s(self) -> float:
        return self.sync_kv_timeout_ms / 1000.0

    def replace(self, **changes: Any) -> "EngineOptions":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # -- validation helpers

    def _bad(self, name: str, reason: str) -> None:
        key = _KEY_OF_FIELD[name]
        raise ParamInvalidError(f"option {key!r} (LLMConfig.{_PROPERTY_OF_KEY[key]}, EngineOptions.{name}) = "
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

    def _check_choice(self, name: str, choices: Tuple[str, ...]) -> None:
        self._check_type(name, str)
        if getattr(self, name) not in choices:
            self._bad(name, f"must be one of {', '.join(choices)}")


# ------------------------------------------------------------------------- parsing


def _to_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise _Bad("expected an integer, got a bool")
    if isinstance(raw, str):
        text = raw.strip()
        if re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        raise _Bad("expected an integer")
    if isinstance(raw, float):
        if raw.is_integer():
            return int(raw)
        raise _Bad("expected an integer")
    if hasattr(raw, "__index__"):
        return raw.__index__()
    raise _Bad(f"expected an integer, got {type(raw).__name__}")


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
    raise _Bad('expected "1" or "0"')


def _to_choice(choices: Tuple[str, ...]) -> Callable[[Any], str]:
    def convert(raw: Any) -> str:
        if not isinstance(raw, str) or raw.strip().lower() not in choices:
            raise _Bad(f"must be one of {', '.join(choices)}")
        return raw.strip().lower()
    return convert


def _to_backend(raw: Any) -> str:
    if isinstance(raw, str) and raw.strip().lower() in TRANSFER_BACKEND_ALIASES:
        return TRANSFER_BACKEND_ALIASES[raw.strip().lower()]
    try:
        return _to_choice(TRANSFER_BACKENDS)(raw)
    except _Bad:
        raise _Bad(f"must be one of {', '.join(TRANSFER_BACKENDS)} (or CANN's hixl / adxl, meaning auto)") from None


def _to_fraction(raw: Any) -> float:
    if isinstance(raw, bool):
        raise _Bad("expected a number in [0, 1], got a bool")
    try:
        value = float(raw.strip() if isinstance(raw, str) else raw)
    except (TypeError, ValueError):
        raise _Bad("expected a number in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise _Bad("must be in [0, 1]")
    return value


def _to_text(raw: Any) -> str:
    if not isinstance(raw, str):
        raise _Bad(f"expected a string, got {type(raw).__name__}")
    return raw


def parse_listen_ip_info(value: Any) -> Tuple[str, int]:
    """Split an ``"ip:port"`` listen address (``llm.listenIpInfo``) into a dotted-quad IPv4
    address and a port in [0, 65535] (0: the system picks one).

    Raises:
        ParamInvalidError: naming the option and the value, if it is not of that form.
    """
    try:
        return _split_ip_port(value)
    except _Bad as bad:
        raise ParamInvalidError(f"{_describe_key(OPTION_LISTEN_IP_INFO)} = {value!r} is invalid: {bad}") from None


def _split_ip_port(value: Any) -> Tuple[str, int]:
    if not isinstance(value, str):
        raise _Bad(f'expected a string "ip:port", got {type(value).__name__}')
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not host:
        raise _Bad('expected "ip:port", e.g. "10.0.0.1:26000"')
    try:
        ip = ip_to_str(host)
    except ParamInvalidError as exc:
        raise _Bad(str(exc)) from None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise _Bad(f"port {port_text!r} is not an integer in [0, 65535]")
    return ip, int(port_text)


def _to_device_id(raw: Any) -> int:
    # CANN joins several device ids with ";" but supports one per process; so do we.
    if isinstance(raw, str) and ";" in raw:
        ids = [part for part in raw.split(";") if part.strip()]
        if len(ids) != 1:
            raise _Bad("exactly one device id per engine is supported")
        raw = ids[0]
    return _to_int(raw)


def _to_pool(raw: Any) -> PoolConfig:
    if isinstance(raw, str):
        try:
            cfg = json.loads(raw)
        except ValueError as exc:
            raise _Bad(f"not valid JSON ({exc})") from None
    else:
        cfg = raw
    if not isinstance(cfg, Mapping):
        raise _Bad('expected a JSON object like {"memory_size": 1073741824, "page_shift": 16}')
    if "memory_size" not in cfg:
        raise _Bad('"memory_size" (bytes) is required')
    try:
        memory_size = _to_int(cfg["memory_size"])
        page_shift = _to_int(cfg.get("page_shift", 16))
    except _Bad as bad:
        raise _Bad(f"memory_size and page_shift must be integers ({bad})") from None
    try:
        return PoolConfig(memory_size=memory_size, page_shift=page_shift)
    except ParamInvalidError as exc:
        raise _Bad(str(exc)) from None


def _to_json_text(raw: Any) -> str:
    if isinstance(raw, Mapping):
        return json.dumps(raw)
    if not isinstance(raw, str):
        raise _Bad(f"expected a JSON string, got {type(raw).__name__}")
    if raw.strip():
        try:
            json.loads(raw)
        except ValueError as exc:
            raise _Bad(f"not valid JSON ({exc})") from None
    return raw


def _link_total_time(raw: Any) -> float:
    seconds = _to_int(raw)
    if not 0 <= seconds <= _UINT32_MAX:
        raise _Bad(f"must be an integer in [0, {_UINT32_MAX}] seconds (0: default)")
    return float(seconds) if seconds else _default_link_total_time()


def _default_link_total_time() -> float:
    env = os.environ.get("HCCL_CONNECT_TIMEOUT", "").strip()
    if env.isdigit() and 0 < int(env) <= _UINT32_MAX:
        return float(env)
    return DEFAULT_LINK_TOTAL_TIME_S


def _secret_text(raw: Any) -> str:
    # The message never shows the value: it is a secret.
    if not isinstance(raw, str) or not raw:
        raise _Bad("expected a non-empty string")
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
    OPTION_DEVICE_ID: _fields("device_id", convert=_to_device_id),
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
KNOWN_OPTION_KEYS = frozenset(_PARSERS) | _CANN_INTERNAL_KEYS
_warned_keys: set = set()


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
        raise ParamInvalidError(f"{_describe_key(OPTION_LINK_SECRET_FILE)} is invalid: {exc}") from None


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
            if key not in _CANN_INTERNAL_KEYS:
                _warn_unknown_key(key)
            continue
        try:
            fields.update(parser(raw))
        except _Bad as bad:
            shown = "<hidden>" if key == OPTION_LINK_SECRET else repr(raw)
            raise ParamInvalidError(f"{_describe_key(key)} = {shown} is invalid: {bad}") from None
    secret = _link_secret(options)
    if secret is not None:
        fields["link_secret"] = secret
    if base is None:
        fields.setdefault("link_total_time_s", _default_link_total_time())
        return EngineOptions(**fields)
    return dataclasses.replace(base, **fields)


# ----------------------------------------------------------------------- LLMConfig


def _check_type(name: str, value: Any, *classes: type) -> None:
    """Setter type check; None (unset) is always allowed, bool never passes for int."""
    if value is None:
        return
    if isinstance(value, bool) and bool not in classes:
        ok = False
    else:
        ok = isinstance(value, classes)
    if not ok:
        names = " or ".join(c.__name__ for c in classes)
        raise TypeError(f"LLMConfig.{name} must be {names}, got {type(value).__name__}")


class _Option:
    """An LLMConfig property: type-checked setter (None unsets), a getter that reports
    CANN's default while unset, and how the value is written under its option key."""

    def __init__(self, key: str, *types: type, default: Any = None, doc: str = "",
                 empty_is_unset: bool = False) -> None:
        self.key = key
        self.types = types
        self.default = default
        self.empty_is_unset = empty_is_unset  # CANN skips "" for these
        self.__doc__ = f"{doc} (option ``{key}``)"

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.attr = "_" + name

    def __get__(self, obj: Any, owner: type = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__.get(self.attr)
        return self.default if value is None else value

    def __set__(self, obj: Any, value: Any) -> None:
        _check_type(self.name, value, *self.types)
        if isinstance(value, (list, tuple)):  # device_id
            for item in value:
                _check_type(f"{self.name}[]", item, int)
        if isinstance(value, Mapping):  # pool configs given as dicts
            value = json.dumps(dict(value))
        obj.__dict__[self.attr] = value

    def emit(self, obj: Any, options: Dict[str, str]) -> None:
        value = obj.__dict__.get(self.attr)
        if value is None or (self.empty_is_unset and value == ""):
            return
        if isinstance(value, bool):
            options[self.key] = "1" if value else "0"
        elif isinstance(value, (list, tuple)):
            options[self.key] = ";".join(str(v) for v in value)  # CANN's multi-device form
        elif self.key in (OPTION_TRANSFER_BACKEND, OPTION_DEVICE_TYPE):
            options[self.key] = value.strip().lower()
        else:
            options[self.key] = value if isinstance(value, str) else str(value)


_warned_fields: set = set()


def _warn_unknown_field(name: str) -> None:
    if name in _warned_fields:
        return
    _warned_fields.add(name)
    fields = [o.name for o in LLMConfig._OPTIONS] + ["ge_options"]
    close = difflib.get_close_matches(name, fields, n=1)
    _log.warning("LLMConfig.%s is not a field of LLMConfig and has no effect%s", name,
                 f"; did you mean LLMConfig.{close[0]}?" if close else "")


class LLMConfig:
    """Builder of the options dict for ``LLMDataDist.init`` (alias ``LlmConfig``).

    Set the properties you need; :meth:`generate_options` emits only those. Setters raise
    ``TypeError`` for a wrong type; values are validated by :meth:`generate_options`.
    Assigning None unsets a property; while unset, a property reads as CANN's default.
    """

    device_id = _Option(OPTION_DEVICE_ID, int, list, tuple,
                        doc="Accelerator index: an int, or a list/tuple of one int")
    sync_kv_timeout = _Option(OPTION_SYNC_KV_TIMEOUT, int, str, doc="Transfer deadline in ms; default 1000")
    listen_ip_info = _Option(OPTION_LISTEN_IP_INFO, str, default="", empty_is_unset=True,
                             doc='"ip:port" this engine listens on for links')
    enable_cache_manager = _Option(OPTION_ENABLE_CACHE_MANAGER, bool, default=False,
                                   doc="Accepted; CacheManager mode is the only mode")
    enable_remote_cache_accessible = _Option(OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE, bool, default=False,
                                             doc="Accepted; caches are remotely accessible")
    mem_pool_cfg = _Option(OPTION_MEM_POOL_CONFIG, str, Mapping, default="", empty_is_unset=True,
                           doc='Device pool, JSON {"memory_size": N, "page_shift": 16}')
    host_mem_pool_cfg = _Option(OPTION_HOST_MEM_POOL_CONFIG, str, Mapping, default="", empty_is_unset=True,
                                doc="Host pool, same JSON")
    link_total_time = _Option(OPTION_LINK_TOTAL_TIME, int, default=0,
                              doc="Link deadline in s; 0: HCCL_CONNECT_TIMEOUT or 120")
    link_retry_count = _Option(OPTION_LINK_RETRY_COUNT, int, default=DEFAULT_LINK_RETRY_COUNT,
                               doc="Link attempts, in [1, 100]")
    local_comm_res = _Option(OPTION_LOCAL_COMM_RES, str, default="",
                             doc="Local communication resources JSON; accepted and kept")
    rdma_traffic_class = _Option(OPTION_RDMA_TRAFFIC_CLASS, int, doc="RDMA traffic class, [0, 255], multiple of 4")
    rdma_service_level = _Option(OPTION_RDMA_SERVICE_LEVEL, int, doc="RDMA service level, [0, 7]")
    transfer_backend = _Option(OPTION_TRANSFER_BACKEND, str, default="auto",
                               doc="auto (default), shm, tcp, gloo, nccl or hccl")
    device_type = _Option(OPTION_DEVICE_TYPE, str, default="auto", doc="auto (default), npu, cuda or cpu")
    # CANN's fields without an effect here; accepted and checked (docs/migration.md).
    deploy_res_path = _Option(OPTION_DEPLOY_RES_PATH, str, default="", empty_is_unset=True,
                              doc="CANN deployment resource path; no effect here")
    cluster_info = _Option(OPTION_CLUSTER_INFO, str, default="", empty_is_unset=True,
                           doc="CANN offline cluster info JSON; no effect here")
    output_max_size = _Option(OPTION_OUTPUT_MAX_SIZE, int, doc="CANN offline output size; no effect here")
    enable_switch_role = _Option(OPTION_ENABLE_SWITCH_ROLE, bool, default=False,
                                 doc="Accepted; switch_role is always available")
    mem_utilization = _Option(OPTION_MEMORY_UTILIZATION, int, float, default=0.95,
                              doc="CANN device memory share, [0, 1]; no effect here (pools are sized explicitly)")
    buf_pool_cfg = _Option(OPTION_BUF_POOL_CFG, str, default="", empty_is_unset=True,
                           doc="CANN transfer buffer pool JSON; no effect here")
    global_resource_config = _Option(OPTION_GLOBAL_RESOURCE_CONFIG, str, default="",
                                     doc="CANN HIXL communication resources JSON; checked, no effect here")
    link_secret = _Option(OPTION_LINK_SECRET, str, default="", empty_is_unset=True,
                          doc="Shared secret: links are mutually authenticated (never shown in repr)")
    link_secret_file = _Option(OPTION_LINK_SECRET_FILE, str, default="", empty_is_unset=True,
                               doc="File holding the link secret (used when link_secret is unset)")

    _OPTIONS = (device_id, sync_kv_timeout, listen_ip_info, enable_cache_manager, enable_remote_cache_accessible,
                mem_pool_cfg, host_mem_pool_cfg, link_total_time, link_retry_count, local_comm_res,
                rdma_traffic_class, rdma_service_level, transfer_backend, device_type, deploy_res_path,
                cluster_info, output_max_size, enable_switch_role, mem_utilization, buf_pool_cfg,
                global_resource_config, link_secret, link_secret_file)

    def __init__(self) -> None:
        self._ge_options: Dict[str, str] = {}
        self._options: Dict[str, str] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        # CANN's LlmConfig is a plain object: any attribute can be set, and a misspelt one is
        # silently lost. Ours takes it too, but says so once, with the closest field.
        if not name.startswith("_") and not hasattr(type(self), name) and name not in KNOWN_OPTION_KEYS:
            _warn_unknown_field(name)
        object.__setattr__(self, name, value)

    @property
    def options(self) -> Dict[str, str]:
        """The dict the last :meth:`generate_options` returned (empty before the first)."""
        return self._options

    @property
    def ge_options(self) -> Dict[str, str]:
        """Extra options copied into the dict first (the named properties override them)."""
        return self._ge_options

    @ge_options.setter
    def ge_options(self, value: Optional[Dict[str, str]]) -> None:
        _check_type("ge_options", value, dict)
        value = {} if value is None else value
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"LLMConfig.ge_options must map str to str, got {k!r}: {v!r}")
        self._ge_options = dict(value)

    def generate_options(self) -> Dict[str, str]:
        """The options dict for ``LLMDataDist.init``: ``ge_options``, then every property
        that was set, as a string under its CANN key.

        Raises:
            ParamInvalidError: a value out of its domain; the message names the property,
                the option key and the value.
        """
        options: Dict[str, str] = dict(self._ge_options)
        for option in self._OPTIONS:
            option.emit(self, options)
        if isinstance(self.device_id, int) and OPTION_DEVICE_ID in options:
            options.setdefault(OPTION_SESSION_DEVICE_ID, options[OPTION_DEVICE_ID])  # as CANN emits both
        parse_options(options)  # one validator for generated and hand-written dicts
        self._options = options
        return dict(options)

    gen_options = generate_options

    def __repr__(self) -> str:
        parts = [f"{o.name}=" + ("<hidden>" if o.key == OPTION_LINK_SECRET else repr(self.__dict__[o.attr]))
                 for o in self._OPTIONS if self.__dict__.get(o.attr) is not None]
        if self._ge_options:
            parts.append(f"ge_options={self._ge_options!r}")
        return f"LLMConfig({', '.join(parts)})"


LlmConfig = LLMConfig
