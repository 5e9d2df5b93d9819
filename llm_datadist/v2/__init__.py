"""``llm_datadist.v2``: the CacheManager-mode names, as CANN's package lays them out."""
from llm_datadist import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, CacheTask, DataType,
                          KvCache, LayerSynchronizer, LLMClusterInfo, LLMConfig, LlmConfig, LLMDataDist,
                          LLMException, LLMRole, LLMStatusCode, MemInfo, Memtype, Placement, RegisterMemStatus,
                          Status, TransferConfig, TransferWithCacheKeyConfig)
from llm_datadist import __all__  # noqa: F401  (the same names)
