"""Unit tests: status codes and exceptions, enums and dtype mappings, LLMConfig and
parse_options (SPEC-datadist sections 1 and 2)."""
import dataclasses
import json
import logging
import re
import pickle

import numpy as np
import pytest
import torch

from datadist._config import (
    DEFAULT_LINK_TOTAL_TIME_S,
    DEVICE_TYPES,
    TRANSFER_BACKENDS,
    EngineOptions,
    LlmConfig,
    LLMConfig,
    PoolConfig,
    parse_listen_ip_info,
    parse_options,
)
from datadist._status import (
    LLMException,
    LLMStatusCode,
    ParamInvalidError,
    Status,
    raise_error,
    status_of,
    to_status_code,
)
from datadist._types import DataType, LLMRole, Memtype, Placement, RegisterMemStatus

C = LLMStatusCode


# ------------------------------------------------------------------ status codes

SPEC_CODES = {
    "LLM_WAIT_PROCESS_TIMEOUT": 1, "LLM_KV_CACHE_NOT_EXIST": 2, "LLM_REPEAT_REQUEST": 3,
    "LLM_REQUEST_ALREADY_COMPLETED": 4, "LLM_PARAM_INVALID": 5, "LLM_ENGINE_FINALIZED": 6,
    "LLM_NOT_YET_LINK": 7, "LLM_ALREADY_LINK": 8, "LLM_LINK_FAILED": 9, "LLM_UNLINK_FAILED": 10,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 11, "LLM_CLUSTER_NUM_EXCEED_LIMIT": 12,
    "LLM_PROCESSING_LINK": 13, "LLM_DEVICE_OUT_OF_MEMORY": 14, "LLM_PREFIX_ALREADY_EXIST": 15,
    "LLM_PREFIX_NOT_EXIST": 16, "LLM_SEQ_LENOVERLIMIT": 17, "LLM_NO_FREE_BLOCK": 18,
    "LLM_BLOCKS_OUT_OF_MEMORY": 19, "LLM_EXIST_LINK": 24, "LLM_FEATURE_NOT_ENABLED": 25,
    "LLM_TIMEOUT": 26, "LLM_LINK_BUSY": 27, "LLM_OUT_OF_MEMORY": 28,
}


def test_status_code_values_match_spec():
    assert C.LLM_SUCCESS == 0
    assert C.LLM_FAILED == 0xFFFFFFFF
    assert C.LLM_UNKNOWN_ERROR == -1
    for name, n in SPEC_CODES.items():
        assert C[name] == 0x5010B000 + n, name
    # ACL runtime codes CANN's LLMStatusCode passes through
    assert C.LLM_DEVICE_MEM_ERROR == 507053 and C.LLM_SUSPECT_REMOTE_ERROR == 507057
    assert len(C) == len(SPEC_CODES) + 5


def test_cann_cpp_codes_spot_check():
    # values from CANN's llm_datadist C++ header
    assert C.LLM_PARAM_INVALID == 0x5010B005
    assert C.LLM_EXIST_LINK == 0x5010B018
    assert C.LLM_OUT_OF_MEMORY == 0x5010B01C


def test_to_status_code():
    assert to_status_code(0x5010B01A) is C.LLM_TIMEOUT
    assert to_status_code(C.LLM_TIMEOUT) is C.LLM_TIMEOUT
    assert to_status_code(12345) is C.LLM_FAILED
    with pytest.raises(TypeError):
        to_status_code("LLM_TIMEOUT")
    with pytest.raises(TypeError):
        to_status_code(True)


def test_llm_exception_default_and_custom_code():
    exc = LLMException("boom")
    assert isinstance(exc, RuntimeError)
    assert exc.status_code is C.LLM_SUCCESS  # CANN's default
    assert str(exc) == "boom"
    exc = LLMException("a", "b", status_code=C.LLM_TIMEOUT)
    assert exc.args == ("a", "b") and exc.status_code is C.LLM_TIMEOUT
    assert LLMException(status_code=0x5010B002).status_code is C.LLM_KV_CACHE_NOT_EXIST


