"""``ems.cc_v1.cc_config``: the V1 config and its kvcache types, where the SDK keeps them."""
from ..config import KVCACHE_TYPES, CcConfig_v1, KVCacheType

__all__ = ["CcConfig_v1", "KVCacheType", "KVCACHE_TYPES"]
