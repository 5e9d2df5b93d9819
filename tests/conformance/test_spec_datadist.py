"""SPEC-datadist sections 1-3, clause by clause, through the public ``datadist`` namespace.

Only what needs no peer and no running engine: names and values of the public API,
exception shape, configuration keys and validation, value objects.  Transfers, links and
engine errors are covered by tests/integration.  Each test's docstring quotes the clause.
"""
from __future__ import annotations

import pickle
from typing import Any, Dict, Optional

import pytest
import torch

import datadist
from datadist import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex,
                      DataType, LayerSynchronizer, LLMClusterInfo, LLMConfig, LLMDataDist, LLMException,
                      LLMRole, LLMStatusCode, MemInfo, Memtype, Placement, RegisterMemStatus, Status,
                      TransferConfig, TransferWithCacheKeyConfig, create_tensors)

pytestmark = pytest.mark.timeout(30)

UINT64_MAX = 2**64 - 1


# ------------------------------------------------------------------ public names


SPEC_NAMES = ["LLMDataDist", "LLMRole", "LLMConfig", "LlmConfig", "CacheDesc", "Cache",
              "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "LLMClusterInfo", "MemInfo",
              "Placement", "DataType", "RegisterMemStatus", "Memtype", "LLMStatusCode",
              "LLMException", "Status", "CacheManager", "create_tensors"]


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_spec_names_are_exported(name: str) -> None:
    """Code written for ``from llm_datadist import ...`` runs with ``from datadist import ...``."""
    assert name in datadist.__all__
    assert getattr(datadist, name) is not None
    namespace: Dict[str, Any] = {}
    exec("from datadist import *", namespace)
    assert name in namespace


# ------------------------------------------------------------------ section 1


def test_enum_values() -> None:
    """LLMRole(IntEnum) PROMPT=1, DECODER=2, MIX=3; Placement(IntEnum) HOST=0, DEVICE=1;
    RegisterMemStatus OK=0, PREPARING=1, FAILED=2; Memtype MEM_TYPE_DEVICE=0, MEM_TYPE_HOST=1."""
    assert {m.name: int(m) for m in LLMRole} == {"PROMPT": 1, "DECODER": 2, "MIX": 3}
    assert {m.name: int(m) for m in Placement} == {"HOST": 0, "DEVICE": 1}
    assert isinstance(LLMRole.MIX, int) and isinstance(Placement.DEVICE, int)
    assert {m.name: m.value for m in RegisterMemStatus} == {"OK": 0, "PREPARING": 1, "FAILED": 2}
    assert {m.name: m.value for m in Memtype} == {"MEM_TYPE_DEVICE": 0, "MEM_TYPE_HOST": 1}


DTYPES = [
    ("DT_FLOAT", torch.float32), ("DT_FLOAT16", torch.float16), ("DT_BF16", torch.bfloat16),
    ("DT_INT8", torch.int8), ("DT_INT16", torch.int16), ("DT_UINT16", getattr(torch, "uint16")),
    ("DT_UINT8", torch.uint8), ("DT_INT32", torch.int32), ("DT_INT64", torch.int64),
    ("DT_UINT32", getattr(torch, "uint32")), ("DT_UINT64", getattr(torch, "uint64")),
    ("DT_BOOL", torch.bool), ("DT_DOUBLE", torch.float64),
]


@pytest.mark.parametrize("name,tdtype", DTYPES, ids=[d[0] for d in DTYPES])
def test_data_type_maps_to_torch_and_sizes(name: str, tdtype: torch.dtype) -> None:
    """DataType has the 13 members, a mapping to and from torch dtypes, and the element size."""
    dt = DataType[name]
    assert dt.to_torch() == tdtype
    assert DataType.from_torch(tdtype) is dt
    assert dt.element_size == torch.empty((), dtype=tdtype).element_size()
    assert CacheDesc(1, [3, 5], dt).size == 15 * dt.element_size
    assert len(DataType) == len(DTYPES) + 1  # and DT_STRING