def test_param_invalid_error_is_both():
    exc = ParamInvalidError("bad")
    assert isinstance(exc, LLMException) and isinstance(exc, ValueError) and isinstance(exc, RuntimeError)
    assert exc.status_code is C.LLM_PARAM_INVALID


@pytest.mark.parametrize("exc", [
    LLMException("x", status_code=C.LLM_LINK_BUSY),
    ParamInvalidError("y", 3),
])
def test_exceptions_pickle_with_code(exc):
    exc.add_note("note")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert back.args == exc.args and back.status_code == exc.status_code
    assert back.__notes__ == ["note"]


def test_status():
    ok = Status()
    assert ok.is_ok() and ok.status_code is C.LLM_SUCCESS
    bad = Status(C.LLM_TIMEOUT)
    assert not bad.is_ok() and bad.status_code is C.LLM_TIMEOUT
    assert Status(0) == ok and bad != ok and hash(Status(C.LLM_TIMEOUT)) == hash(bad)
    assert repr(bad) == "Status(LLM_TIMEOUT)"


def test_raise_error():
    with pytest.raises(ParamInvalidError, match="bad value 3"):
        raise_error(C.LLM_PARAM_INVALID, "bad value 3")
    with pytest.raises(LLMException) as info:
        raise_error(C.LLM_NOT_YET_LINK, "no link to cluster 7")
    assert info.value.status_code is C.LLM_NOT_YET_LINK
    assert not isinstance(info.value, ValueError)


def test_status_of():
    assert status_of(LLMException(status_code=C.LLM_LINK_FAILED)) is C.LLM_LINK_FAILED
    assert status_of(TimeoutError()) is C.LLM_TIMEOUT
    assert status_of(MemoryError()) is C.LLM_OUT_OF_MEMORY
    assert status_of(ValueError()) is C.LLM_PARAM_INVALID
    assert status_of(OSError()) is C.LLM_FAILED


# ------------------------------------------------------------------------- enums

def test_enum_values():
    assert (LLMRole.PROMPT, LLMRole.DECODER, LLMRole.MIX) == (1, 2, 3)
    assert (Placement.HOST, Placement.DEVICE) == (0, 1)
    assert [m.value for m in RegisterMemStatus] == [0, 1, 2]
    assert [m.name for m in RegisterMemStatus] == ["OK", "PREPARING", "FAILED"]
    assert Memtype.MEM_TYPE_DEVICE.value == 0 and Memtype.MEM_TYPE_HOST.value == 1


def test_datatype_members_and_ge_values():
    assert {m.name for m in DataType} == {
        "DT_FLOAT", "DT_FLOAT16", "DT_BF16", "DT_INT8", "DT_INT16", "DT_UINT16", "DT_UINT8",
        "DT_INT32", "DT_INT64", "DT_UINT32", "DT_UINT64", "DT_BOOL", "DT_DOUBLE", "DT_STRING"}
    # ge::DataType numbers, as llm_datadist uses them
    assert DataType.DT_FLOAT.value == 0 and DataType.DT_FLOAT16.value == 1
    assert DataType.DT_BF16.value == 27 and DataType.DT_INT32.value == 3
    assert DataType.DT_STRING.value == 13


def test_dt_string_has_no_element_size():
    """DT_STRING exists (as in CANN) but no cache or tensor can be made of it."""
    assert not DataType.DT_STRING.has_element_size and DataType.DT_FLOAT.has_element_size
    for call in (lambda: DataType.DT_STRING.element_size, DataType.DT_STRING.to_torch):
        with pytest.raises(ParamInvalidError, match="DT_STRING"):
            call()


