"""Unit tests: CacheDesc, Cache, cache keys, LLMClusterInfo, MemInfo and the IP helpers
(SPEC-datadist section 3)."""
import pickle
import socket

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from datadist._cluster import IpInfo, LLMClusterInfo, ip_to_int, ip_to_str
from datadist._objects import (
    INVALID_ID,
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    MemInfo,
    as_tensor_addrs,
)
from datadist._status import LLMException, LLMStatusCode, ParamInvalidError
from datadist._types import DataType, LLMRole, Memtype, Placement


def assert_param_invalid(excinfo):
    """Out-of-domain values are both ValueError and LLMException(LLM_PARAM_INVALID)."""
    assert isinstance(excinfo.value, ValueError)
    assert isinstance(excinfo.value, LLMException)
    assert excinfo.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


# ---------------------------------------------------------------------- CacheDesc

@pytest.mark.parametrize("dtype,shape,size,batch", [
    (DataType.DT_BF16, [4, 16, 8, 128], 4 * 16 * 8 * 128 * 2, 4),
    (DataType.DT_INT8, [3, 100], 300, 3),
    (DataType.DT_FLOAT16, (2, 256), 1024, 2),
    (DataType.DT_FLOAT, [7], 28, 7),
    (DataType.DT_INT64, [1, 1, 1], 8, 1),
])
def test_cache_desc_size_and_batch_size(dtype, shape, size, batch):
    desc = CacheDesc(80, shape, dtype)
    assert desc.size == size
    assert desc.batch_size == batch
    assert desc.numel * dtype.element_size == size


def test_cache_desc_defaults_and_properties():
    desc = CacheDesc(2, [4, 16], DataType.DT_FLOAT16)
    assert desc.num_tensors == 2
    assert desc.shape == [4, 16] and isinstance(desc.shape, list)
    assert desc.data_type is DataType.DT_FLOAT16
    assert desc.placement is Placement.DEVICE
    assert desc.batch_dim_index == 0 == desc.batch_dim
    assert desc.seq_len_dim_index == -1
    assert desc.kv_tensor_format is None


def test_cache_desc_batch_dim_and_seq_dim():
    desc = CacheDesc(4, [16, 8, 5], DataType.DT_BF16, Placement.HOST, 2, 0, "BSND")
    assert desc.batch_size == 5 and desc.seq_len_dim_index == 0
    assert desc.placement is Placement.HOST and desc.kv_tensor_format == "BSND"
    assert desc.size == 16 * 8 * 5 * 2


def test_cache_desc_changes_only_through_update_dim():
    shape = [4, 16]
    desc = CacheDesc(2, shape, DataType.DT_INT8)
    shape[0] = 99
    desc.shape[0] = 77
    assert desc.shape == [4, 16] and desc.batch_size == 4
    with pytest.raises(AttributeError):
        desc.num_tensors = 3


def test_cache_desc_update_dim():
    """update_dim(dim_index, dim_value), as CANN's: in place, Python-style index; size and
    batch_size follow; a bad index or value raises LLM_PARAM_INVALID and changes nothing."""
    desc = CacheDesc(2, [4, 16, 8], DataType.DT_FLOAT16, Placement.DEVICE, 0, 1)
    before = hash(desc)
    desc.update_dim(1, 32)
    assert desc.shape == [4, 32, 8] and desc.size == 4 * 32 * 8 * 2
    desc.update_dim(-3, 6)
    assert desc.shape == [6, 32, 8] and desc.batch_size == 6
    assert hash(desc) == before  # the hash leaves the dims' values out: it never changes
    assert desc == CacheDesc(2, [6, 32, 8], DataType.DT_FLOAT16, Placement.DEVICE, 0, 1)
    assert hash(desc) == hash(CacheDesc(2, [6, 32, 8], DataType.DT_FLOAT16, Placement.DEVICE, 0, 1))
    for index, value in ((3, 4), (-4, 4), (0, 0), (0, -1), (0, 2**62)):
        with pytest.raises(ValueError) as info:
            desc.update_dim(index, value)
        assert_param_invalid(info)
    with pytest.raises(TypeError):
        desc.update_dim(0, 2.0)
    assert desc.shape == [6, 32, 8]