def test_data_type_dt_string_is_refused_by_cache_desc() -> None:
    """DataType.DT_STRING = 13, as in CANN; it has no element size, so CacheDesc refuses it
    with LLM_PARAM_INVALID naming the dtype."""
    assert DataType.DT_STRING.value == 13
    with pytest.raises(LLMException, match="DT_STRING") as info:
        CacheDesc(2, [4, 8], DataType.DT_STRING)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_status_code_table() -> None:
    """LLM_SUCCESS=0, LLM_FAILED=0xFFFFFFFF, LLM_UNKNOWN_ERROR=-1, and 0x5010B000 + n."""
    table = {1: "LLM_WAIT_PROCESS_TIMEOUT", 2: "LLM_KV_CACHE_NOT_EXIST", 3: "LLM_REPEAT_REQUEST",
             4: "LLM_REQUEST_ALREADY_COMPLETED", 5: "LLM_PARAM_INVALID",
             6: "LLM_ENGINE_FINALIZED", 7: "LLM_NOT_YET_LINK", 8: "LLM_ALREADY_LINK",
             9: "LLM_LINK_FAILED", 10: "LLM_UNLINK_FAILED", 11: "LLM_NOTIFY_PROMPT_UNLINK_FAILED",
             12: "LLM_CLUSTER_NUM_EXCEED_LIMIT", 13: "LLM_PROCESSING_LINK",
             14: "LLM_DEVICE_OUT_OF_MEMORY", 15: "LLM_PREFIX_ALREADY_EXIST",
             16: "LLM_PREFIX_NOT_EXIST", 17: "LLM_SEQ_LENOVERLIMIT", 18: "LLM_NO_FREE_BLOCK",
             19: "LLM_BLOCKS_OUT_OF_MEMORY", 24: "LLM_EXIST_LINK", 25: "LLM_FEATURE_NOT_ENABLED",
             26: "LLM_TIMEOUT", 27: "LLM_LINK_BUSY", 28: "LLM_OUT_OF_MEMORY"}
    expected = {name: 0x5010B000 + n for n, name in table.items()}
    expected.update(LLM_SUCCESS=0, LLM_FAILED=0xFFFFFFFF, LLM_UNKNOWN_ERROR=-1,
                    LLM_DEVICE_MEM_ERROR=507053, LLM_SUSPECT_REMOTE_ERROR=507057)
    assert {m.name: int(m) for m in LLMStatusCode} == expected


def test_enum_str_is_class_dot_member() -> None:
    """str() and f-strings of LLMStatusCode, LLMRole and Placement members read
    "ClassName.MEMBER", as CANN's do; repr and int value are the enum's."""
    assert str(LLMStatusCode.LLM_TIMEOUT) == "LLMStatusCode.LLM_TIMEOUT"
    assert f"{LLMStatusCode.LLM_SUCCESS}" == "LLMStatusCode.LLM_SUCCESS"
    assert str(LLMRole.PROMPT) == "LLMRole.PROMPT" and f"{LLMRole.MIX}" == "LLMRole.MIX"
    assert str(Placement.DEVICE) == "Placement.DEVICE" and f"{Placement.HOST}" == "Placement.HOST"
    assert repr(LLMRole.DECODER) == "<LLMRole.DECODER: 2>" and LLMRole.DECODER == 2
    assert "%d" % LLMStatusCode.LLM_PARAM_INVALID == str(0x5010B005)


def test_llm_exception_default_code_is_success() -> None:
    """LLMException made without status_code reports LLM_SUCCESS, as CANN's does."""
    assert LLMException("x").status_code is LLMStatusCode.LLM_SUCCESS


