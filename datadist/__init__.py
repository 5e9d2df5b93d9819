"""datadist: KV-cache transfer for prefill/decode disaggregated inference, with the API of
CANN's ``llm_datadist`` (CacheManager mode), on CPU, CUDA or Ascend machines.

``from datadist import *`` gives the same names as ``from llm_datadist import *``.
"""
import importlib
from typing import TYPE_CHECKING, Any

from .engine.version import __version__ as __version__

if TYPE_CHECKING:
    from ._arrivals import Arrival
    from ._cache_manager import CacheManager
    from ._config import LLMConfig, LlmConfig
    from ._kv_cache import KvCache
    from ._llm_datadist import LLMDataDist
    from ._cluster import LLMClusterInfo
    from ._objects import BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, MemInfo
    from ._status import LLMException, LLMStatusCode, Status
    from ._tensors import create_tensors
    from ._handles import TransferHandle
    from ._transfer_async import CacheTask, LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig
    from ._types import DataType, LLMRole, Memtype, Placement, RegisterMemStatus

#: Where each public name is defined.  They load on first use, so importing a submodule
#: (``ems`` builds on ``datadist.engine``) does not load the whole API layer.
_EXPORTS = {
    "Arrival": "._arrivals", "CacheManager": "._cache_manager", "LLMConfig": "._config", "LlmConfig": "._config",
    "KvCache": "._kv_cache", "LLMDataDist": "._llm_datadist",
    **dict.fromkeys(("BlocksCacheKey", "Cache", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "MemInfo"),
                    "._objects"),
    "LLMClusterInfo": "._cluster", "TransferHandle": "._handles",
    **dict.fromkeys(("LLMException", "LLMStatusCode", "Status"), "._status"),
    "create_tensors": "._tensors",
    **dict.fromkeys(("CacheTask", "LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig"),
                    "._transfer_async"),
    **dict.fromkeys(("DataType", "LLMRole", "Memtype", "Placement", "RegisterMemStatus"), "._types"),
}


def _log_level_from_env() -> None:
    """``DATADIST_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR) sets the ``datadist`` logger's
    level; a value that is none of them is reported once and ignored."""
    import logging
    import os

    text = os.environ.get("DATADIST_LOG_LEVEL", "").strip().upper()
    if not text:
        return
    level = logging.getLevelName(text)
    if isinstance(level, int):
        logging.getLogger("datadist").setLevel(level)
    else:
        logging.getLogger("datadist").warning("DATADIST_LOG_LEVEL=%r is not a log level (DEBUG, INFO, WARNING, "
                                              "ERROR, CRITICAL); left unchanged", text)


_log_level_from_env()

__all__ = [
    "LLMDataDist", "CacheManager", "LLMConfig", "LlmConfig",
    "LLMRole", "Placement", "DataType", "RegisterMemStatus", "Memtype",
    "LLMStatusCode", "LLMException", "Status",
    "CacheDesc", "Cache", "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "LLMClusterInfo", "MemInfo",
    "create_tensors", "Arrival", "KvCache",
    "LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask", "TransferHandle",
]

#: Names CANN's package imports lazily from its v1 (KvCacheManager mode) package.
_V1_NAMES = ("TensorDesc", "Tensor", "KvCacheManager")


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # the next lookup finds it without this function
        return value
    if name in _V1_NAMES:
        # As CANN does when its v1 package is absent: an import error, naming what is missing.
        raise ModuleNotFoundError(f"{name} belongs to llm_datadist's v1 (KvCacheManager) mode, which datadist "
                                  "does not implement; use CacheManager mode (LLMDataDist.cache_manager)",
                                  name="llm_datadist_v1")
    raise AttributeError(f"module 'datadist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