EXPECTED = [
    (DataType.DT_FLOAT, torch.float32, 4), (DataType.DT_FLOAT16, torch.float16, 2),
    (DataType.DT_BF16, torch.bfloat16, 2), (DataType.DT_INT8, torch.int8, 1),
    (DataType.DT_INT16, torch.int16, 2), (DataType.DT_UINT16, torch.uint16, 2),
    (DataType.DT_UINT8, torch.uint8, 1), (DataType.DT_INT32, torch.int32, 4),
    (DataType.DT_INT64, torch.int64, 8), (DataType.DT_UINT32, torch.uint32, 4),
    (DataType.DT_UINT64, torch.uint64, 8), (DataType.DT_BOOL, torch.bool, 1),
    (DataType.DT_DOUBLE, torch.float64, 8),
]


@pytest.mark.parametrize("dt,tdt,size", EXPECTED, ids=lambda x: getattr(x, "name", str(x)))
def test_datatype_torch_mapping(dt, tdt, size):
    assert dt.to_torch() is tdt
    assert DataType.from_torch(tdt) is dt
    assert dt.element_size == size == torch.empty(0, dtype=tdt).element_size()


def test_datatype_aliases_and_errors():
    assert DataType.from_torch(torch.half) is DataType.DT_FLOAT16
    assert DataType.from_torch(torch.float) is DataType.DT_FLOAT
    with pytest.raises(TypeError):
        DataType.from_torch("float16")
    with pytest.raises(ParamInvalidError, match="complex64"):
        DataType.from_torch(torch.complex64)


# ------------------------------------------------------------------------ LLMConfig

def full_config():
    cfg = LLMConfig()
    cfg.device_id = 3
    cfg.sync_kv_timeout = 2500
    cfg.listen_ip_info = "10.0.0.5:26000"
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = False
    cfg.mem_pool_cfg = '{"memory_size": 1073741824, "page_shift": 16}'
    cfg.host_mem_pool_cfg = '{"memory_size": 4096}'
    cfg.link_total_time = 30
    cfg.link_retry_count = 4
    cfg.local_comm_res = '{"version": "1.0"}'
    cfg.rdma_traffic_class = 132
    cfg.rdma_service_level = 4
    cfg.transfer_backend = "gloo"
    cfg.device_type = "cpu"
    return cfg


def test_generate_options_keys():
    assert full_config().generate_options() == {
        "ge.exec.deviceId": "3",
        "ge.session_device_id": "3",  # CANN emits both device keys
        "llm.SyncKvCacheWaitTime": "2500",
        "llm.listenIpInfo": "10.0.0.5:26000",
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "0",
        "llm.MemPoolConfig": '{"memory_size": 1073741824, "page_shift": 16}',
        "llm.HostMemPoolConfig": '{"memory_size": 4096}',
        "llm.LinkTotalTime": "30",
        "llm.LinkRetryCount": "4",
        "llm.LocalCommRes": '{"version": "1.0"}',
        "llm.RdmaTrafficClass": "132",
        "llm.RdmaServiceLevel": "4",
        "llm.TransferBackend": "gloo",
        "llm.DeviceType": "cpu",
        "llm.MemoryUtilization": "0.95",  # CANN emits it always
    }


def test_generate_then_parse_round_trip():
    opts = parse_options(full_config().generate_options())
    assert opts == EngineOptions(
        device_id=3, device_ids=(3,), sync_kv_timeout_ms=2500, listen_ip="10.0.0.5", listen_port=26000,
        mem_pool=PoolConfig(1073741824, 16), host_mem_pool=PoolConfig(4096, 16),
        link_total_time_s=30.0, link_retry_count=4, transfer_backend="gloo", device_type="cpu",
        enable_cache_manager=True, enable_remote_cache_accessible=False,
        local_comm_res='{"version": "1.0"}', rdma_traffic_class=132, rdma_service_level=4)