def test_llm_exception_shape() -> None:
    """LLMException(RuntimeError): LLMException(*args, status_code=...), property status_code."""
    exc = LLMException("what", 42, status_code=LLMStatusCode.LLM_TIMEOUT)
    assert isinstance(exc, RuntimeError)
    assert exc.args == ("what", 42)
    assert exc.status_code == LLMStatusCode.LLM_TIMEOUT
    assert isinstance(exc.status_code, LLMStatusCode)
    assert LLMException(status_code=int(LLMStatusCode.LLM_LINK_BUSY)).status_code \
        is LLMStatusCode.LLM_LINK_BUSY
    with pytest.raises(AttributeError):
        exc.status_code = LLMStatusCode.LLM_FAILED  # type: ignore[misc]
    back = pickle.loads(pickle.dumps(exc))
    assert back.status_code == LLMStatusCode.LLM_TIMEOUT and back.args == exc.args


def test_status_object() -> None:
    """Status: is_ok(), status_code."""
    assert Status(LLMStatusCode.LLM_SUCCESS).is_ok()
    bad = Status(LLMStatusCode.LLM_NOT_YET_LINK)
    assert not bad.is_ok() and bad.status_code == LLMStatusCode.LLM_NOT_YET_LINK


@pytest.mark.parametrize("make", [
    lambda: CacheKey("1", 2),
    lambda: CacheKeyByIdAndIndex(1, 2, batch_index=1.0),
    lambda: BlocksCacheKey(1, model_id="0"),
    lambda: CacheDesc("2", [4, 4], DataType.DT_FLOAT16),
    lambda: CacheDesc(2, [4, 4], "fp16"),
    lambda: CacheDesc(2, [4, 4], DataType.DT_FLOAT16, placement="HOST"),
    lambda: MemInfo(1, 0x1000, 16),
    lambda: LLMDataDist(LLMRole.PROMPT, "7"),
], ids=["CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "CacheDesc.num_tensors",
        "CacheDesc.data_type", "CacheDesc.placement", "MemInfo.mem_type", "LLMDataDist"])
def test_argument_type_errors_are_type_errors(make: Any) -> None:
    """Argument *type* errors are TypeError, as in llm_datadist."""
    with pytest.raises(TypeError):
        make()


@pytest.mark.parametrize("make", [
    lambda: CacheKey(-1, 2),
    lambda: CacheKey(1, 2**64),
    lambda: CacheKeyByIdAndIndex(1, 2, batch_index=-1),
    lambda: BlocksCacheKey(1, model_id=-3),
    lambda: MemInfo(Memtype.MEM_TYPE_HOST, -1, 16),
    lambda: LLMDataDist(LLMRole.PROMPT, -7),
    lambda: LLMDataDist(9, 1),
], ids=["CacheKey.cluster", "CacheKey.req_id", "batch_index", "model_id", "MemInfo.addr",
        "cluster_id", "role"])
def test_out_of_domain_scalars_are_value_errors(make: Any) -> None:
    """Out-of-domain scalars in constructors: ValueError."""
    with pytest.raises(ValueError):
        make()


# ------------------------------------------------------------------ section 2


CONFIG_KEYS = [
    ("device_id", 3, "ge.exec.deviceId"),
    ("sync_kv_timeout", 2500, "llm.SyncKvCacheWaitTime"),
    ("listen_ip_info", "127.0.0.1:26000", "llm.listenIpInfo"),
    ("enable_cache_manager", True, "llm.EnableCacheManager"),
    ("enable_remote_cache_accessible", True, "llm.EnableRemoteCacheAccessible"),
    ("mem_pool_cfg", '{"memory_size": 1048576, "page_shift": 16}', "llm.MemPoolConfig"),
    ("host_mem_pool_cfg", '{"memory_size": 1048576, "page_shift": 16}', "llm.HostMemPoolConfig"),
    ("link_total_time", 5, "llm.LinkTotalTime"),
    ("link_retry_count", 2, "llm.LinkRetryCount"),
    ("transfer_backend", "tcp", "llm.TransferBackend"),
    ("device_type", "cpu", "llm.DeviceType"),
]


