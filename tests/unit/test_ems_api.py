"""Validation of the client API's value types and configs: every invalid form raises
EmsException(EMS_INVALID_ARGUMENT) naming the argument."""
from __future__ import annotations

import pytest

from ems import (CcConfig, CcConfig_v1, CcKvOption, CcResult, EmsConfig, EmsException, KvBufferWrapper,
                 PrimaryKey)
from ems.common.exception import EmsErrorCode

KEY = "k" * 32


def _bad(fn, name):
    with pytest.raises(EmsException) as ei:
        fn()
    assert ei.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert name in ei.value.message(), ei.value.message()


@pytest.mark.parametrize("kwargs,name", [
    (dict(rank_id=-1), "rank_id"), (dict(rank_id=True), "rank_id"), (dict(device_id="0"), "device_id"),
    (dict(model_id="a/b"), "model_id"), (dict(model_id=""), "model_id"), (dict(model_id="a b"), "model_id"),
    (dict(model_id="a" * 513), "model_id"),
    (dict(tp_world_size=0), "tp_world_size"), (dict(pp_world_size=1.0), "pp_world_size"),
])
def test_cc_config_fields(kwargs, name):
    base = dict(rank_id=0, device_id=0, model_id="llama2-13b")
    _bad(lambda: CcConfig(**{**base, **kwargs}), name)
    _bad(lambda: CcConfig_v1(**{**base, **kwargs}), name)


@pytest.mark.parametrize("kwargs,name", [
    (dict(rank_in_tp_group=2, tp_world_size=2), "rank_in_tp_group"),
    (dict(rank_in_pp_group=-1), "rank_in_pp_group"),
    (dict(llm_engine=""), "llm_engine"), (dict(llm_engine=3), "llm_engine"),
    (dict(kvcache_type="mha"), "kvcache_type"), (dict(kvcache_type="XYZ"), "kvcache_type"),
])
def test_cc_config_v1_fields(kwargs, name):
    _bad(lambda: CcConfig_v1(rank_id=0, device_id=0, model_id="m", **kwargs), name)


def test_cc_config_v1_defaults_and_types():
    c = CcConfig_v1(rank_id=8, device_id=0, model_id="llama2-13b")
    assert (c.tp_world_size, c.pp_world_size, c.rank_in_tp_group, c.llm_engine, c.kvcache_type) == \
        (1, 1, 0, "vllm", "MHA")
    for t in ("GQA", "MHA", "MLA", "MQA"):
        CcConfig_v1(rank_id=0, device_id=0, model_id="m", kvcache_type=t)


@pytest.mark.parametrize("kwargs,name", [
    (dict(access_id="bad\\id", access_key=KEY), "access_id"), (dict(access_id="a" * 513, access_key=KEY), "access_id"),
    (dict(access_id="ok", access_key="short"), "access_key"), (dict(access_id="ok", access_key="k" * 257), "access_key"),
    (dict(access_id="ok", access_key="k" * 31 + "!"), "access_key"), (dict(access_id="ok"), "access_key"),
    (dict(access_key=KEY), "access_id"), (dict(access_id="", access_key=KEY), "access_id"),
    (dict(access_id=0, access_key=""), "access_id"), (dict(cc_config="x"), "cc_config"),
    (dict(server=""), "server"), (dict(connect_timeout=0), "connect_timeout"),
])
def test_ems_config_fields(kwargs, name):
    _bad(lambda: EmsConfig(**kwargs), name)


def test_ems_config_both_cc_configs_rejected():
    c = CcConfig(rank_id=0, device_id=0, model_id="m")
    _bad(lambda: EmsConfig(cc_config=c, cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="m")), "cc_config")
    assert EmsConfig(cc_config_v1=c).cc() is c
    EmsConfig(access_id="tenant.a-1_x", access_key="A+/=" * 8)


@pytest.mark.parametrize("kwargs", [dict(access_id="", access_key=""), dict(access_id=""),
                                    dict(access_key=""), dict(access_id="cc_kvstore@_@ds_default_ns_001", access_key="")])
def test_empty_credentials_mean_no_tenant(kwargs):
    """SPEC section 1: an empty access_id (and access_key) is "no tenant", as the serving
    adapters pass by default; an empty access_key goes with any access_id."""
    c = CcConfig(rank_id=0, device_id=0, model_id="m")
    assert EmsConfig(cc_config=c, **kwargs).validate().access_id == kwargs.get("access_id")


def test_option_validation_and_mutation():
    o = CcKvOption()
    assert (o.write_rcache, o.read_local_only, o.timeout) == (True, False, 5000)
    _bad(lambda: CcKvOption(timeout=-1), "timeout")
    _bad(lambda: CcKvOption(timeout=1.5), "timeout")
    _bad(lambda: CcKvOption(write_rcache=1), "write_rcache")
    _bad(lambda: CcKvOption(read_local_only="no"), "read_local_only")
    o.timeout = 1000  # the vendor's retry sample does this
    assert o.validate().timeout == 1000
    o.timeout = -5
    _bad(o.validate, "timeout")