def test_empty_config_and_aliases():
    cfg = LlmConfig()
    assert LlmConfig is LLMConfig
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.95"} == cfg.gen_options()  # as CANN
    # getters report CANN's defaults for unset values
    assert cfg.device_id is None and cfg.sync_kv_timeout is None
    assert cfg.listen_ip_info == "" and cfg.mem_pool_cfg == "" and cfg.host_mem_pool_cfg == ""
    assert cfg.link_total_time == 0 and cfg.link_retry_count == 1
    assert cfg.enable_cache_manager is False and cfg.local_comm_res == ""
    assert cfg.transfer_backend == "" and cfg.device_type == "auto"  # CANN's "" (auto)
    assert cfg.ge_options == {}


def test_generate_options_returns_fresh_dict():
    cfg = full_config()
    first = cfg.generate_options()
    first["llm.SyncKvCacheWaitTime"] = "1"
    assert cfg.generate_options()["llm.SyncKvCacheWaitTime"] == "2500"


def test_unset_with_none():
    cfg = full_config()
    cfg.sync_kv_timeout = None
    cfg.listen_ip_info = None
    assert "llm.SyncKvCacheWaitTime" not in cfg.generate_options()
    assert "llm.listenIpInfo" not in cfg.generate_options()


def test_device_id_forms():
    cfg = LLMConfig()
    cfg.device_id = [1]
    assert cfg.generate_options()["ge.exec.deviceId"] == "1"
    cfg.device_id = (2,)
    assert parse_options(cfg.generate_options()).device_id == 2
    cfg.device_id = [0, 1]  # CANN's multi-device form: generated, refused by init
    opts = cfg.generate_options()
    assert (opts["ge.exec.deviceId"], opts["ge.session_device_id"]) == ("0;1", "0")
    assert parse_options(opts).device_ids == (0, 1) and parse_options(opts).device_id == 0


def test_transfer_backend_empty_is_auto():
    cfg = LLMConfig()
    cfg.transfer_backend = ""
    opts = cfg.generate_options()
    assert opts["llm.TransferBackend"] == "" and parse_options(opts).transfer_backend == "auto"


def test_sync_kv_timeout_as_str():
    cfg = LLMConfig()
    cfg.sync_kv_timeout = "3000"
    assert parse_options(cfg.generate_options()).sync_kv_timeout_ms == 3000


def test_pool_cfg_from_dict_and_choice_normalized():
    cfg = LLMConfig()
    cfg.mem_pool_cfg = {"memory_size": 65536, "page_shift": 12}
    cfg.transfer_backend = " TCP "
    opts = cfg.generate_options()
    assert json.loads(opts["llm.MemPoolConfig"]) == {"memory_size": 65536, "page_shift": 12}
    assert opts["llm.TransferBackend"] == "tcp"


def test_ge_options_pass_through_and_override():
    cfg = LLMConfig()
    cfg.ge_options = {"ge.session_device_id": "0", "ge.exec.deviceId": "5"}
    assert cfg.generate_options() == {"ge.session_device_id": "0", "ge.exec.deviceId": "5",
                                      "llm.MemoryUtilization": "0.95"}
    cfg.device_id = 1
    assert cfg.generate_options()["ge.exec.deviceId"] == "1"
    assert cfg.generate_options()["ge.session_device_id"] == "1"  # as CANN: the property wins


def test_ge_options_with_bad_known_key_fails_at_generate():
    cfg = LLMConfig()
    cfg.ge_options = {"llm.SyncKvCacheWaitTime": "-5"}
    with pytest.raises(ParamInvalidError, match="SyncKvCacheWaitTime"):
        cfg.generate_options()