@pytest.mark.parametrize("prop,value,key", CONFIG_KEYS, ids=[c[0] for c in CONFIG_KEYS])
def test_config_property_sets_option_key(prop: str, value: Any, key: str) -> None:
    """Each LLMConfig property lands under its option key, as a str; aliases LlmConfig and
    gen_options give the same dict."""
    cfg = LLMConfig()
    setattr(cfg, prop, value)
    options = cfg.generate_options()
    assert key in options, options
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in options.items())
    alias = datadist.LlmConfig()
    setattr(alias, prop, value)
    assert alias.gen_options() == options


@pytest.mark.parametrize("backend", ["auto", "shm", "tcp", "gloo", "nccl", "hccl"])
def test_transfer_backends_accepted(backend: str) -> None:
    """transfer_backend: auto (default), shm, tcp, gloo, nccl, hccl."""
    cfg = LLMConfig()
    cfg.transfer_backend = backend
    assert cfg.generate_options()["llm.TransferBackend"] == backend


BAD_CONFIG = [
    ("sync_kv_timeout", 0), ("sync_kv_timeout", -5), ("transfer_backend", "carrier-pigeon"),
    ("device_type", "tpu"), ("listen_ip_info", "localhost-no-port"),
    ("listen_ip_info", "127.0.0.1:70000"), ("mem_pool_cfg", '{"memory_size": 0}'),
    ("host_mem_pool_cfg", "not json"), ("link_retry_count", 0),
]


@pytest.mark.parametrize("prop,value", BAD_CONFIG, ids=[f"{p}={v}" for p, v in BAD_CONFIG])
def test_bad_config_values_raise_before_the_engine_runs(prop: str, value: Any) -> None:
    """Bad values raise at generate_options() or init(), never later."""
    cfg = LLMConfig()
    try:
        setattr(cfg, prop, value)
        options = cfg.generate_options()
    except (LLMException, ValueError, TypeError):
        return
    engine = LLMDataDist(LLMRole.DECODER, 5)
    try:
        with pytest.raises((LLMException, ValueError)):
            engine.init(options)
    finally:
        engine.finalize()


@pytest.mark.parametrize("key,value", [
    ("llm.SyncKvCacheWaitTime", "0"), ("llm.TransferBackend", "smoke-signals"),
    ("llm.MemPoolConfig", '{"page_shift": 16}'), ("llm.listenIpInfo", "1.2.3:4"),
])
def test_bad_hand_written_options_raise_at_init(key: str, value: str) -> None:
    """init(options) parses the dict in one place: a hand-written bad value raises there."""
    engine = LLMDataDist(LLMRole.PROMPT, 6)
    try:
        with pytest.raises(LLMException) as info:
            engine.init({key: value})
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert key in str(info.value), "the message names the option"
    finally:
        engine.finalize()


# ------------------------------------------------------------------ section 3


def test_cache_desc_properties() -> None:
    """CacheDesc(num_tensors, shape, data_type, placement=DEVICE, batch_dim_index=0,
    seq_len_dim_index=-1, kv_tensor_format=None); batch_size = shape[batch_dim_index];
    size = bytes of ONE tensor."""
    d = CacheDesc(6, [4, 16, 8], DataType.DT_BF16)
    assert (d.num_tensors, d.shape, d.data_type) == (6, [4, 16, 8], DataType.DT_BF16)
    assert (d.placement, d.batch_dim_index, d.seq_len_dim_index, d.kv_tensor_format) == \
        (Placement.DEVICE, 0, -1, None)
    assert d.batch_size == 4 and d.size == 4 * 16 * 8 * 2
    e = CacheDesc(2, [16, 3, 8], DataType.DT_INT8, Placement.HOST, batch_dim_index=1,
                  seq_len_dim_index=0, kv_tensor_format="BSND")
    assert e.batch_size == 3 and e.size == 16 * 3 * 8 and e.placement == Placement.HOST
    assert (e.seq_len_dim_index, e.kv_tensor_format) == (0, "BSND")


