"""DatadistConnector's worker halves outside a vLLM engine, for the worker-level vLLM tests
(run with a Python that has vLLM).  A worker is told its tensor-parallel rank and size
through vLLM's ``parallel_state`` getters, which a process outside a vLLM engine cannot
otherwise be; it gets the KV cache tensors it is given, with vLLM's layer names."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import torch
import vllm.distributed.parallel_state as parallel_state

from datadist.integrations.vllm.worker import DatadistWorker, Settings

__all__ = ["make_worker"]


def make_worker(caches: Sequence[torch.Tensor], num_blocks: int, producer: bool, rank: int = 0, size: int = 1,
                attention: str = "CPU_ATTN:vec", **settings: Any) -> DatadistWorker:
    """A registered prefill (``producer``) or decode worker over ``caches`` (one tensor per
    layer, ``num_blocks`` blocks each) of vLLM's ``attention`` kernel (as
    ``datadist.integrations.vllm.blocks`` names it), linked over tcp on 127.0.0.1 unless
    ``settings`` say otherwise (any :class:`Settings` field)."""
    parallel_state.get_tensor_model_parallel_rank = lambda: rank  # type: ignore[assignment]
    parallel_state.get_tensor_model_parallel_world_size = lambda: size  # type: ignore[assignment]
    fields: dict[str, Any] = dict(host="127.0.0.1", port=0, transfer_backend="tcp", timeout_ms=5000, lease_s=60.0,
                                  max_pulls=2, idle_wait_ms=0, link_secret_file=None, producer=producer,
                                  consumer=not producer, engine_id="prefill" if producer else "decode")
    fields.update(settings)
    worker = DatadistWorker(None, Settings(**fields), SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[None]),
                            attention)
    worker.register({f"model.layers.{i}.self_attn": cache for i, cache in enumerate(caches)})
    return worker
