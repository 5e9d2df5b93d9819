"""The option keys of ``LLMDataDist.init`` (CANN's names), their defaults and domains, and
which ``LLMConfig`` property and ``EngineOptions`` field each one is, for messages."""
from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["Bad", "CANN_INTERNAL_KEYS", "DEFAULT_LINK_RETRY_COUNT", "DEFAULT_LINK_TOTAL_TIME_S", "DEFAULT_SYNC_KV_TIMEOUT_MS", "DEVICE_TYPES", "ENV_LINK_SECRET", "ENV_METRICS_PORT", "ENV_TLS_CA_FILE", "ENV_TLS_CERT_FILE", "ENV_TLS_KEY_FILE", "INT32_MAX", "KEY_OF_FIELD", "LINK_RETRY_RANGE", "OPTION_BUF_POOL_CFG", "OPTION_CLUSTER_INFO", "OPTION_DEPLOY_RES_PATH", "OPTION_DEVICE_ID", "OPTION_DEVICE_TYPE", "OPTION_ENABLE_CACHE_MANAGER", "OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE", "OPTION_ENABLE_SWITCH_ROLE", "OPTION_GLOBAL_RESOURCE_CONFIG", "OPTION_HOST_MEM_POOL_CONFIG", "OPTION_LINK_RETRY_COUNT", "OPTION_LINK_SECRET", "OPTION_LINK_SECRET_FILE", "OPTION_LINK_TOTAL_TIME", "OPTION_LISTEN_IP_INFO", "OPTION_LOCAL_COMM_RES", "OPTION_MEMORY_UTILIZATION", "OPTION_MEM_POOL_CONFIG", "OPTION_METRICS_PORT", "OPTION_OUTPUT_MAX_SIZE", "OPTION_RDMA_SERVICE_LEVEL", "OPTION_RDMA_TRAFFIC_CLASS", "OPTION_SESSION_DEVICE_ID", "OPTION_SYNC_KV_TIMEOUT", "OPTION_TLS_CA_FILE", "OPTION_TLS_CERT_FILE", "OPTION_TLS_KEY_FILE", "OPTION_TRANSFER_BACKEND", "OPTION_TRANSFER_CHECKSUM", "TLS_OPTIONS", "PAGE_SHIFT_RANGE", "PROPERTY_OF_KEY", "RDMA_SERVICE_LEVEL_MAX", "TRANSFER_BACKENDS", "TRANSFER_BACKEND_ALIASES", "UINT32_MAX", "describe_key"]

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
# TLS for links: all three files or none (docs/security.md).
OPTION_TLS_CERT_FILE = "datadist.TlsCertFile"
OPTION_TLS_KEY_FILE = "datadist.TlsKeyFile"
OPTION_TLS_CA_FILE = "datadist.TlsCaFile"
#: Environment variables giving the three files when none of the options is set.
ENV_TLS_CERT_FILE = "DATADIST_TLS_CERT_FILE"
ENV_TLS_KEY_FILE = "DATADIST_TLS_KEY_FILE"
ENV_TLS_CA_FILE = "DATADIST_TLS_CA_FILE"
#: (option key, environment variable, which file) of TLS, in the order TlsConfig takes them.
TLS_OPTIONS: Tuple[Tuple[str, str, str], ...] = (
    (OPTION_TLS_CERT_FILE, ENV_TLS_CERT_FILE, "cert"),
    (OPTION_TLS_KEY_FILE, ENV_TLS_KEY_FILE, "key"),
    (OPTION_TLS_CA_FILE, ENV_TLS_CA_FILE, "ca"),
)
#: End-to-end integrity of socket transfers and shm copies: "1" sums every payload on both
#: ends and fails a transfer whose checksums differ (docs/security.md); "0" (default): TCP's own checks only.
OPTION_TRANSFER_CHECKSUM = "datadist.TransferChecksum"
#: The Prometheus endpoint, "[host:]port" (docs/operations.md); else the environment's.
OPTION_METRICS_PORT = "datadist.MetricsPort"
ENV_METRICS_PORT = "DATADIST_METRICS_PORT"
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
CANN_INTERNAL_KEYS = frozenset({"llm.Role", "llm.ListenIp", "llm.ListenPort", "ge.flowGraphMemMaxSize"})

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

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
LINK_RETRY_RANGE = (1, 100)
PAGE_SHIFT_RANGE = (10, 30)  # CANN: [10, 31)
RDMA_SERVICE_LEVEL_MAX = 7

# option key -> LLMConfig property, for messages
PROPERTY_OF_KEY: Dict[str, str] = {
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
    OPTION_TLS_CERT_FILE: "tls_cert_file",
    OPTION_TLS_KEY_FILE: "tls_key_file",
    OPTION_TLS_CA_FILE: "tls_ca_file",
    OPTION_METRICS_PORT: "metrics_port",
    OPTION_TRANSFER_CHECKSUM: "transfer_checksum",
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
KEY_OF_FIELD: Dict[str, str] = {
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
    "tls": OPTION_TLS_CERT_FILE,
    "metrics_port": OPTION_METRICS_PORT,
    "transfer_checksum": OPTION_TRANSFER_CHECKSUM,
    "enable_cache_manager": OPTION_ENABLE_CACHE_MANAGER,
    "enable_remote_cache_accessible": OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE,
    "local_comm_res": OPTION_LOCAL_COMM_RES,
    "rdma_traffic_class": OPTION_RDMA_TRAFFIC_CLASS,
    "rdma_service_level": OPTION_RDMA_SERVICE_LEVEL,
}


def describe_key(key: str) -> str:
    return f"option {key!r} (LLMConfig.{PROPERTY_OF_KEY[key]})"


class Bad(Exception):
    """A value that does not convert; the caller adds which option it was."""