def test_cache_desc_update_dim() -> None:
    """CacheDesc.update_dim(dim_index, dim_value), as in CANN: the shape and size follow."""
    d = CacheDesc(2, [4, 16, 8], DataType.DT_FLOAT16, Placement.DEVICE, 0, 1)
    d.update_dim(1, 32)
    assert d.shape == [4, 32, 8] and d.size == 4 * 32 * 8 * 2


def test_key_arity_is_param_invalid() -> None:
    """CacheKey(1) and BlocksCacheKey(1, 2, 3) raise LLMException(LLM_PARAM_INVALID), as CANN's."""
    for make in (lambda: CacheKey(1), lambda: BlocksCacheKey(1, 2, 3)):  # type: ignore[call-arg]
        with pytest.raises(LLMException) as info:
            make()
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.parametrize("args", [
    (0, [4, 4]), (-1, [4, 4]), (2, []), (2, [4, 0]), (2, [0]), (2, [4, -2]),
], ids=["no_tensors", "negative_tensors", "empty_shape", "zero_dim", "only_zero", "neg_dim"])
def test_cache_desc_rejects_empty(args: tuple) -> None:
    """num_tensors < 1, an empty or zero dimension: ValueError/LLMException(LLM_PARAM_INVALID)."""
    with pytest.raises((ValueError, LLMException)) as info:
        CacheDesc(*args, DataType.DT_FLOAT16)
    if isinstance(info.value, LLMException):
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_key_defaults() -> None:
    """CacheKey(prompt_cluster_id, req_id, model_id=0, prefix_id=2**64-1), req_id=2**64-1
    allowed (empty row); CacheKeyByIdAndIndex(cluster_id, cache_id, batch_index=0);
    BlocksCacheKey(prompt_cluster_id, model_id=0)."""
    k = CacheKey(3, 9)
    assert (k.prompt_cluster_id, k.req_id, k.model_id, k.prefix_id) == (3, 9, 0, UINT64_MAX)
    assert CacheKey(3, UINT64_MAX).req_id == UINT64_MAX
    i = CacheKeyByIdAndIndex(3, 12)
    assert (i.cluster_id, i.cache_id, i.batch_index) == (3, 12, 0)
    b = BlocksCacheKey(3)
    assert (b.prompt_cluster_id, b.model_id) == (3, 0)


VALUES = [
    (lambda: CacheKey(1, 2, 3), lambda: CacheKey(1, 2, 4)),
    (lambda: CacheKeyByIdAndIndex(1, 2, 3), lambda: CacheKeyByIdAndIndex(1, 2, 0)),
    (lambda: BlocksCacheKey(1, 2), lambda: BlocksCacheKey(2, 2)),
    (lambda: CacheDesc(2, [4, 8], DataType.DT_FLOAT16),
     lambda: CacheDesc(2, [4, 8], DataType.DT_FLOAT16, Placement.HOST)),
    (lambda: MemInfo(Memtype.MEM_TYPE_HOST, 4096, 64),
     lambda: MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 64)),
]


@pytest.mark.parametrize("make,other", VALUES,
                         ids=["CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "CacheDesc",
                              "MemInfo"])
def test_value_objects(make: Any, other: Any) -> None:
    """Keys and descs are value objects: equality, hash, readable repr."""
    a, b, c = make(), make(), other()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != c and len({a, c}) == 2
    text = repr(a)
    assert type(a).__name__ in text and "object at 0x" not in text
    assert repr(c) != text


def test_different_key_kinds_differ() -> None:
    """A CacheKey never equals a BlocksCacheKey with the same numbers."""
    assert CacheKey(1, 0) != BlocksCacheKey(1, 0)
    assert len({CacheKey(1, 0), BlocksCacheKey(1, 0), CacheKeyByIdAndIndex(1, 0, 0)}) == 3


