"""Configuration: :class:`LLMConfig`, the user's builder of the options dict, and
:func:`parse_options` (:mod:`datadist._options`), the one place that dict is read
(SPEC-datadist section 2).  The option keys live in :mod:`datadist._option_keys`; this
module re-exports both.

``LLMConfig`` setters check Python types (``TypeError``); values are checked when the
dict is generated, by running it through :func:`parse_options`, so a dict built by
``generate_options()`` and one written by hand fail the same way: a
:class:`~datadist._status.ParamInvalidError` (``LLMException(LLM_PARAM_INVALID)``) naming
the option key, the ``LLMConfig`` property and the value.

The engine reads nothing but :class:`EngineOptions`; no string-keyed dict travels past
:func:`parse_options`.
"""
from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Mapping
from typing import Any, Dict, Optional

from ._option_keys import OPTION_METRICS_PORT, OPTION_TRANSFER_CHECKSUM
from ._option_keys import (DEFAULT_LINK_RETRY_COUNT, DEFAULT_LINK_TOTAL_TIME_S, DEFAULT_SYNC_KV_TIMEOUT_MS,
                           DEVICE_TYPES, ENV_LINK_SECRET, OPTION_BUF_POOL_CFG, OPTION_CLUSTER_INFO,
                           OPTION_DEPLOY_RES_PATH, OPTION_DEVICE_ID, OPTION_DEVICE_TYPE, OPTION_ENABLE_CACHE_MANAGER,
                           OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE, OPTION_ENABLE_SWITCH_ROLE,
                           OPTION_GLOBAL_RESOURCE_CONFIG, OPTION_HOST_MEM_POOL_CONFIG, OPTION_LINK_RETRY_COUNT,
                           OPTION_LINK_SECRET, OPTION_LINK_SECRET_FILE, OPTION_LINK_TOTAL_TIME,
                           OPTION_LISTEN_IP_INFO, OPTION_LOCAL_COMM_RES, OPTION_MEMORY_UTILIZATION,
                           OPTION_MEM_POOL_CONFIG, OPTION_OUTPUT_MAX_SIZE, OPTION_RDMA_SERVICE_LEVEL,
                           OPTION_RDMA_TRAFFIC_CLASS, OPTION_SESSION_DEVICE_ID, OPTION_SYNC_KV_TIMEOUT,
                           OPTION_TLS_CA_FILE, OPTION_TLS_CERT_FILE, OPTION_TLS_KEY_FILE, OPTION_TRANSFER_BACKEND,
                           TRANSFER_BACKENDS, TRANSFER_BACKEND_ALIASES)
from ._options import (EngineOptions, KNOWN_OPTION_KEYS, PoolConfig, parse_listen_ip_info, parse_options)

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
    "OPTION_TLS_CERT_FILE",
    "OPTION_TLS_KEY_FILE",
    "OPTION_TLS_CA_FILE",
    "OPTION_TRANSFER_CHECKSUM",
]

_log = logging.getLogger(__name__)


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
                 empty_is_unset: bool = False, always: bool = False) -> None:
        self.key = key
        self.types = types
        self.default = default
        self.empty_is_unset = empty_is_unset  # CANN skips "" for these
        self.always = always  # CANN emits the default while unset
        self.__doc__ = f"{doc} (option ``{key}``)"

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.attr = "_" + name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
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
        if value is None and self.always:
            value = self.default
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