SETTER_TYPE_ERRORS = [
    ("device_id", "0"), ("device_id", 1.0), ("device_id", True), ("device_id", [0, "1"]),
    ("sync_kv_timeout", 1.5), ("sync_kv_timeout", [1]),
    ("listen_ip_info", 26000), ("listen_ip_info", ("1.2.3.4", 5)),
    ("enable_cache_manager", 1), ("enable_cache_manager", "1"),
    ("enable_remote_cache_accessible", 0),
    ("mem_pool_cfg", 1024), ("host_mem_pool_cfg", [1024]),
    ("link_total_time", 1.5), ("link_total_time", "10"),
    ("link_retry_count", "3"), ("link_retry_count", False),
    ("local_comm_res", {"a": 1}), ("rdma_traffic_class", "132"), ("rdma_service_level", 4.0),
    ("ge_options", [("a", "b")]), ("ge_options", {"a": 1}), ("ge_options", {1: "a"}),
    ("transfer_backend", 1), ("device_type", b"cpu"),
]


@pytest.mark.parametrize("prop,value", SETTER_TYPE_ERRORS)
def test_setter_type_errors(prop, value):
    cfg = LLMConfig()
    with pytest.raises(TypeError, match=prop.split("[")[0]):
        setattr(cfg, prop, value)


GENERATE_VALUE_ERRORS = [
    ("device_id", -1), ("device_id", 2**31),
    ("sync_kv_timeout", 0), ("sync_kv_timeout", -1), ("sync_kv_timeout", "abc"),
    ("sync_kv_timeout", "10ms"), ("sync_kv_timeout", 2**31),
    ("listen_ip_info", "127.0.0.1"), ("listen_ip_info", "127.0.0.1:"), ("listen_ip_info", ":80"),
    ("listen_ip_info", "localhost:80"), ("listen_ip_info", "1.2.3.4:65536"),
    ("listen_ip_info", "1.2.3.4:-1"), ("listen_ip_info", "256.1.1.1:80"),
    ("mem_pool_cfg", "{not json"), ("mem_pool_cfg", "[1, 2]"), ("mem_pool_cfg", '{"page_shift": 16}'),
    ("mem_pool_cfg", '{"memory_size": 0}'), ("mem_pool_cfg", '{"memory_size": -5}'),
    ("mem_pool_cfg", '{"memory_size": "lots"}'), ("mem_pool_cfg", '{"memory_size": 1024, "page_shift": 9}'),
    ("host_mem_pool_cfg", '{"memory_size": 1024, "page_shift": 31}'),
    ("link_total_time", -1), ("link_total_time", 2**32),
    ("link_retry_count", 0), ("link_retry_count", 101),
    ("local_comm_res", "{broken"),
    ("rdma_traffic_class", 256), ("rdma_traffic_class", 130), ("rdma_traffic_class", -4),
    ("rdma_service_level", 8), ("rdma_service_level", -1),
    ("transfer_backend", "rdma"), ("transfer_backend", "hixl2"), ("device_type", "tpu"),
]


@pytest.mark.parametrize("prop,value", GENERATE_VALUE_ERRORS)
def test_generate_options_value_errors(prop, value):
    cfg = LLMConfig()
    setattr(cfg, prop, value)  # the setter accepts the type
    with pytest.raises(LLMException) as info:
        cfg.generate_options()
    assert info.value.status_code is C.LLM_PARAM_INVALID
    message = str(info.value)
    assert f"LLMConfig.{prop}" in message
    if value != "":
        assert str(value).strip("{[") in message or repr(value) in message


def test_empty_strings_mean_unset_like_cann():
    cfg = LLMConfig()
    cfg.listen_ip_info = ""
    cfg.mem_pool_cfg = ""
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.95"}


# ---------------------------------------------------------------------- parse_options

def test_parse_defaults(monkeypatch):
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT", raising=False)
    opts = parse_options({})
    assert opts == EngineOptions()
    assert opts.device_id == 0 and opts.sync_kv_timeout_ms == 1000
    assert opts.listen_ip is None and opts.listen_port is None and not opts.is_server
    assert opts.mem_pool is None and opts.host_mem_pool is None
    assert opts.link_total_time_s == DEFAULT_LINK_TOTAL_TIME_S == 120.0
    assert opts.link_retry_count == 1
    assert opts.transfer_backend == "auto" and opts.device_type == "auto"
    assert opts.sync_kv_timeout_s == 1.0