def test_cluster_info_ip_forms() -> None:
    """LLMClusterInfo: remote_cluster_id, remote_role_type, append_local_ip_info(ip, port),
    append_remote_ip_info(ip, port) with ip as str or int, and both lists."""
    ci = LLMClusterInfo()
    ci.remote_cluster_id = 11
    ci.remote_role_type = LLMRole.PROMPT
    ci.append_local_ip_info("10.0.0.2", 0)
    as_int = int.from_bytes(bytes([10, 0, 0, 3]), "little")
    ci.append_remote_ip_info(as_int, 26000)
    assert ci.remote_cluster_id == 11 and ci.remote_role_type == LLMRole.PROMPT
    assert len(ci.local_ip_info_list) == 1 and len(ci.remote_ip_info_list) == 1
    ip, port = ci.remote_ip_info_list[0]
    assert (ip, port) == (as_int, 26000)  # CANN's int form, as llm_datadist stores it
    assert ci.local_ip_info_list == [(int.from_bytes(bytes([10, 0, 0, 2]), "little"), 0)]


def test_cache_is_not_made_by_users() -> None:
    """Cache: made by the manager, never by users."""
    with pytest.raises(TypeError):
        Cache()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Cache(1, CacheDesc(1, [1], DataType.DT_INT8), [4096])  # type: ignore[call-arg]


def test_create_cpu_cache_wraps_host_memory() -> None:
    """Cache.create_cpu_cache(cache_desc, addrs) wraps host memory for swap_blocks."""
    tensors = [torch.zeros(4, 8, dtype=torch.float16) for _ in range(2)]
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT16, Placement.HOST)
    cache = Cache.create_cpu_cache(desc, [t.data_ptr() for t in tensors])
    assert cache.cache_desc == desc
    assert cache.tensor_addrs == [t.data_ptr() for t in tensors]
    assert cache.is_blocks_cache
    assert isinstance(cache.cache_id, int)


def test_create_tensors_views_raw_addresses() -> None:
    """create_tensors(shape, dtype, addrs, device) builds tensors over raw addresses."""
    owners = [torch.arange(12, dtype=torch.int32) for _ in range(2)]
    views = create_tensors([3, 4], torch.int32, [o.data_ptr() for o in owners], "cpu")
    assert [v.shape for v in views] == [torch.Size([3, 4])] * 2
    assert [v.data_ptr() for v in views] == [o.data_ptr() for o in owners]
    views[1][2, 3] = -7
    assert int(owners[1][11]) == -7
    by_dt = create_tensors([12], DataType.DT_INT32, [owners[0].data_ptr()], "cpu")
    assert torch.equal(by_dt[0], owners[0])


def test_engine_properties_before_init() -> None:
    """LLMDataDist(role, cluster_id): .cluster_id and .role exist before init; a call before
    init, and .cache_manager (as in CANN), raise LLMException, a RuntimeError."""
    engine = LLMDataDist(LLMRole.MIX, 77)
    assert engine.cluster_id == 77 and engine.role == LLMRole.MIX
    for touch in (lambda: engine.cache_manager, lambda: engine.link_clusters([LLMClusterInfo()]),
                  lambda: engine.check_link_status(1), lambda: engine.kv_cache_manager):
        with pytest.raises(LLMException) as info:
            touch()
        assert isinstance(info.value, RuntimeError) and info.value.status_code == LLMStatusCode.LLM_FAILED
    engine.finalize()
    engine.finalize()


def test_cache_manager_mode_only() -> None:
    """As CANN in CacheManager mode (this library's only mode): check_link_status and
    kv_cache_manager raise LLM_PARAM_INVALID naming llm.EnableCacheManager; the class
    attribute llm_engine_instance is the initialized engine, None otherwise; cache_manager
    raises again after finalize."""
    assert LLMDataDist.llm_engine_instance is None
    engine = LLMDataDist(LLMRole.PROMPT, 78)
    engine.init(LLMConfig().generate_options())
    try:
        assert LLMDataDist.llm_engine_instance is engine
        cm = engine.cache_manager
        assert cm is engine.cache_manager
        for touch in (lambda: engine.check_link_status(1), lambda: engine.kv_cache_manager):
            with pytest.raises(LLMException, match="llm.EnableCacheManager is configured") as info:
                touch()
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    finally:
        engine.finalize()
    assert LLMDataDist.llm_engine_instance is None
    with pytest.raises(LLMException) as after:
        engine.cache_manager
    assert after.value.status_code == LLMStatusCode.LLM_ENGINE_FINALIZED



