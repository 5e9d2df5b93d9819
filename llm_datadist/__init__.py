"""``llm_datadist``: CANN's import name for :mod:`datadist`, so client code written for
CANN's package runs unchanged (``from llm_datadist import LLMDataDist, LLMRole, ...``).

Every name is the very object :mod:`datadist` exports.  The submodules client code imports
(``llm_datadist.status``, ``.configs``, ``.data_type``, ``.v2``, ``.v2.llm_types``,
``.v2.llm_datadist``, ``.v2.cache_manager``) re-export the same objects.  With CANN's
environment sourced, CANN's own package comes first on ``sys.path``; docs/migration.md
says how to tell which one was imported and how to choose.
"""
from typing import Any

from datadist import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, CacheTask, DataType, KvCache,
                      LayerSynchronizer, LLMClusterInfo, LLMConfig, LlmConfig, LLMDataDist, LLMException,
                      LLMRole, LLMStatusCode, MemInfo, Memtype, Placement, RegisterMemStatus, Status,
                      TransferConfig, TransferWithCacheKeyConfig)
from datadist import __getattr__ as _v1_names
from datadist import __version__

#: Which implementation this is (CANN's package has no such attribute).
__implementation__ = "datadist"

__all__ = [
    "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig", "DataType", "Status",
    "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache", "BlocksCacheKey", "LLMDataDist",
    "Placement", "RegisterMemStatus", "LayerSynchronizer", "TransferConfig", "CacheTask",
    "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
]


def __getattr__(name: str) -> Any:
    return _v1_names(name)
