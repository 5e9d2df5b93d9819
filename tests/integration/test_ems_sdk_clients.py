"""What real EMS clients pass, against a real ``ems-server``: the V1 and V0 serving
adapters' imports, defaults, cache layouts and config habits (omni-infer's vLLM adapters),
credentials as the SDK takes them, and the error codes its retry sample depends on.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

from ems_helpers import daemon_factory, init_cc, kvcache  # noqa: F401

# The V1 adapter's own import lines ...
from ems import (CcConfig_v1, CcKvOption, ContextCache_v1, Ems, EmsConfig, EmsErrorCode,
                 EmsException)
from ems.cc_v1.cc_config import KVCacheType
# ... and the V0 adapter's.
from ems import CcConfig, ContextCaching, KvBufferWrapper

pytestmark = pytest.mark.timeout(90)

#: The adapters' defaults (MODEL_ID, ACCELERATE_ID, ACCELERATE_KEY environment variables;
#: the V0 adapter's ACCELERATE_ID default is "access_id").
DEFAULT_ID = "cc_kvstore@_@ds_default_ns_001"
V0_ACCESS_ID = "access_id"
BLOCK = 4


def _adapter_config(server: str, access_id: str = DEFAULT_ID, access_key: str = "") -> EmsConfig:
    cc_config_v1 = CcConfig_v1(rank_id=0, device_id=0, model_id=DEFAULT_ID, tp_world_size=1, pp_world_size=1,
                               rank_in_tp_group=0, rank_in_pp_group=0, llm_engine="vllm")
    cc_config_v1.kvcache_type = KVCacheType.MLA  # set after construction, as the adapter does for MLA
    return EmsConfig(access_id=access_id, access_key=access_key, cc_config_v1=cc_config_v1, server=server)


def _mla_kv_caches(layers: int, blocks: int, seed: int) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """What the serving engine hands the adapter for an MLA model: per layer name, the
    latent part [blocks, block_size, 1, 512] and the rope part [blocks, block_size, 1, 64]."""
    g = torch.Generator().manual_seed(seed)

    def part(width: int) -> torch.Tensor:
        bits = torch.randint(-2**15, 2**15, (blocks, BLOCK, 1, width), generator=g, dtype=torch.int16)
        return bits.view(torch.bfloat16)

    return {f"model.layers.{i}.self_attn.attn": (part(512), part(64)) for i in range(layers)}


def _as_registered(kv_caches: Dict[str, Tuple[torch.Tensor, ...]]) -> List[List[torch.Tensor]]:
    """The adapter's register_kv_caches: the dict's values as a list of per-layer lists."""
    return [[layer[i] for i in range(len(layer))] for layer in kv_caches.values()]


def _chain_hashes(tokens: List[int]) -> List[int]:
    """The adapter's block hashes: Python's ``hash`` chained over full blocks (signed)."""
    out, prev = [], 0
    for b in range(len(tokens) // BLOCK):
        prev = hash((prev, *tokens[b * BLOCK:(b + 1) * BLOCK]))
        out.append(prev)
    return out


def _slots(block_ids: List[int]) -> List[int]:
    """The adapter's slot mapping: every slot of each block, as a list of int."""
    return (np.array(block_ids)[:, np.newaxis] * BLOCK + np.arange(BLOCK)).ravel().tolist()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_v1_adapter_round_trip(daemon_factory) -> None:
    """The V1 adapter end to end: MLA set after construction, default ids and an empty key,
    the engine's latent + rope cache, signed chained hashes, async save, exists, async load
    polled with is_ready; the loaded blocks equal the saved ones bit for bit."""
    daemon = daemon_factory()
    Ems._shutdown()
    try:
        Ems.init(_adapter_config(daemon.dir))
        cc = Ems.get_cc()
        assert isinstance(cc, ContextCache_v1)
        kv_caches = _mla_kv_caches(layers=3, blocks=8, seed=5)
        cc.register_kvcache(_as_registered(kv_caches))
        option = CcKvOption(write_rcache=True, read_local_only=False, timeout=5000)
        hashes = _chain_hashes(list(range(100, 112)))
        assert any(h < 0 for h in hashes), "the adapter's hashes include negative ints"
        saved = {name: tuple(t.clone() for t in layer) for name, layer in kv_caches.items()}
        fut = cc.async_save(slot_mapping=_slots([1, 4, 6]), hashes=hashes, offsets=[BLOCK] * 3, option=option)
        assert cc.get_result(fut).success == 3
        assert cc.exists(hashes, option).success == 3
        assert cc.exists(_chain_hashes(list(range(200, 212))), option).success == 0
        for layer in kv_caches.values():
            for t in layer:
                t.zero_()
        fut = cc.async_load(slot_mapping=_slots([0, 2, 3]), hashes=hashes, offsets=[BLOCK] * 3, option=option)
        while not cc.is_ready(fut):
            fut.result(10)
        result = cc.get_result(fut)
        assert (result.success, result.total) == (3, 3)
        for name, layer in kv_caches.items():
            for t, before in zip(layer, saved[name]):
                assert torch.equal(_bits(t[[0, 2, 3]]), _bits(before[[1, 4, 6]]))
                assert not _bits(t[[1, 4, 5, 6, 7]]).any()  # nothing else was written
    finally:
        Ems._shutdown()