def test_cache_desc_in_a_set_survives_update_dim():
    desc = CacheDesc(2, [4, 16], DataType.DT_INT8)
    seen = {desc}
    desc.update_dim(1, 8)
    assert desc in seen and CacheDesc(2, [4, 8], DataType.DT_INT8) in seen
    assert CacheDesc(2, [4, 16], DataType.DT_INT8) not in seen


def test_cache_keeps_the_desc_it_was_made_with():
    """A Cache copies its desc: update_dim on the desc given (or on cache.cache_desc) does
    not change the cache's shape."""
    desc = CacheDesc(2, [2, 4], DataType.DT_FLOAT, Placement.HOST)
    owners = [torch.zeros(8) for _ in range(2)]
    cache = Cache.create_cpu_cache(desc, owners)
    desc.update_dim(0, 64)
    cache.cache_desc.update_dim(0, 128)
    assert cache.cache_desc == CacheDesc(2, [2, 4], DataType.DT_FLOAT, Placement.HOST)
    assert cache.cache_desc.size == 32


def test_cache_desc_accepts_int_likes():
    desc = CacheDesc(np.int64(2), torch.Size([3, np.int32(4)]), DataType.DT_INT8)
    assert desc == CacheDesc(2, [3, 4], DataType.DT_INT8)
    assert all(type(d) is int for d in desc.shape)


def test_cache_desc_equality_hash_repr():
    a = CacheDesc(2, [4, 16], DataType.DT_FLOAT16)
    b = CacheDesc(2, (4, 16), DataType.DT_FLOAT16, Placement.DEVICE, 0, -1, None)
    assert a == b and hash(a) == hash(b)
    assert a != CacheDesc(2, [4, 16], DataType.DT_BF16)
    assert a != CacheDesc(2, [4, 16], DataType.DT_FLOAT16, Placement.HOST)
    assert a != CacheDesc(4, [4, 16], DataType.DT_FLOAT16)
    assert a != CacheDesc(2, [4, 16], DataType.DT_FLOAT16, seq_len_dim_index=1)
    assert a != "CacheDesc"
    assert len({a, b}) == 1
    text = repr(a)
    assert text.startswith("CacheDesc(num_tensors=2, shape=[4, 16], data_type=<DataType.DT_FLOAT16")
    assert eval(text.replace("<DataType.DT_FLOAT16: 1>", "DataType.DT_FLOAT16")
                .replace("<Placement.DEVICE: 1>", "Placement.DEVICE")) == a


def test_cache_desc_pickles():
    desc = CacheDesc(2, [4, 16], DataType.DT_BF16, Placement.HOST, kv_tensor_format="ND")
    assert pickle.loads(pickle.dumps(desc)) == desc


@pytest.mark.parametrize("args,kwargs", [
    ((2.0, [4], DataType.DT_INT8), {}),
    (("2", [4], DataType.DT_INT8), {}),
    ((True, [4], DataType.DT_INT8), {}),
    ((2, 4, DataType.DT_INT8), {}),
    ((2, "44", DataType.DT_INT8), {}),
    ((2, [4.0], DataType.DT_INT8), {}),
    ((2, [True], DataType.DT_INT8), {}),
    ((2, [4], torch.int8), {}),
    ((2, [4], 2), {}),
    ((2, [4], DataType.DT_INT8, 1), {}),
    ((2, [4], DataType.DT_INT8), {"batch_dim_index": 0.0}),
    ((2, [4], DataType.DT_INT8), {"seq_len_dim_index": "0"}),
    ((2, [4], DataType.DT_INT8), {"kv_tensor_format": 1}),
])
def test_cache_desc_type_errors(args, kwargs):
    with pytest.raises(TypeError):
        CacheDesc(*args, **kwargs)


