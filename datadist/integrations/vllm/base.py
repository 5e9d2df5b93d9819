"""The part of a vLLM KV connector that only routes: vLLM makes one connector object per
role, so each of ours holds a scheduler half or a worker half and forwards to it.

A worker half provides ``register(kv_caches)``, ``finished(finished_req_ids) -> (sent,
received, failed)``, ``take_load_errors()`` and ``close()``; a scheduler half provides
``matched_tokens(request, num_computed_tokens)`` and ``after_alloc(request, blocks,
num_external_tokens)``.  Loads finish before their request is scheduled, so there is no
layer-wise wait, and saves (where a connector has them) run after the forward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                              KVConnectorTransferResults)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["SplitConnector"]


class SplitConnector(KVConnectorBase_V1):
    """Base of our connectors: ``_make_scheduler``/``_make_worker`` build the halves."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler: Any = None
        self._worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config)
        else:
            self._worker = self._make_worker(vllm_config, kv_cache_config)

    def _make_scheduler(self, vllm_config: "VllmConfig") -> Any:
        raise NotImplementedError

    def _make_worker(self, vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"]) -> Any:
        raise NotImplementedError

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a request's blocks are all loaded before it is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # nothing moves layer by layer

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self._worker.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)
