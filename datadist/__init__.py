"""datadist: KV-cache transfer for prefill/decode disaggregated inference, with the API of
CANN's ``llm_datadist`` (CacheManager mode), on CPU, CUDA or Ascend machines.

``from datadist import *`` gives the same names as ``from llm_datadist import *``.
"""
from ._arrivals import Arrival
from ._cache_manager import CacheManager
from ._config import LLMConfig, LlmConfig
from ._llm_datadist import LLMDataDist
from ._objects import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, LLMClusterInfo,
                       MemInfo)
from ._status import LLMException, LLMStatusCode, Status
from ._tensors import create_tensors
from ._transfer_async import CacheTask, LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig
from ._types import DataType, LLMRole, Memtype, Placement, RegisterMemStatus

__version__ = "0.1.0"

__all__ = [
    "LLMDataDist", "CacheManager", "LLMConfig", "LlmConfig",
    "LLMRole", "Placement", "DataType", "RegisterMemStatus", "Memtype",
    "LLMStatusCode", "LLMException", "Status",
    "CacheDesc", "Cache", "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "LLMClusterInfo", "MemInfo",
    "create_tensors", "Arrival",
    "LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask",
]