@pytest.mark.parametrize("args,kwargs", [
    ((0, [4], DataType.DT_INT8), {}),
    ((-1, [4], DataType.DT_INT8), {}),
    ((2**32, [4], DataType.DT_INT8), {}),
    ((2, [], DataType.DT_INT8), {}),
    ((2, [4, 0], DataType.DT_INT8), {}),
    ((2, [-4], DataType.DT_INT8), {}),
    ((2, [4, 4], DataType.DT_INT8), {"batch_dim_index": 2}),
    ((2, [4, 4], DataType.DT_INT8), {"batch_dim_index": -1}),
    ((2, [4, 4], DataType.DT_INT8), {"seq_len_dim_index": 2}),
    ((2, [4, 4], DataType.DT_INT8), {"seq_len_dim_index": -2}),
    ((2, [2**40, 2**40], DataType.DT_INT8), {}),
])
def test_cache_desc_value_errors(args, kwargs):
    with pytest.raises(ValueError) as info:
        CacheDesc(*args, **kwargs)
    assert_param_invalid(info)


def test_cache_desc_error_messages_name_the_value():
    with pytest.raises(ValueError, match="num_tensors = 0"):
        CacheDesc(0, [4], DataType.DT_INT8)
    with pytest.raises(ValueError, match=r"\[4, 0\]"):
        CacheDesc(1, [4, 0], DataType.DT_INT8)


# ---------------------------------------------------------------------- cache keys

def test_cache_key_defaults_and_aliases():
    key = CacheKey(1, 2)
    assert (key.prompt_cluster_id, key.cluster_id, key.req_id, key.model_id, key.prefix_id) == (1, 1, 2, 0, 2**64 - 1)
    assert INVALID_ID == 2**64 - 1
    assert CacheKey(prompt_cluster_id=1, req_id=2) == key
    assert CacheKey(cluster_id=1, req_id=2) == key
    assert CacheKey(1, 2, 0, INVALID_ID) == key
    assert CacheKey(1, 2, 3, 4) == CacheKey(1, req_id=2, model_id=3, prefix_id=4)


def test_cache_key_equality_hash_repr():
    key = CacheKey(1, 2, 3)
    assert key == CacheKey(1, 2, 3) and hash(key) == hash(CacheKey(1, 2, 3))
    assert key != CacheKey(1, 2, 4) and key != CacheKey(9, 2, 3) and key != CacheKey(1, 5, 3)
    assert key != CacheKey(1, 2, 3, prefix_id=0)
    assert repr(key) == "CacheKey(prompt_cluster_id=1, req_id=2, model_id=3, prefix_id=18446744073709551615)"
    assert eval(repr(key)) == key
    assert {key: "v"}[CacheKey(1, 2, 3)] == "v"
    assert pickle.loads(pickle.dumps(key)) == key
    with pytest.raises(AttributeError):
        key.req_id = 5


def test_cache_key_errors():
    # arity, as CANN: LLMException(LLM_PARAM_INVALID)
    for args, kwargs in (((1,), {}), ((), {"req_id": 1}), ((1, 2, 3, 4, 5), {})):
        with pytest.raises(ValueError) as info:
            CacheKey(*args, **kwargs)
        assert_param_invalid(info)
    with pytest.raises(TypeError):
        CacheKey(1, 2, prompt_cluster_id=1)  # type: ignore[misc]
    with pytest.raises(TypeError):
        CacheKey(1, 2, cluster_id=1)
    with pytest.raises(TypeError):
        CacheKey(1, "2")
    with pytest.raises(TypeError):
        CacheKey(1.0, 2)
    with pytest.raises(TypeError):
        CacheKey(1, 2, model_id=True)
    for bad in ((-1, 2), (1, -2), (1, 2**64), (1, 2, -1), (1, 2, 0, 2**64)):
        with pytest.raises(ValueError) as info:
            CacheKey(*bad)
        assert_param_invalid(info)