def test_link_total_time_default_from_env(monkeypatch):
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "45")
    assert parse_options({}).link_total_time_s == 45.0
    assert parse_options({"llm.LinkTotalTime": "0"}).link_total_time_s == 45.0
    assert parse_options({"llm.LinkTotalTime": "7"}).link_total_time_s == 7.0
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "garbage")
    assert parse_options({}).link_total_time_s == 120.0


def test_parse_accepts_clean_non_str_values():
    opts = parse_options({
        "ge.exec.deviceId": 2,
        "llm.SyncKvCacheWaitTime": 5000,
        "llm.EnableCacheManager": True,
        "llm.EnableRemoteCacheAccessible": 0,
        "llm.MemPoolConfig": {"memory_size": 2**20},
        "llm.HostMemPoolConfig": {"memory_size": "4096", "page_shift": 10},
        "llm.LinkRetryCount": np.int64(3),
        "llm.LinkTotalTime": 10.0,
    })
    assert opts.device_id == 2 and opts.sync_kv_timeout_ms == 5000
    assert opts.enable_cache_manager is True and opts.enable_remote_cache_accessible is False
    assert opts.mem_pool == PoolConfig(2**20, 16) and opts.host_mem_pool == PoolConfig(4096, 10)
    assert opts.link_retry_count == 3 and type(opts.link_retry_count) is int
    assert opts.link_total_time_s == 10.0


@pytest.mark.parametrize("text,expected", [
    ("1", True), ("0", False), ("true", True), ("False", False), (" yes ", True), ("off", False)])
def test_parse_bool_spellings(text, expected):
    assert parse_options({"llm.EnableCacheManager": text}).enable_cache_manager is expected


def test_parse_strips_and_lowercases():
    opts = parse_options({"llm.SyncKvCacheWaitTime": " 200 ", "llm.TransferBackend": "NCCL",
                          "llm.DeviceType": " Cuda"})
    assert (opts.sync_kv_timeout_ms, opts.transfer_backend, opts.device_type) == (200, "nccl", "cuda")


def test_every_backend_and_device_type_parses():
    for backend in TRANSFER_BACKENDS:
        assert parse_options({"llm.TransferBackend": backend}).transfer_backend == backend
    for device_type in DEVICE_TYPES:
        assert parse_options({"llm.DeviceType": device_type}).device_type == device_type


def test_parse_listen_address():
    opts = parse_options({"llm.listenIpInfo": "192.168.1.7:26000"})
    assert opts.is_server and opts.listen_address == ("192.168.1.7", 26000)
    assert parse_options({"llm.listenIpInfo": "0.0.0.0:0"}).listen_port == 0
    assert parse_listen_ip_info(" 127.0.0.1:80 ") == ("127.0.0.1", 80)
    with pytest.raises(ParamInvalidError, match="llm.listenIpInfo"):
        parse_listen_ip_info("127.0.0.1")
    with pytest.raises(ParamInvalidError, match="llm.listenIpInfo"):
        parse_listen_ip_info(26000)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self) -> list:
        return [r.getMessage() for r in self.records if r.levelno == logging.WARNING]


def _config_log(action) -> _Records:
    """Run ``action`` and return what datadist._config logged meanwhile."""
    logger = logging.getLogger("datadist._config")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        action()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return handler