def test_buffer_and_primary_key():
    _bad(lambda: KvBufferWrapper(0, 4), "data_ptr")
    _bad(lambda: KvBufferWrapper(16, 0), "length")
    _bad(lambda: KvBufferWrapper("16", 4), "data_ptr")
    assert KvBufferWrapper(lambda: 64, 4).locate() == (64, "cpu")
    with pytest.raises(ValueError, match="'data_ptr'.*raised KeyError"):
        KvBufferWrapper(lambda: {}["gone"], 4).locate()
    _bad(lambda: PrimaryKey("", "a"), "distribute_key")
    _bad(lambda: PrimaryKey("d", "x" * 128), "attribute_key")
    _bad(lambda: PrimaryKey("d", 5), "attribute_key")
    assert PrimaryKey("1", "123") == PrimaryKey("1", "123")


def test_exception_and_result_shapes():
    e = EmsException(EmsErrorCode.EMS_IO_TIMEOUT, "slow")
    assert e.status_code() == EmsErrorCode.EMS_IO_TIMEOUT and e.message() == "slow"
    assert "EMS_IO_TIMEOUT" in str(e) and f"{e.status_code()}" == "EMS_IO_TIMEOUT"
    assert str(CcResult(1, 2)) == "CcResult(success=1, total=2)"
    import pickle
    assert pickle.loads(pickle.dumps(e)).status_code() == EmsErrorCode.EMS_IO_TIMEOUT


def test_kv_buffer_of_a_device_tensor_is_refused_not_read_as_host_memory():
    import torch

    dev = torch.empty(16, device="meta")  # a device this build cannot move: never read as host memory
    buf = KvBufferWrapper(dev.data_ptr, 64)
    with pytest.raises(ValueError, match="data_ptr.*memory of meta"):  # EMS_INVALID_ARGUMENT at the call
        buf.locate()
    host = torch.zeros(16)
    assert KvBufferWrapper(host.data_ptr, 64).locate() == (host.data_ptr(), "cpu")


def test_kv_buffer_of_a_cpu_tensor_is_bounded_by_the_tensor():
    import torch

    t = torch.zeros(16)
    assert KvBufferWrapper(t[:2].data_ptr, 8).locate() == (t.data_ptr(), "cpu")
    with pytest.raises(ValueError, match="'length'.*64 exceeds the 8 bytes"):
        KvBufferWrapper(t[:2].data_ptr, 64).locate()
    with pytest.raises(ValueError, match="'data_ptr'.*not contiguous"):
        KvBufferWrapper(t[::2].data_ptr, 8).locate()


def test_kv_cache_on_a_device_this_build_cannot_move_is_refused():
    import torch

    from ems.kvcache import KvLayout

    layers = [[torch.empty(4, 2, 2, 4, device="meta") for _ in range(2)] for _ in range(2)]
    with pytest.raises(ValueError, match="kvcache.*meta"):
        KvLayout(layers, None, "MHA")


def _mla_layers(widths=((1, 512), (1, 64)), layers=2, blocks=4, block_size=2):
    import torch

    return [[torch.zeros(blocks, block_size, h, w, dtype=torch.bfloat16) for h, w in widths] for _ in range(layers)]


def test_mla_layers_of_latent_and_rope_parts_register():
    """An MLA layer is (latent [.., 1, 512], rope [.., 1, 64]), as serving adapters register
    it; a value holds each tensor's rows of its slots, tensor after tensor."""
    import numpy as np
    import torch

    from ems.kvcache import HostCopier, KvLayout

    layers = _mla_layers()
    g = torch.Generator().manual_seed(3)
    for layer in layers:
        for t in layer:
            t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, generator=g, dtype=torch.int16))
    layout = KvLayout(layers, [[1], [0]], "MLA")
    slots = np.array([3, 6, 7], dtype=np.int64)

    def rows(t, picked):
        return t.view(-1, t[0, 0].numel())[torch.from_numpy(picked)].view(torch.uint8).numpy().ravel()

    vp = layout.span_plan(slots)
    want = np.concatenate([rows(t, slots) for layer in layers for t in layer])
    assert vp.size == want.size == 3 * 2 * (512 + 64) * 2  # slots x layers x row bytes (bf16)
    value = np.zeros(vp.size, dtype=np.uint8)
    HostCopier().save(vp, value.ctypes.data)
    assert np.array_equal(value, want)

    vp = layout.chunk_plan([(6, 2), (0, 3)])  # group 0 is layer 1, group 1 layer 0
    want = np.concatenate([rows(t, np.arange(6, 8)) for t in layers[1]]
                          + [rows(t, np.arange(0, 3)) for t in layers[0]])
    value = np.zeros(vp.size, dtype=np.uint8)
    HostCopier().save(vp, value.ctypes.data)
    assert np.array_equal(value, want)


@pytest.mark.parametrize("bad,why", [
    ([[(1, 512), (1, 64)], [(1, 512), (1, 32)]], "layer 0"),  # layer 1's rope part is narrower
    ([[(1, 512), (1, 64)], [(1, 64), (1, 512)]], "layer 0"),  # parts in another order
])
def test_every_layer_repeats_layer_0(bad, why):
    import torch

    from ems.kvcache import KvLayout

    layers = [[torch.zeros(4, 2, h, w) for h, w in layer] for layer in bad]
    with pytest.raises(ValueError, match=f"kvcache.*{why}"):
        KvLayout(layers, None, "MLA")


def test_all_tensors_share_blocks_and_block_size():
    import torch

    from ems.kvcache import KvLayout

    layers = [[torch.zeros(4, 2, 1, 8), torch.zeros(4, 4, 1, 8)]]
    with pytest.raises(ValueError, match="kvcache.*block_size"):
        KvLayout(layers, None, "MLA")
