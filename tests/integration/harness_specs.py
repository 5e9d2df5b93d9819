"""Picklable descriptions shared by the test process and the engine processes.

Keys, cache references and cache descriptors travel over the pipes as these small frozen
dataclasses; the engine process turns them into datadist objects.  The test process never
needs a live datadist object to describe a call.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

__all__ = [
    "TRANSPORTS", "PROMPT_ID", "DECODER_ID", "POOL_CFG", "SYNC_KV_TIMEOUT_MS", "DTYPES",
    "ITEMSIZE", "Key", "Ref", "Desc", "cache_key", "id_key", "blocks_key", "transfer_config",
    "key_config", "base_config",
]

TRANSPORTS: Tuple[str, ...] = ("shm", "tcp", "gloo")
PROMPT_ID = 1
DECODER_ID = 2
#: 64 MiB pools, 64 KiB pages: room for every cache a test allocates.
POOL_CFG = '{"memory_size": 67108864, "page_shift": 16}'
SYNC_KV_TIMEOUT_MS = 1000

DTYPES = {
    "fp16": ("DT_FLOAT16", "float16"),
    "bf16": ("DT_BF16", "bfloat16"),
    "int8": ("DT_INT8", "int8"),
    "fp32": ("DT_FLOAT", "float32"),
    "int32": ("DT_INT32", "int32"),
    "uint8": ("DT_UINT8", "uint8"),
}
ITEMSIZE = {"fp16": 2, "bf16": 2, "int8": 1, "fp32": 4, "int32": 4, "uint8": 1}


@dataclasses.dataclass(frozen=True)
class Key:
    """A datadist value (a key, a transfer config) to build in the child:
    ``getattr(datadist, kind)(*args)``, with Keys among ``args`` built first."""

    kind: str
    args: Tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Ref:
    """A cache held by the child under ``name``."""

    name: str


@dataclasses.dataclass(frozen=True)
class Desc:
    """A ``CacheDesc`` to build in the child."""

    num_tensors: int
    shape: Tuple[int, ...]
    dtype: str = "fp16"
    placement: str = "DEVICE"
    device: str = "cpu"       # where the child makes the tensors of a registered cache

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one tensor."""
        return int(np.prod(self.shape)) * ITEMSIZE[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one block in a blocks cache)."""
        return self.tensor_bytes // self.shape[0]


def cache_key(cluster_id: int, req_id: int, model_id: int = 0) -> Key:
    """``CacheKey(cluster_id, req_id, model_id)``."""
    return Key("CacheKey", (cluster_id, req_id, model_id))


def id_key(cluster_id: int, cache_id: int, batch_index: int = 0) -> Key:
    """``CacheKeyByIdAndIndex(cluster_id, cache_id, batch_index)``."""
    return Key("CacheKeyByIdAndIndex", (cluster_id, cache_id, batch_index))


def blocks_key(cluster_id: int, model_id: int = 0) -> Key:
    """``BlocksCacheKey(cluster_id, model_id)``."""
    return Key("BlocksCacheKey", (cluster_id, model_id))


def transfer_config(cluster_id: int, dst_addrs: List[int], src_layers: Optional[range] = None,
                    src_batch_index: int = 0) -> Key:
    """``TransferConfig(cluster_id, dst_addrs, src_layers, src_batch_index)``: raw addresses."""
    return Key("TransferConfig", (cluster_id, list(dst_addrs), src_layers, src_batch_index))


def key_config(key: Key, src_layers: range, dst_layers: range, src_batch_index: int = 0) -> Key:
    """``TransferWithCacheKeyConfig(key, src_layers, dst_layers, src_batch_index)``."""
    return Key("TransferWithCacheKeyConfig", (key, src_layers, dst_layers, src_batch_index))


def base_config(transport: str, *, listen_port: Optional[int] = None,
                sync_kv_timeout: int = SYNC_KV_TIMEOUT_MS, **overrides: Any) -> Dict[str, Any]:
    """``LLMConfig`` property values for a CPU engine; a value of ``None`` leaves it unset."""
    cfg: Dict[str, Any] = {
        "device_id": 0,
        "sync_kv_timeout": sync_kv_timeout,
        "host_mem_pool_cfg": POOL_CFG,
        "mem_pool_cfg": POOL_CFG,
        "transfer_backend": transport,
    }
    if listen_port is not None:
        cfg["listen_ip_info"] = f"127.0.0.1:{listen_port}"
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not None}