_warned_fields: set[str] = set()


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
                        doc="Accelerator index: an int, or a list/tuple of ints (CANN's form; an engine runs on one)")
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
    transfer_backend = _Option(OPTION_TRANSFER_BACKEND, str, default="",
                               doc='auto, shm, tcp, gloo, nccl or hccl; reads "" while unset, as in CANN ("" is auto)')
    device_type = _Option(OPTION_DEVICE_TYPE, str, default="auto", doc="auto (default), npu, cuda or cpu")
    # CANN's fields without an effect here; accepted and checked (docs/migration.md).
    deploy_res_path = _Option(OPTION_DEPLOY_RES_PATH, str, default="", empty_is_unset=True,
                              doc="CANN deployment resource path; no effect here")
    cluster_info = _Option(OPTION_CLUSTER_INFO, str, default="", empty_is_unset=True,
                           doc="CANN offline cluster info JSON; no effect here")
    output_max_size = _Option(OPTION_OUTPUT_MAX_SIZE, int, doc="CANN offline output size; no effect here")
    enable_switch_role = _Option(OPTION_ENABLE_SWITCH_ROLE, bool, default=False,
                                 doc="Accepted; switch_role is always available")
    mem_utilization = _Option(OPTION_MEMORY_UTILIZATION, int, float, default=0.95, always=True,
                              doc="CANN device memory share, [0, 1], emitted always (0.95 while unset, as CANN "
                                  "does); no effect here (pools are sized explicitly)")
    buf_pool_cfg = _Option(OPTION_BUF_POOL_CFG, str, default="", empty_is_unset=True,
                           doc="CANN transfer buffer pool JSON; no effect here")
    global_resource_config = _Option(OPTION_GLOBAL_RESOURCE_CONFIG, str, default="",
                                     doc="CANN HIXL communication resources JSON; checked, no effect here")
    link_secret = _Option(OPTION_LINK_SECRET, str, default="", empty_is_unset=True,
                          doc="Shared secret: links are mutually authenticated (never shown in repr)")
    link_secret_file = _Option(OPTION_LINK_SECRET_FILE, str, default="", empty_is_unset=True,
                               doc="File holding the link secret (used when link_secret is unset)")
    tls_cert_file = _Option(OPTION_TLS_CERT_FILE, str, default="", empty_is_unset=True,
                            doc="PEM certificate this engine presents on TLS links (with tls_key_file, tls_ca_file)")
    tls_key_file = _Option(OPTION_TLS_KEY_FILE, str, default="", empty_is_unset=True,
                           doc="PEM private key of tls_cert_file (unencrypted; its contents are never shown)")
    tls_ca_file = _Option(OPTION_TLS_CA_FILE, str, default="", empty_is_unset=True,
                          doc="PEM CA certificate(s) that a peer's certificate must chain to (the trust anchor)")
    metrics_port = _Option(OPTION_METRICS_PORT, int, str, doc='Prometheus endpoint, "[host:]port" or a port '
                           "(docs/operations.md); default: DATADIST_METRICS_PORT, else none")
    transfer_checksum = _Option(OPTION_TRANSFER_CHECKSUM, bool, default=False,
                                doc="Sum every socket transfer and shm copy on both ends; a mismatch fails it with "
                                    "LLM_LINK_FAILED (docs/security.md); default off")

    _OPTIONS = (device_id, sync_kv_timeout, listen_ip_info, enable_cache_manager, enable_remote_cache_accessible,
                mem_pool_cfg, host_mem_pool_cfg, link_total_time, link_retry_count, local_comm_res,
                rdma_traffic_class, rdma_service_level, transfer_backend, device_type, deploy_res_path,
                cluster_info, output_max_size, enable_switch_role, mem_utilization, buf_pool_cfg,
                global_resource_config, link_secret, link_secret_file, tls_cert_file, tls_key_file, tls_ca_file,
                metrics_port, transfer_checksum)

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
        that was set, as a string under its CANN key, as CANN's ``generate_options``:
        ``llm.MemoryUtilization`` always (``"0.95"`` while unset), and with ``device_id``
        also ``ge.session_device_id`` (the first id of a list, which ``ge.exec.deviceId``
        joins with ";"; ``LLMDataDist.init`` refuses more than one).

        Raises:
            ParamInvalidError: a value out of its domain; the message names the property,
                the option key and the value.
        """
        options: Dict[str, str] = dict(self._ge_options)
        for option in self._OPTIONS:
            option.emit(self, options)
        device = self.device_id
        if device is not None and OPTION_DEVICE_ID in options and (isinstance(device, int) or device):
            options[OPTION_SESSION_DEVICE_ID] = str(device if isinstance(device, int) else device[0])  # as CANN
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