# ------------------------------------------------------------------ transfer configs


def test_transfer_config_setters() -> None:
    """TransferConfig: every field has a checking setter, as CANN's; dst_layer_range is an
    attribute (None until set); equality is identity (the config is mutable)."""
    c = TransferConfig(1, [0x1000, 0x2000])
    assert c.dst_layer_range is None
    c.dst_cluster_id = 2
    c.dst_addrs = [0x3000, 0x4000]
    c.src_layer_range = range(0, 1)
    c.src_batch_index = 3
    c.dst_layer_range = range(0, 1)
    assert (c.dst_cluster_id, c.dst_addrs, c.src_layer_range, c.src_batch_index, c.dst_layer_range) == \
        (2, [0x3000, 0x4000], range(0, 1), 3, range(0, 1))
    assert repr(c) == ("TransferConfig(dst_cluster_id=2, dst_addrs=[12288, 16384], src_layer_range=range(0, 1), "
                       "src_batch_index=3)")
    for field, bad in (("dst_cluster_id", -1), ("dst_addrs", []), ("src_layer_range", range(2, 1)),
                       ("src_batch_index", 2**32), ("dst_layer_range", range(0, 4, 2))):
        with pytest.raises(LLMException) as info:
            setattr(c, field, bad)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, field
    with pytest.raises(TypeError):
        c.dst_addrs = 0x1000  # type: ignore[assignment]
    assert c.dst_addrs == [0x3000, 0x4000] and c.src_batch_index == 3
    assert c != TransferConfig(2, [0x3000, 0x4000], range(0, 1), 3) and c == c


def test_transfer_with_cache_key_config_setters() -> None:
    """TransferWithCacheKeyConfig: setters for cache_key, src/dst_layer_range (None allowed,
    as CANN) and src_batch_index; dst_cluster_id is the key's cluster; a row with a
    BlocksCacheKey is refused."""
    c = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(7, 1), range(0, 1), range(0, 1), 2)
    assert c.dst_cluster_id == 7
    c.src_layer_range = range(1, 2)
    c.dst_layer_range = range(1, 2)
    c.src_batch_index = 0
    c.cache_key = BlocksCacheKey(8)
    assert (c.cache_key, c.src_layer_range, c.dst_layer_range, c.dst_cluster_id) == \
        (BlocksCacheKey(8), range(1, 2), range(1, 2), 8)
    c.src_layer_range = None
    c.dst_layer_range = None
    with pytest.raises(LLMException) as info:
        c.src_batch_index = 1  # a row with a BlocksCacheKey
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        c.cache_key = CacheKey(1, 2)  # type: ignore[assignment]
    row = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(7, 1), range(0, 1), range(0, 1), 2)
    with pytest.raises(LLMException):
        row.cache_key = BlocksCacheKey(7)  # its row 2 would go with a BlocksCacheKey
    assert row.cache_key == CacheKeyByIdAndIndex(7, 1)