def test_cache_key_by_id_and_index():
    key = CacheKeyByIdAndIndex(1, 5)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (1, 5, 0)
    assert key == CacheKeyByIdAndIndex(cluster_id=1, cache_id=5, batch_index=0)
    assert key != CacheKeyByIdAndIndex(1, 5, 1)
    assert hash(key) == hash(CacheKeyByIdAndIndex(1, 5))
    assert repr(key) == "CacheKeyByIdAndIndex(cluster_id=1, cache_id=5, batch_index=0)"
    assert eval(repr(key)) == key
    assert CacheKeyByIdAndIndex(1, -3).cache_id == -3  # cpu caches have negative ids
    with pytest.raises(TypeError):
        CacheKeyByIdAndIndex(1, "5")
    with pytest.raises(TypeError):
        CacheKeyByIdAndIndex(1, 5, 0.0)
    for bad in ((-1, 5), (1, 2**63), (1, 5, -1), (1, 5, 2**32)):
        with pytest.raises(ValueError) as info:
            CacheKeyByIdAndIndex(*bad)
        assert_param_invalid(info)


def test_blocks_cache_key():
    key = BlocksCacheKey(3)
    assert (key.prompt_cluster_id, key.cluster_id, key.model_id) == (3, 3, 0)
    assert key == BlocksCacheKey(prompt_cluster_id=3) == BlocksCacheKey(cluster_id=3, model_id=0)
    assert key != BlocksCacheKey(3, 1)
    assert repr(key) == "BlocksCacheKey(prompt_cluster_id=3, model_id=0)"
    assert eval(repr(key)) == key
    assert len({key, BlocksCacheKey(3), BlocksCacheKey(4)}) == 2
    for args in ((), (1, 2, 3)):  # arity, as CANN: LLMException(LLM_PARAM_INVALID)
        with pytest.raises(ValueError) as info:
            BlocksCacheKey(*args)
        assert_param_invalid(info)
    with pytest.raises(TypeError):
        BlocksCacheKey("3")
    with pytest.raises(ValueError) as info:
        BlocksCacheKey(3, -1)
    assert_param_invalid(info)


def test_key_kinds_never_equal():
    assert CacheKey(1, 0) != CacheKeyByIdAndIndex(1, 0)
    assert BlocksCacheKey(1) != CacheKeyByIdAndIndex(1, 0, 0)
    assert len({CacheKey(1, 0), CacheKeyByIdAndIndex(1, 0), BlocksCacheKey(1)}) == 3


# ---------------------------------------------------------------------- MemInfo

def test_mem_info():
    info = MemInfo(Memtype.MEM_TYPE_HOST, 0x1000, 64)
    assert (info.mem_type, info.addr, info.size) == (Memtype.MEM_TYPE_HOST, 0x1000, 64)
    assert info == MemInfo(Memtype.MEM_TYPE_HOST, 4096, 64)
    assert info != MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 64)
    assert hash(info) == hash(MemInfo(Memtype.MEM_TYPE_HOST, 4096, 64))
    assert repr(info) == "MemInfo(mem_type=<Memtype.MEM_TYPE_HOST: 1>, addr=0x1000, size=64)"
    with pytest.raises(TypeError):
        MemInfo(1, 0x1000, 64)
    with pytest.raises(TypeError):
        MemInfo(Memtype.MEM_TYPE_HOST, "0x1000", 64)
    with pytest.raises(ValueError):
        MemInfo(Memtype.MEM_TYPE_HOST, 0x1000, -1)


# ---------------------------------------------------------------------- caches

