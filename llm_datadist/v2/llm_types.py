"""``llm_datadist.v2.llm_types``: the value types of :mod:`datadist`."""
from datadist import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, CacheTask, DataType, KvCache,
                      LayerSynchronizer, MemInfo, Memtype, Placement, RegisterMemStatus, TransferConfig,
                      TransferWithCacheKeyConfig)

__all__ = ["CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "BlocksCacheKey", "Placement",
           "RegisterMemStatus", "Cache", "LayerSynchronizer", "TransferConfig", "CacheTask",
           "TransferWithCacheKeyConfig", "Memtype", "MemInfo", "DataType"]
