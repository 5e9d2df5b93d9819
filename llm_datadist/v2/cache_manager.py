"""``llm_datadist.v2.cache_manager``: :class:`datadist.CacheManager`."""
from datadist import CacheManager

__all__ = ["CacheManager"]
