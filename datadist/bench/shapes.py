"""The workloads of ``python -m datadist.bench`` and what every run of them shares: their
shapes and sizes, the engine configuration and cache description of each side, the seeded
source values, and the raw copy of the same blocks (the yardstick of every row)."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .._cache_manager import CacheManager
    from .._objects import Cache, CacheDesc

__all__ = ["Workload", "WORKLOADS", "SWEEP_KIB", "TRANSPORTS", "DEVICES", "DEVICE_ONLY", "sized", "blocks", "config", "desc",
           "pool_bytes", "source_base", "filled_source", "raw_copy_seconds"]


@dataclass(frozen=True)
class Workload:
    name: str
    block_bytes: int
    blocks: int            # blocks per call: per batch, or per request and layer (layerwise)
    cache_blocks: int      # blocks in each cache
    num_tensors: int
    scatter: bool
    layerwise: bool = False
    rounds: int = 5
    requests: int = 1      # layerwise: requests pushing at once, a thread each
    decoders: int = 0      # fan-in: decoder processes pulling from one prompt at once

    @property
    def layers(self) -> int:
        return self.num_tensors // 2 if self.layerwise else 1

    @property
    def batch_blocks(self) -> int:
        """Blocks of each tensor a batch moves (all requests together)."""
        return self.blocks * self.requests

    @property
    def batch_bytes(self) -> int:
        return self.block_bytes * self.batch_blocks * self.num_tensors


WORKLOADS = {
    "inorder-256k": Workload("inorder-256k", 256 << 10, 1024, 1024, 1, False),
    "scatter-32k": Workload("scatter-32k", 32 << 10, 2048, 2048, 1, True),
    "small-4k": Workload("small-4k", 4 << 10, 1, 16, 1, False, rounds=2000),
    "kv-7b": Workload("kv-7b", 128 << 10, 16, 128, 64, True, layerwise=True, rounds=5, requests=8),
    "fan-in": Workload("fan-in", 2 << 10, 16, 256, 4, True, rounds=1000, decoders=8),
}
#: ``--sweep``: 32 MiB in order at each block size, for GB/s against block size (``--plot``).
SWEEP_KIB = (4, 16, 64, 256, 1024)
WORKLOADS.update({f"sweep-{k}k": Workload(f"sweep-{k}k", k << 10, (32 << 10) // k, (32 << 10) // k, 1, False,
                                          rounds=5) for k in SWEEP_KIB})
TRANSPORTS = ("local", "shm", "tcp", "gloo", "nccl", "hccl")
DEVICES = ("cpu", "cuda", "npu")
#: Transports that move device memory of one kind only.
DEVICE_ONLY = {"nccl": "cuda", "hccl": "npu"}


def sized(workload: str, rounds: Optional[int] = None, requests: Optional[int] = None,
          layers: Optional[int] = None, decoders: Optional[int] = None) -> Workload:
    """The workload ``workload`` with fewer (or more) rounds, requests, layers or decoders.

    Raises ``ValueError`` for requests or layers of a workload that is not layer-wise,
    decoders of one that is not a fan-in, or more blocks than a cache holds."""
    w = WORKLOADS[workload]
    if (requests is not None or layers is not None) and not w.layerwise:
        raise ValueError(f"requests and layers apply to layer-wise workloads, not to {workload}")
    if decoders is not None and not w.decoders:
        raise ValueError(f"decoders apply to the fan-in workload, not to {workload}")
    w = replace(w, rounds=w.rounds if rounds is None else rounds,
                requests=w.requests if requests is None else requests,
                num_tensors=w.num_tensors if layers is None else 2 * layers,
                decoders=w.decoders if decoders is None else decoders)
    if min(w.rounds, w.requests, w.num_tensors) < 1 or (bool(WORKLOADS[workload].decoders) and w.decoders < 1):
        raise ValueError(f"{workload}: rounds, requests, layers and decoders must be at least 1")
    if w.batch_blocks > w.cache_blocks:
        raise ValueError(f"{workload}: {w.requests} requests x {w.blocks} blocks do not fit caches of "
                         f"{w.cache_blocks} blocks")
    return w


def blocks(w: Workload) -> Tuple[List[int], List[int]]:
    """Source and destination blocks of a batch; request r owns the r-th ``w.blocks`` of each."""
    src = list(range(w.batch_blocks))
    if w.scatter:
        dst = [int(b) for b in np.random.default_rng(7).permutation(w.cache_blocks)[: w.batch_blocks]]
    else:
        dst = list(range(w.batch_blocks))
    return src, dst


def config(transport: str, pool_bytes: int, listen: Optional[str] = None, device: str = "cpu",
           checksum: bool = False) -> Dict[str, str]:
    """The options of a bench engine; ``checksum``: the socket transfers it starts carry
    end-to-end checksums (``transfer_checksum``)."""
    from datadist import LLMConfig

    cfg = LLMConfig()
    cfg.transfer_checksum = checksum
    cfg.device_id = 0
    cfg.sync_kv_timeout = 60000
    pool = json.dumps({"memory_size": pool_bytes, "page_shift": 16})
    if device != "cpu":
        cfg.mem_pool_cfg = pool
        cfg.device_type = device
    else:
        cfg.host_mem_pool_cfg = pool
        cfg.device_type = "cpu"
    cfg.transfer_backend = "shm" if transport == "local" else transport
    if listen:
        cfg.listen_ip_info = listen
    return cfg.generate_options()


def desc(w: Workload, device: str = "cpu") -> "CacheDesc":
    from datadist import CacheDesc, DataType, Placement

    return CacheDesc(w.num_tensors, [w.cache_blocks, w.block_bytes // 2], DataType.DT_FLOAT16,
                     Placement.DEVICE if device != "cpu" else Placement.HOST)


def pool_bytes(w: Workload) -> int:
    return w.block_bytes * w.cache_blocks * w.num_tensors + (1 << 20)


def source_base(shape: Tuple[int, ...]) -> "torch.Tensor":
    """Seeded random int16 values; source tensor k holds them xor-ed with k (every block
    differs from every other, at a fraction of the cost of drawing each tensor).  Any
    process computes the same values."""
    import torch

    return torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=torch.Generator().manual_seed(1))


def filled_source(cm: "CacheManager", w: Workload, device: str) -> "Cache":
    """The source blocks cache (``BlocksCacheKey(1, 0)``) of ``cm``: tensor k holds
    ``source_base(shape) ^ k``."""
    import torch
    from datadist import BlocksCacheKey

    src = cm.allocate_blocks_cache(desc(w, device), BlocksCacheKey(1, 0))
    tensors = cm.get_cache_tensors(src)
    base = source_base(tuple(tensors[0].shape))
    for k, tensor in enumerate(tensors):
        tensor.view(torch.int16).copy_(base ^ k)
    return src


def raw_copy_seconds(w: Workload, src_blocks: List[int], dst_blocks: List[int], device: str = "cpu") -> float:
    """Seconds per batch of a numpy copy of the same blocks in one process (median); on
    device, of a torch copy of them on that device."""
    if device != "cpu":
        return _torch_copy(w, src_blocks, dst_blocks, device)
    src = np.ones((w.num_tensors * w.cache_blocks, w.block_bytes), np.uint8)
    dst = np.zeros_like(src)
    n = len(src_blocks)
    times = []
    for _ in range(min(w.rounds, 20) + 1):
        t = time.perf_counter()
        for k in range(w.num_tensors):
            off = k * w.cache_blocks
            if w.scatter:
                for i, j in zip(src_blocks, dst_blocks):
                    dst[off + j] = src[off + i]
            else:
                np.copyto(dst[off: off + n], src[off: off + n])
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _torch_copy(w: Workload, src_blocks: List[int], dst_blocks: List[int], device: str) -> float:
    import torch

    src = torch.ones((w.num_tensors * w.cache_blocks, w.block_bytes), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    si = torch.tensor(src_blocks, device=device)
    di = torch.tensor(dst_blocks, device=device)
    backend = getattr(torch, device)  # torch.cuda, or torch.npu (torch_npu's)
    times = []
    for _ in range(min(w.rounds, 20) + 1):
        backend.synchronize()
        t = time.perf_counter()
        for k in range(w.num_tensors):
            off = k * w.cache_blocks
            if w.scatter:
                dst[off: off + w.cache_blocks].index_copy_(0, di, src[off: off + w.cache_blocks].index_select(0, si))
            else:
                dst[off: off + len(src_blocks)].copy_(src[off: off + len(src_blocks)])
        backend.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


