"""What real EMS clients pass, against a real ``ems-server``: a V1 serving adapter's
imports, defaults and config habits (omni-infer's vLLM adapter), credentials as the SDK
takes them, and the error codes its retry sample depends on.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ems_helpers import daemon_factory, init_cc, kvcache  # noqa: E402,F401

# The adapter's own import lines.
from ems import (CcConfig_v1, CcKvOption, ContextCache_v1, Ems, EmsConfig, EmsErrorCode,  # noqa: E402
                 EmsException)
from ems.cc_v1.cc_config import KVCacheType  # noqa: E402

pytestmark = pytest.mark.timeout(90)

#: The adapter's defaults (MODEL_ID, ACCELERATE_ID, ACCELERATE_KEY environment variables).
DEFAULT_ID = "cc_kvstore@_@ds_default_ns_001"
BLOCK = 4


def _adapter_config(server: str, access_id: str = DEFAULT_ID, access_key: str = "") -> EmsConfig:
    cc_config_v1 = CcConfig_v1(rank_id=0, device_id=0, model_id=DEFAULT_ID, tp_world_size=1, pp_world_size=1,
                               rank_in_tp_group=0, rank_in_pp_group=0, llm_engine="vllm")
    cc_config_v1.kvcache_type = KVCacheType.MLA  # set after construction, as the adapter does for MLA
    return EmsConfig(access_id=access_id, access_key=access_key, cc_config_v1=cc_config_v1, server=server)


def _slots(block_ids: list) -> list:
    return [b * BLOCK + i for b in block_ids for i in range(BLOCK)]


def test_v1_adapter_round_trip(daemon_factory) -> None:
    daemon = daemon_factory()
    Ems._shutdown()
    try:
        Ems.init(_adapter_config(daemon.dir))
        cc = Ems.get_cc()
        assert isinstance(cc, ContextCache_v1)
        # MLA: one latent tensor per layer (k_normed, k_pe pairs register as two)
        layers = kvcache(layers=3, kv=2, blocks=8, block_size=BLOCK, seed=5)
        cc.register_kvcache(layers)
        option = CcKvOption(write_rcache=True, read_local_only=False, timeout=5000)
        hashes = [0x1234_5678_9ABC_DEF0, 77, 2**63 + 5]
        saved = [[t.clone() for t in layer] for layer in layers]
        fut = cc.async_save(slot_mapping=_slots([1, 4, 6]), hashes=hashes, offsets=[BLOCK] * 3, option=option)
        assert cc.get_result(fut).success == 3
        assert cc.exists(hashes, option).success == 3
        for layer in layers:
            for t in layer:
                t.zero_()
        fut = cc.async_load(slot_mapping=_slots([0, 2, 3]), hashes=hashes, offsets=[BLOCK] * 3, option=option)
        while not cc.is_ready(fut):
            fut.result(10)
        result = cc.get_result(fut)
        assert (result.success, result.total) == (3, 3)
        for layer, before in zip(layers, saved):
            for t, b in zip(layer, before):
                assert torch.equal(t[[0, 2, 3]], b[[1, 4, 6]])
    finally:
        Ems._shutdown()


def test_kvcache_type_is_text_and_mutations_are_checked_at_init(daemon_factory) -> None:
    assert KVCacheType.MLA == "MLA" and f"{KVCacheType.GQA}" == "GQA" and str(KVCacheType.MQA) == "MQA"
    daemon = daemon_factory()
    config = _adapter_config(daemon.dir)
    config.cc_config_v1.rank_in_tp_group = 3  # out of its tp_world_size of 1, set after construction
    Ems._shutdown()
    with pytest.raises(EmsException) as err:
        Ems.init(config)
    assert err.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "rank_in_tp_group" in err.value.message()
    assert Ems.get_cc() is None


@pytest.mark.parametrize("ident", [DEFAULT_ID, "Model/7b", "a|b", "has space", "tab\tid", "x" * 513])
def test_ids_are_printable_ascii_without_path_separators(ident: str) -> None:
    ok = "/" not in ident and " " not in ident and "\t" not in ident and len(ident) <= 512
    if ok:
        CcConfig_v1(rank_id=0, device_id=0, model_id=ident)
        EmsConfig(access_id=ident, access_key="", cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="m"))
    else:
        with pytest.raises(EmsException) as err:
            CcConfig_v1(rank_id=0, device_id=0, model_id=ident)
        assert "model_id" in err.value.message()


def test_separator_in_ids_is_escaped_not_shared(daemon_factory) -> None:
    """Ids "a|b" + "c" and "a" + "b|c" must not name the same keys."""
    daemon = daemon_factory()
    data = kvcache(layers=1, kv=2, blocks=4, block_size=BLOCK, seed=1)
    try:
        cc = init_cc(daemon.dir, model_id="b|c", access_id="a", access_key="")
        cc.register_kvcache(data)
        assert cc.save(slot_mapping=_slots([0]), hashes=[42], offsets=[BLOCK]).success == 1
        cc = init_cc(daemon.dir, model_id="c", access_id="a|b", access_key="")
        cc.register_kvcache(kvcache(layers=1, kv=2, blocks=4, block_size=BLOCK, seed=2))
        assert cc.exists([42]).success == 0
        cc = init_cc(daemon.dir, model_id="b|c", access_id="a", access_key="")
        cc.register_kvcache(kvcache(layers=1, kv=2, blocks=4, block_size=BLOCK, seed=2))
        assert cc.exists([42]).success == 1
    finally:
        Ems._shutdown()


def test_tenant_pool_refuses_empty_and_wrong_keys_and_logs_init_failed(daemon_factory, tmp_path, caplog) -> None:
    key = "A" * 40
    creds = tmp_path / "creds"
    creds.write_text(f"{DEFAULT_ID}: {key}\n")
    daemon = daemon_factory(credentials=creds)
    Ems._shutdown()
    for wrong in ("", "B" * 40):
        with caplog.at_level(logging.ERROR, logger="ems"):
            with pytest.raises(EmsException) as err:
                Ems.init(_adapter_config(daemon.dir, access_key=wrong))
        assert err.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
        assert any(r.name == "ems" and "EMS init failed" in r.getMessage() for r in caplog.records)
        assert key not in caplog.text and Ems.get_cc() is None
        caplog.clear()
    try:
        Ems.init(_adapter_config(daemon.dir, access_key=key))
        assert Ems.get_cc() is not None
    finally:
        Ems._shutdown()


def test_stalled_pool_times_out_on_every_retry(daemon_factory) -> None:
    """The vendor's retry sample retries only on EMS_IO_TIMEOUT: a pool that stops answering
    must keep saying so, on the call that breaks the connection and on every retry after."""
    daemon = daemon_factory()
    try:
        cc = init_cc(daemon.dir)
        cc.register_kvcache(kvcache(layers=1, kv=2, blocks=4, block_size=BLOCK))
        assert cc.save(slot_mapping=_slots([0]), hashes=[1], offsets=[BLOCK]).success == 1
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            codes = []
            option = CcKvOption(timeout=300)
            for _ in range(3):
                with pytest.raises(EmsException) as err:
                    cc.load(slot_mapping=_slots([1]), hashes=[1], offsets=[BLOCK], option=option)
                codes.append(err.value.status_code())
            assert codes == [EmsErrorCode.EMS_IO_TIMEOUT] * 3
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert cc.load(slot_mapping=_slots([1]), hashes=[1], offsets=[BLOCK]).success == 1
    finally:
        Ems._shutdown()