def test_newer_v1_adapter_init_degrades_instead_of_crashing(daemon_factory, tmp_path) -> None:
    """Newer adapters name their engine ``vllm@<service>`` and, when init fails, test the
    code against ``EmsErrorCode.EMS_RECOVERD_ERROR`` (which must exist) and run degraded;
    once the pool answers, init succeeds with the same config."""

    def adapter_init(config: EmsConfig) -> Tuple[bool, bool]:
        need_reinit = False
        try:
            Ems.init(config)
            return Ems.get_cc() is not None, need_reinit
        except EmsException as e:
            if e.status_code() == EmsErrorCode.EMS_RECOVERD_ERROR:
                need_reinit = True
            assert e.status_code() == EmsErrorCode.EMS_IO_ERROR
            return False, need_reinit

    Ems._shutdown()
    config = _adapter_config(str(tmp_path / "down"))
    config.cc_config_v1.llm_engine = "vllm@deepseek"
    assert adapter_init(config) == (False, False)
    assert Ems.get_cc() is None and Ems.check_health() is False
    try:
        daemon_factory(directory=tmp_path / "down")
        assert adapter_init(config) == (True, False)
        assert Ems.check_health() is True
    finally:
        Ems._shutdown()


def test_v0_adapter_round_trip_striped_over_ranks(daemon_factory) -> None:
    """The V0 adapter: CcConfig by keyword with only rank and device, access_id "access_id"
    and an empty key, its own '@'-joined key text with signed hashes, one K (latent) and
    one V (rope) buffer per layer and block.  For MLA each tp rank saves every n-th key and
    every rank loads them all, so keys saved under one rank_id load under another."""
    daemon = daemon_factory()
    kv_caches = _mla_kv_caches(layers=2, blocks=8, seed=7)
    layers = list(kv_caches.values())

    def buffers(block_id: int) -> List[KvBufferWrapper]:
        return [KvBufferWrapper(t[block_id].data_ptr(), t[block_id].numel() * t.element_size())
                for layer in layers for t in layer]

    def init(rank: int) -> ContextCaching:
        Ems._shutdown()
        cc_config = CcConfig(model_id=DEFAULT_ID, rank_id=rank, device_id=rank)
        Ems.init(EmsConfig(access_id=V0_ACCESS_ID, access_key="", cc_config=cc_config, server=daemon.dir))
        return Ems.get_cc()

    keys = ["@".join(["vllm", V0_ACCESS_ID, "pp1", "tp2", "0", str(h)]) for h in _chain_hashes(list(range(16)))]
    assert any("-" in k for k in keys)
    option = CcKvOption(write_rcache=True, read_local_only=False)
    saved = [tuple(t.clone() for t in layer) for layer in layers]
    try:
        for rank in (0, 1):
            cc = init(rank)
            mine = list(range(rank, 4, 2))
            fut = cc.async_save(option, [keys[i] for i in mine], [buffers(i) for i in mine])
            assert fut.result().success == len(mine)
        cc = init(0)
        fut = cc.async_load(option, keys, [buffers(4 + i) for i in range(4)])
        assert fut.result().success == 4
        for layer, before in zip(layers, saved):
            for t, b in zip(layer, before):
                assert torch.equal(_bits(t[4:8]), _bits(b[0:4]))
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


def test_tenant_pool_takes_every_accepted_id(daemon_factory, tmp_path) -> None:
    """Ids a client may give are ids a credentials file may list: 512 characters (longer
    than a memfd name), ':' and '#' inside; comments still work around them."""
    ids = ["t" * 512, "ns:team#1", DEFAULT_ID]
    keys = [c * 40 for c in "ABC"]
    creds = tmp_path / "creds"
    creds.write_text("# access_id: access_key\n"
                     + "".join(f"{i}: {k}   # tenant {n}\n" for n, (i, k) in enumerate(zip(ids, keys)))
                     + "#commented-out: " + "D" * 40 + "\n")
    daemon = daemon_factory(credentials=creds)
    data = kvcache(layers=1, kv=2, blocks=4, block_size=BLOCK, seed=3)
    try:
        for n, (ident, key) in enumerate(zip(ids, keys)):
            cc = init_cc(daemon.dir, access_id=ident, access_key=key)
            cc.register_kvcache(data)
            assert cc.exists([n]).success == 0  # tenants do not see each other's values
            assert cc.save(slot_mapping=_slots([0]), hashes=[n], offsets=[BLOCK]).success == 1
            assert cc.exists([n]).success == 1
        Ems._shutdown()
        # A commented-out entry, another tenant's key, the id cut at ':' or '#': all refused.
        for ident, key in [("commented-out", "D" * 40), ("ns:team#1", keys[0]), ("ns", keys[1]),
                           ("ns:team", keys[1])]:
            with pytest.raises(EmsException) as err:
                init_cc(daemon.dir, access_id=ident, access_key=key)
            assert err.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT, ident
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
        with daemon.stopped():
            codes = []
            option = CcKvOption(timeout=300)
            for _ in range(3):
                with pytest.raises(EmsException) as err:
                    cc.load(slot_mapping=_slots([1]), hashes=[1], offsets=[BLOCK], option=option)
                codes.append(err.value.status_code())
            for call in (cc.async_load, cc.async_save):  # the serving adapter's way
                fut = call(slot_mapping=_slots([1]), hashes=[2], offsets=[BLOCK], option=option)
                with pytest.raises(EmsException) as err:
                    cc.get_result(fut)
                codes.append(err.value.status_code())
            assert codes == [EmsErrorCode.EMS_IO_TIMEOUT] * 5
        assert cc.load(slot_mapping=_slots([1]), hashes=[1], offsets=[BLOCK]).success == 1
    finally:
        Ems._shutdown()