def test_unequal_push_ranges_set_later_are_refused_when_the_task_starts() -> None:
    """Ranges changed one by one may differ meanwhile; transfer_cache_async refuses configs
    whose ranges differ (LLM_PARAM_INVALID) before it looks for the link."""

    class Ready(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
            return True

    engine = LLMDataDist(LLMRole.PROMPT, 79)
    engine.init(LLMConfig().generate_options())
    try:
        desc = CacheDesc(4, [2, 8], DataType.DT_FLOAT)
        cache = engine.cache_manager.register_blocks_cache(desc, [torch.zeros(16) for _ in range(4)])
        config = TransferWithCacheKeyConfig(BlocksCacheKey(5), range(0, 1), range(0, 1))
        config.dst_layer_range = range(1, 2)
        with pytest.raises(LLMException, match="same layer range") as info:
            engine.cache_manager.transfer_cache_async(cache, Ready(), [config])
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        config.src_layer_range = range(1, 2)
        with pytest.raises(LLMException) as unlinked:
            engine.cache_manager.transfer_cache_async(cache, Ready(), [config])
        assert unlinked.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        engine.cache_manager.unregister_cache(cache.cache_id)
    finally:
        engine.finalize()


def test_allocation_and_deallocation_as_cann() -> None:
    """Without a pool for the placement, allocation is LLM_PARAM_INVALID ("you should config
    memory pool firstly"); deallocate_cache refuses a blocks cache and deallocate_blocks_cache
    a contiguous one (LLM_PARAM_INVALID); a freed cache's tensor_addrs is []."""
    cfg = LLMConfig()
    cfg.mem_pool_cfg = '{"memory_size": 1048576}'
    engine = LLMDataDist(LLMRole.PROMPT, 80)
    engine.init(cfg.generate_options())
    try:
        cm = engine.cache_manager
        with pytest.raises(LLMException, match="config memory pool firstly") as info:
            cm.allocate_cache(CacheDesc(2, [2, 8], DataType.DT_FLOAT, Placement.HOST))
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        rows = cm.allocate_cache(CacheDesc(2, [2, 8], DataType.DT_FLOAT))
        blocks = cm.allocate_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT))
        for wrong in (lambda: cm.deallocate_cache(blocks), lambda: cm.deallocate_blocks_cache(rows)):
            with pytest.raises(LLMException) as kind:
                wrong()
            assert kind.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert len(rows.tensor_addrs) == 2 and len(blocks.tensor_addrs) == 2
        cm.deallocate_cache(rows)
        cm.deallocate_blocks_cache(blocks)
        assert rows.tensor_addrs == [] and blocks.tensor_addrs == []
        cm.deallocate_cache(rows)  # again: a no-op
    finally:
        engine.finalize()


# ------------------------------------------------------------------ generate_options as CANN


def test_generate_options_as_cann() -> None:
    """LLMConfig.generate_options emits what CANN's does: llm.MemoryUtilization always
    ("0.95" while unset), a device id list joined with ";" and ge.session_device_id its
    first id; transfer_backend reads "" while unset ("" means auto)."""
    cfg = LLMConfig()
    assert cfg.transfer_backend == "" and cfg.mem_utilization == 0.95
    cfg.device_id = 0
    cfg.sync_kv_timeout = 5000
    cfg.listen_ip_info = "127.0.0.1:26000"
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = '{"memory_size": 1048576}'
    assert cfg.generate_options() == {
        "ge.exec.deviceId": "0", "ge.session_device_id": "0", "llm.EnableCacheManager": "1",
        "llm.MemPoolConfig": '{"memory_size": 1048576}', "llm.MemoryUtilization": "0.95",
        "llm.SyncKvCacheWaitTime": "5000", "llm.listenIpInfo": "127.0.0.1:26000"}
    multi = LLMConfig()
    multi.device_id = [0, 1]
    assert multi.generate_options() == {"ge.exec.deviceId": "0;1", "ge.session_device_id": "0",
                                        "llm.MemoryUtilization": "0.95"}
    other = LLMConfig()
    other.mem_utilization = 0.9
    other.transfer_backend = "hixl"
    assert other.generate_options() == {"llm.MemoryUtilization": "0.9", "llm.TransferBackend": "hixl"}


def test_init_refuses_several_devices() -> None:
    """An engine runs on one device: init with ge.exec.deviceId naming two refuses it
    (LLM_FEATURE_NOT_ENABLED, naming the ids) and leaves the engine uninitialized."""
    cfg = LLMConfig()
    cfg.device_id = [0, 1]
    engine = LLMDataDist(LLMRole.DECODER, 81)
    with pytest.raises(LLMException, match=r"\[0, 1\]") as info:
        engine.init(cfg.generate_options())
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert LLMDataDist.llm_engine_instance is None
    engine.finalize()