def test_cann_keys_are_known_and_unknown_keys_warn_once():
    # every key CANN's generate_options can emit, and the ones its LLMDataDist adds
    cann = {"ge.session_device_id": "0", "llm.Role": "Prompt", "llm.deployResPath": "/x",
            "llm.ClusterInfo": '{"cluster_id": 1}', "llm.OutputMaxSize": "1024", "llm.EnableSwitchRole": "1",
            "llm.MemoryUtilization": "0.95", "llm.BufPoolCfg": '{"buf_cfg": []}',
            "llm.GlobalResourceConfig": '{"comm_resource_config.listen_port": 26666}',
            "llm.ListenIp": "1", "llm.ListenPort": "2", "ge.flowGraphMemMaxSize": "1024"}
    assert _config_log(lambda: parse_options(cann)).warnings() == []
    assert parse_options(cann) == parse_options({})
    warnings = _config_log(lambda: [parse_options({"llm.SyncKvCacheWaitTme": "5"}) for _ in range(3)]).warnings()
    assert len(warnings) == 1
    assert "llm.SyncKvCacheWaitTme" in warnings[0]
    assert "llm.SyncKvCacheWaitTime" in warnings[0]  # the close match


@pytest.mark.parametrize("key, value", [
    ("llm.MemoryUtilization", "1.5"), ("llm.MemoryUtilization", "most"), ("llm.OutputMaxSize", "big"),
    ("llm.EnableSwitchRole", "maybe"), ("llm.GlobalResourceConfig", "{broken"), ("llm.ClusterInfo", "{"),
])
def test_cann_only_keys_are_still_checked(key, value):
    with pytest.raises(ParamInvalidError, match=re.escape(key)):
        parse_options({key: value})


@pytest.mark.parametrize("value", ["hixl", "adxl", "HIXL", ""])
def test_cann_transfer_backends_mean_auto(value):
    cfg = LLMConfig()
    cfg.transfer_backend = value
    assert parse_options(cfg.generate_options()).transfer_backend == "auto"


def test_cann_fields_are_accepted():
    cfg = LLMConfig()
    cfg.enable_switch_role = True
    cfg.mem_utilization = 0.8
    cfg.output_max_size = 4096
    cfg.deploy_res_path = "/opt/res"
    cfg.buf_pool_cfg = '{"buf_cfg": [{"total_size": 2097152, "blk_size": 256, "max_buf_size": 8192}]}'
    cfg.global_resource_config = '{"comm_resource_config.max_active_channels": 128}'
    cfg.cluster_info = '{"cluster_id": 1}'
    assert _config_log(cfg.generate_options).warnings() == []
    options = cfg.generate_options()
    assert options["llm.EnableSwitchRole"] == "1" and options["llm.MemoryUtilization"] == "0.8"
    assert options["llm.OutputMaxSize"] == "4096" and options["llm.deployResPath"] == "/opt/res"
    assert cfg.options == options
    with pytest.raises(ParamInvalidError, match="mem_utilization"):
        cfg.mem_utilization = 2.0
        cfg.generate_options()


def test_unknown_config_attribute_is_kept_and_warned_once():
    cfg = LLMConfig()

    def misspell():
        cfg.sync_kv_timout = 5
        cfg.sync_kv_timout = 6
    warnings = _config_log(misspell).warnings()
    assert cfg.sync_kv_timout == 6  # kept, like CANN's plain object
    assert len(warnings) == 1 and "sync_kv_timout" in warnings[0] and "sync_kv_timeout" in warnings[0]
    assert "llm.SyncKvCacheWaitTime" not in cfg.generate_options()


BAD_PARSE_VALUES = [
    ("ge.exec.deviceId", "-1"), ("ge.exec.deviceId", "zero"), ("ge.exec.deviceId", True),
    ("ge.exec.deviceId", ";"), ("ge.exec.deviceId", "0;x"), ("ge.exec.deviceId", [0]),
    ("llm.SyncKvCacheWaitTime", "0"), ("llm.SyncKvCacheWaitTime", 1.5), ("llm.SyncKvCacheWaitTime", None),
    ("llm.listenIpInfo", "1.2.3.4:port"), ("llm.listenIpInfo", 1234),
    ("llm.EnableCacheManager", "maybe"), ("llm.EnableCacheManager", 2),
    ("llm.EnableRemoteCacheAccessible", None),
    ("llm.MemPoolConfig", 1024), ("llm.MemPoolConfig", '{"memory_size": 1.5}'),
    ("llm.MemPoolConfig", '{"memory_size": true}'),
    ("llm.HostMemPoolConfig", '"1024"'),
    ("llm.LinkTotalTime", "-3"), ("llm.LinkRetryCount", "1000"),
    ("llm.LocalCommRes", 5), ("llm.RdmaTrafficClass", "abc"), ("llm.RdmaServiceLevel", "9"),
    ("llm.TransferBackend", None), ("llm.DeviceType", "gpu"),
]