def test_cache_constructor_is_keyword_only_and_internal():
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT16)
    with pytest.raises(TypeError):
        Cache(1, desc, [0x1000, 0x2000])  # type: ignore[misc]
    cache = Cache(cache_id=1, cache_desc=desc, tensor_addrs=[0x1000, 0x2000])
    assert cache.cache_id == 1 and cache.cache_desc == desc
    assert cache.tensor_addrs == [0x1000, 0x2000]
    assert cache.is_blocks_cache is False and cache.is_registered is False
    cache.tensor_addrs.append(5)
    assert cache.tensor_addrs == [0x1000, 0x2000]
    assert "cache_id=1" in repr(cache) and "0x1000" in repr(cache)
    assert cache != Cache(cache_id=1, cache_desc=desc, tensor_addrs=[0x1000, 0x2000])  # entities
    with pytest.raises(ValueError):
        Cache(cache_id=1, cache_desc=desc, tensor_addrs=[0x1000])


def test_create_cpu_cache_from_addresses():
    desc = CacheDesc(2, [4, 8], DataType.DT_INT8, Placement.HOST)
    first = Cache.create_cpu_cache(desc, [0x1000, 0x2000])
    second = Cache.create_cpu_cache(desc, (0x3000, 0x4000))
    assert first.cache_id < 0 and second.cache_id < first.cache_id
    assert first.is_blocks_cache and first.tensor_addrs == [0x1000, 0x2000]
    assert first.cache_desc == desc


def test_create_cpu_cache_from_tensors_keeps_them():
    desc = CacheDesc(2, [4, 8], DataType.DT_BF16, Placement.HOST)
    tensors = [torch.zeros(4, 8, dtype=torch.bfloat16) for _ in range(2)]
    cache = Cache.create_cpu_cache(desc, tensors)
    assert cache.tensor_addrs == [t.data_ptr() for t in tensors]
    assert cache._handle == tuple(tensors)


def test_create_cpu_cache_errors():
    host = CacheDesc(2, [4, 8], DataType.DT_INT8, Placement.HOST)
    device = CacheDesc(2, [4, 8], DataType.DT_INT8, Placement.DEVICE)
    with pytest.raises(LLMException) as info:
        Cache.create_cpu_cache(device, [0x1000, 0x2000])
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        Cache.create_cpu_cache("desc", [0x1000, 0x2000])
    with pytest.raises(TypeError):
        Cache.create_cpu_cache(host, 0x1000)
    with pytest.raises(TypeError):
        Cache.create_cpu_cache(host, [0x1000, "0x2000"])
    with pytest.raises(ParamInvalidError, match="2"):
        Cache.create_cpu_cache(host, [0x1000])
    with pytest.raises(ParamInvalidError):
        Cache.create_cpu_cache(host, [0x1000, 0])
    with pytest.raises(ParamInvalidError, match="bytes"):
        Cache.create_cpu_cache(host, [torch.zeros(4, 7, dtype=torch.int8)] * 2)


def test_as_tensor_addrs():
    desc = CacheDesc(3, [2, 4], DataType.DT_FLOAT)
    big = torch.zeros(16)
    addrs, keep = as_tensor_addrs([0x10, np.uint64(0x20), big], desc)
    assert addrs == [0x10, 0x20, big.data_ptr()] and keep == (big,)
    with pytest.raises(ParamInvalidError, match="non-contiguous"):
        as_tensor_addrs([torch.zeros(4, 8).t()] * 3, desc)
    with pytest.raises(ParamInvalidError):
        as_tensor_addrs([0x10, 0x20, 2**64], desc)
    with pytest.raises(TypeError):
        as_tensor_addrs([0x10, 0x20, 1.5], desc)
    with pytest.raises(TypeError):
        as_tensor_addrs([0x10, 0x20, True], desc)
    with pytest.raises(ParamInvalidError, match="my_addrs"):
        as_tensor_addrs([0x10], desc, name="my_addrs")


# ---------------------------------------------------------------------- IPs, cluster info

