"""``llm_datadist``: CANN's import name, over the very objects of ``datadist``."""
from __future__ import annotations

import importlib

import pytest

import datadist

# The public names of CANN's llm_datadist/__init__.py (its __all__ less the v1-only names).
CANN_NAMES = ["LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig", "DataType",
              "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache", "BlocksCacheKey",
              "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer", "TransferConfig", "CacheTask",
              "TransferWithCacheKeyConfig", "Memtype", "MemInfo"]

SUBMODULES = {
    "llm_datadist.status": ["LLMStatusCode", "LLMException", "Status"],
    "llm_datadist.configs": ["LLMClusterInfo", "LLMRole", "LlmConfig", "LLMConfig"],
    "llm_datadist.data_type": ["DataType"],
    "llm_datadist.v2": CANN_NAMES,
    "llm_datadist.v2.llm_types": ["CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "BlocksCacheKey",
                                  "Placement", "RegisterMemStatus", "Cache", "LayerSynchronizer", "TransferConfig",
                                  "CacheTask", "TransferWithCacheKeyConfig", "Memtype", "MemInfo", "DataType"],
    "llm_datadist.v2.llm_datadist": ["LLMDataDist"],
    "llm_datadist.v2.cache_manager": ["CacheManager"],
}


def test_star_import_gives_cann_names_as_datadist_objects() -> None:
    namespace: dict = {}
    exec("from llm_datadist import *", namespace)
    for name in CANN_NAMES:
        assert namespace[name] is getattr(datadist, name), name


@pytest.mark.parametrize("module", sorted(SUBMODULES))
def test_submodules_client_code_imports(module: str) -> None:
    mod = importlib.import_module(module)
    for name in SUBMODULES[module]:
        assert getattr(mod, name) is getattr(datadist, name), f"{module}.{name}"


@pytest.mark.parametrize("name", ["TensorDesc", "Tensor", "KvCacheManager"])
def test_v1_names_raise_an_import_error_naming_the_mode(name: str) -> None:
    import llm_datadist

    with pytest.raises(ImportError, match="KvCacheManager"):
        getattr(llm_datadist, name)
    assert not hasattr(llm_datadist, "NoSuchName")


def test_which_implementation_is_imported() -> None:
    import llm_datadist

    assert llm_datadist.__implementation__ == "datadist"
    assert llm_datadist.__version__ == datadist.__version__


def test_kv_cache_create_cpu_cache_checks_like_cann() -> None:
    from llm_datadist import CacheDesc, DataType, KvCache, LLMException, Placement

    host = CacheDesc(2, [4, 8], DataType.DT_FLOAT16, Placement.HOST)
    cache = KvCache.create_cpu_cache(host, [0x1000, 0x2000])
    assert (cache.cache_id, cache.per_device_tensor_addrs) == (-1, [[0x1000, 0x2000]])
    assert KvCache.create_cpu_cache(host, [[1, 2], [3, 4]]).per_device_tensor_addrs == [[1, 2], [3, 4]]
    with pytest.raises(LLMException):
        KvCache.create_cpu_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT16), [1, 2])  # DEVICE placement
    with pytest.raises(LLMException):
        KvCache.create_cpu_cache(host, [1])
    with pytest.raises(TypeError):
        KvCache.create_cpu_cache(host, [1, [2]])