@pytest.mark.parametrize("key,value", BAD_PARSE_VALUES)
def test_parse_bad_values_name_key_and_value(key, value):
    with pytest.raises(ParamInvalidError) as info:
        parse_options({key: value})
    assert info.value.status_code is C.LLM_PARAM_INVALID
    message = str(info.value)
    assert repr(key) in message
    assert "LLMConfig." in message


def test_parse_type_errors():
    with pytest.raises(TypeError):
        parse_options([("llm.SyncKvCacheWaitTime", "1")])
    with pytest.raises(TypeError):
        parse_options({1: "2"})


def test_parse_with_base_keeps_other_values():
    base = parse_options({"llm.SyncKvCacheWaitTime": "1234", "ge.exec.deviceId": "1"})
    switched = parse_options({"llm.listenIpInfo": "127.0.0.1:9000"}, base=base)
    assert switched.sync_kv_timeout_ms == 1234 and switched.device_id == 1
    assert switched.listen_address == ("127.0.0.1", 9000)
    assert base.listen_ip is None


def test_engine_options_value_object():
    opts = parse_options({"llm.listenIpInfo": "127.0.0.1:1"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.device_id = 1  # type: ignore[misc]
    assert hash(opts) == hash(parse_options({"llm.listenIpInfo": "127.0.0.1:1"}))
    assert opts.replace(sync_kv_timeout_ms=5).sync_kv_timeout_ms == 5
    with pytest.raises(ParamInvalidError, match="sync_kv_timeout"):
        opts.replace(sync_kv_timeout_ms=0)


@pytest.mark.parametrize("kwargs", [
    {"device_id": -1}, {"sync_kv_timeout_ms": 0}, {"listen_ip": "1.2.3.4"}, {"listen_port": 80},
    {"listen_ip": "1.2.3.400", "listen_port": 1}, {"listen_ip": "1.2.3.4", "listen_port": 70000},
    {"listen_ip": " 1.2.3.4", "listen_port": 1},
    {"link_total_time_s": 0}, {"link_retry_count": 0}, {"transfer_backend": "TCP"},
    {"device_type": "xpu"}, {"rdma_traffic_class": 3}, {"rdma_service_level": 8},
])
def test_engine_options_direct_construction_validates(kwargs):
    with pytest.raises(ParamInvalidError):
        EngineOptions(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"device_id": "0"}, {"device_id": True}, {"sync_kv_timeout_ms": 1.0}, {"mem_pool": {"memory_size": 1}},
    {"enable_cache_manager": 1}, {"local_comm_res": {}}, {"link_total_time_s": "5"},
])
def test_engine_options_direct_construction_type_errors(kwargs):
    with pytest.raises(TypeError):
        EngineOptions(**kwargs)


def test_pool_config():
    pool = PoolConfig(memory_size=1 << 30)
    assert pool.page_shift == 16 and pool.page_size == 65536
    assert PoolConfig(1, 10).page_size == 1024 and PoolConfig(1, 30).page_shift == 30
    for bad in ({"memory_size": 0}, {"memory_size": 1, "page_shift": 9}, {"memory_size": 1, "page_shift": 31}):
        with pytest.raises(ParamInvalidError):
            PoolConfig(**bad)
    with pytest.raises(TypeError):
        PoolConfig(memory_size="1")
    with pytest.raises(TypeError):
        PoolConfig(memory_size=1, page_shift=True)