def test_ip_int_is_cann_little_endian():
    # llm_datadist: int.from_bytes(socket.inet_aton(ip), "little")
    assert ip_to_int("1.2.3.4") == 0x04030201
    assert ip_to_str(0x04030201) == "1.2.3.4"
    assert ip_to_int("127.0.0.1") == int.from_bytes(socket.inet_aton("127.0.0.1"), "little")
    for ip in ("0.0.0.0", "10.20.30.40", "255.255.255.255", "192.168.1.1"):
        assert ip_to_str(ip_to_int(ip)) == ip
    assert ip_to_str(" 10.0.0.1 ") == "10.0.0.1"


@given(st.integers(0, 2**32 - 1))
def test_ip_int_round_trip(value):
    text = ip_to_str(value)
    assert ip_to_int(text) == value
    assert socket.inet_aton(text) == value.to_bytes(4, "little")


_u64 = st.integers(0, 2**64 - 1)


@given(_u64, _u64, _u64, _u64, _u64, _u64, _u64, _u64)
def test_cache_key_eq_iff_fields_eq(a, b, c, d, e, f, g, h):
    k1, k2 = CacheKey(a, b, c, d), CacheKey(e, f, g, h)
    assert (k1 == k2) == ((a, b, c, d) == (e, f, g, h))
    if k1 == k2:
        assert hash(k1) == hash(k2)


def test_ip_errors():
    for bad in ("1.2.3", "1.2.3.256", "localhost", "", "::1", "01.2.3.4"):
        with pytest.raises(ValueError) as info:
            ip_to_str(bad)
        assert_param_invalid(info)
    for bad in (-1, 2**32):
        with pytest.raises(ValueError):
            ip_to_str(bad)
    for bad in (1.0, None, b"1.2.3.4", True):
        with pytest.raises(TypeError):
            ip_to_str(bad)


def test_cluster_info():
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None and info.remote_role_type is None
    assert info.local_ip_info_list == [] and info.remote_ip_info_list == []
    info.remote_cluster_id = 7
    info.remote_role_type = LLMRole.PROMPT
    info.append_local_ip_info("10.0.0.2", 0)
    info.append_remote_ip_info(0x0100007F, 26000)  # CANN int form of 127.0.0.1
    info.append_remote_ip_info("192.168.0.9", 26001)
    assert info.remote_cluster_id == 7 and info.remote_role_type is LLMRole.PROMPT
    # stored as llm_datadist stores them: (ip in CANN's little-endian int form, port)
    assert info.local_ip_info_list == [IpInfo(ip_to_int("10.0.0.2"), 0)]
    assert info.remote_ip_info_list == [(0x0100007F, 26000), (ip_to_int("192.168.0.9"), 26001)]
    ip, port = info.remote_ip_info_list[0]
    assert (ip, port) == (0x0100007F, 26000)
    assert info.remote_ip_info_list[0].ip_str == "127.0.0.1" and info.remote_ip_info_list[0].ip_int == ip
    assert "remote_cluster_id=7" in repr(info) and str(0x0100007F) in repr(info)
    assert LLMClusterInfo(3, LLMRole.DECODER).remote_cluster_id == 3


def test_cluster_info_errors():
    info = LLMClusterInfo()
    with pytest.raises(TypeError):
        info.remote_cluster_id = "1"
    with pytest.raises(ValueError):
        info.remote_cluster_id = -1
    with pytest.raises(TypeError):
        info.remote_role_type = "PROMPT"
    with pytest.raises(TypeError):
        info.append_remote_ip_info(1.5, 80)
    with pytest.raises(TypeError):
        info.append_remote_ip_info("1.2.3.4", "80")
    with pytest.raises(ValueError):
        info.append_remote_ip_info("1.2.3.4", 65536)
    with pytest.raises(ValueError):
        info.append_local_ip_info("1.2.3", 80)
    with pytest.raises(ValueError):
        info.append_local_ip_info(2**32, 80)
    assert info.remote_ip_info_list == [] and info.local_ip_info_list == []
