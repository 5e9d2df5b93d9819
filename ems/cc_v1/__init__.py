"""``ems.cc_v1``: the vendor SDK's package of the V1 (hash) context-caching API."""
from ..config import CcConfig_v1, KVCacheType
from ..context_caching import ContextCaching as ContextCache_v1

__all__ = ["CcConfig_v1", "KVCacheType", "ContextCache_v1"]
