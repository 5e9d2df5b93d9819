"""SPEC-ems.md, clause by clause, against a real daemon."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from ems_helpers import ENV, check, daemon_factory, ems_cc, ems_daemon, init_cc, kvcache  # noqa: F401

from ems import (CcConfig, CcConfig_v1, CcKvOption, Ems, EmsConfig, EmsException, KvBufferWrapper,
                 PrimaryKey)
from ems.common.exception import EmsErrorCode

pytestmark = pytest.mark.timeout(120)


def test_1_init_once_per_process(ems_daemon):
    Ems._shutdown()
    assert Ems.get_cc() is None and Ems.check_health() is False
    cfg = EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), server=ems_daemon.dir)
    try:
        Ems.init(cfg)
        cc = Ems.get_cc()
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), server=ems_daemon.dir))
        assert Ems.get_cc() is cc  # an equal config: no-op
        with pytest.raises(EmsException) as ei:
            Ems.init(EmsConfig(cc_config=CcConfig(rank_id=1, device_id=0, model_id="m"), server=ems_daemon.dir))
        assert ei.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
        with pytest.raises(EmsException) as ei:
            Ems.init("config")
        assert ei.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    finally:
        Ems._shutdown()
    with pytest.raises(EmsException) as ei:
        Ems.init(EmsConfig(server=ems_daemon.dir))
    assert "cc_config" in ei.value.message()


def test_1_results_count_leading_successes(ems_cc):
    ems_cc.register_kvcache(kvcache())
    assert ems_cc.save(slot_mapping=list(range(4, 8)), hashes=[2], offsets=[4]).success == 1
    # key 1 misses: load fills key 0 and stops; exists counts only the leading run
    res = ems_cc.load(slot_mapping=list(range(12)), hashes=[99, 2, 2], offsets=[4, 4, 4])
    assert (res.success, res.total) == (0, 3)
    res = ems_cc.load(slot_mapping=list(range(12)), hashes=[2, 99, 2], offsets=[4, 4, 4])
    assert (res.success, res.total) == (1, 3)
    ems_cc.save(slot_mapping=list(range(4)), hashes=[1], offsets=[4])
    res = ems_cc.load(slot_mapping=list(range(12)), hashes=[1, 99, 2], offsets=[4, 4, 4])
    assert (res.success, res.total) == (1, 3)
    assert ems_cc.exists([1, 2, 99]).success == 2 and ems_cc.exists([99, 1]).success == 0


def test_1_saving_again_is_not_an_error(ems_cc):
    a = torch.arange(64, dtype=torch.float32)
    for _ in range(3):
        assert ems_cc.save(CcKvOption(), ["same"], [[KvBufferWrapper(a.data_ptr, 256)]]).success == 1
    ems_cc.register_kvcache(kvcache())
    for _ in range(2):
        assert ems_cc.save(slot_mapping=[0, 1, 2, 3], hashes=[5], offsets=[4]).success == 1


def test_1_exists_invalid_arguments_still_raise(ems_cc):
    with pytest.raises(EmsException) as ei:
        ems_cc.exists("not a list")
    assert ei.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    with pytest.raises(EmsException):
        ems_cc.exists([1], option="opt")


def test_1_size_mismatch_is_a_miss_not_a_partial_fill(ems_cc):
    a = torch.arange(64, dtype=torch.float32)
    ems_cc.save(CcKvOption(), ["v"], [[KvBufferWrapper(a.data_ptr, 256)]])
    out = torch.zeros(128)
    assert ems_cc.load(CcKvOption(), ["v"], [[KvBufferWrapper(out.data_ptr, 512)]]).success == 0
    assert not out.any()


def test_1_keys_namespaced_by_model_rank_engine_type_and_tenant(ems_daemon):
    a = torch.arange(64, dtype=torch.float32)
    try:
        cc = init_cc(ems_daemon.dir, model_id="m1")
        cc.save(CcKvOption(), [PrimaryKey("d", "a")], [[KvBufferWrapper(a.data_ptr, 256)]])
        assert cc.exists(key_list=[PrimaryKey("d", "a")]).success == 1
        for kwargs in (dict(model_id="m2"), dict(model_id="m1", llm_engine="sglang"),
                       dict(model_id="m1", kvcache_type="GQA"),
                       dict(model_id="m1", tp_world_size=2, rank_in_tp_group=1),
                       dict(model_id="m1", access_id="other", access_key="k" * 32)):
            cc = init_cc(ems_daemon.dir, **kwargs)
            assert cc.exists(key_list=[PrimaryKey("d", "a")]).success == 0, kwargs
        cc = init_cc(ems_daemon.dir, model_id="m1", rank_id=5)  # rank_id alone is not the layout
        assert cc.exists(key_list=[PrimaryKey("d", "a")]).success == 1
    finally:
        Ems._shutdown()


def test_1_mla_single_tensor_per_layer(ems_daemon):
    try:
        cc = init_cc(ems_daemon.dir, kvcache_type="MLA")
        kv = kvcache(kv=1, seed=3)
        cc.register_kvcache(kv)
        ref = kv[0][0][0].clone()
        assert cc.save(slot_mapping=[0, 1, 2, 3], hashes=[42], offsets=[4]).success == 1
        assert cc.load(slot_mapping=[4, 5, 6, 7], hashes=[42], offsets=[4]).success == 1
        assert torch.equal(kv[0][0][1], ref)
    finally:
        Ems._shutdown()


def test_3_explicit_unix_url_and_env(ems_daemon, monkeypatch):
    try:
        cc = init_cc(f"unix://{ems_daemon.dir}/ems.sock")
        assert Ems.check_health()
        Ems._shutdown()
        monkeypatch.setenv("EMS_SERVER", ems_daemon.dir)
        Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id="m")))
        assert Ems.check_health()
        assert cc is not None
    finally:
        Ems._shutdown()


def test_3_server_cli_help_and_module_entry():
    out = check(subprocess.run([sys.executable, "-m", "ems.server", "--help"], capture_output=True,
                               text=True, env=ENV, timeout=30))
    assert "stats" in out and "serve" in out


def test_perf_bench_smoke():
    out = check(subprocess.run([sys.executable, "-m", "ems.bench", "--json", "--layers", "2", "--heads", "2",
                                "--hashes", "2", "--cache-blocks", "6", "--iters", "2", "--warmup", "1",
                                "--exists-reps", "20"], capture_output=True, text=True, env=ENV, timeout=120))
    import json
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["workload"] for r in rows] == ["save", "load", "exists"]
    from datadist.bench.record import FIELDS
    assert all(set(FIELDS) <= set(r) for r in rows)  # the one record schema of both benches
