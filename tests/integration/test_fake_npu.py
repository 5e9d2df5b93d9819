"""NPU caches for real, on a fake NPU whose device memory the host cannot touch
(tests/fake_npu: torch's PrivateUse1 backend renamed ``npu``, whose memory is mapped
PROT_NONE at the addresses torch hands out and reached by its own copies through a second
mapping, and a ``torch_npu`` stand-in).

A code path that took an NPU tensor's address for host memory would die with SIGSEGV
here, so every byte these tests see arrive went through the device's own copies: NPU
engines allocate, register, copy and swap NPU caches, and move them between processes
over shm, tcp and gloo; ems saves and loads NPU caches; what cannot be moved is refused
with its clear error.  Processes run with ``tests/fake_npu`` on their path
(:mod:`fake_npu_env`); the extension is built once per run (``torch.utils.cpp_extension``;
skipped without a C++ compiler).
"""
from __future__ import annotations

import signal
from typing import Any

import numpy as np
import pytest

from fake_npu_env import ok, run
from harness import (DECODER_ID, PROMPT_ID, Desc, Ref, base_config, blocks_key, cache_key, expect_blocks,
                     expect_rows, free_port, key_config)

pytestmark = [pytest.mark.fake_npu, pytest.mark.timeout(300)]

def test_the_device_computes_and_its_memory_is_not_host_memory(npu_env: dict) -> None:
    out = ok(run(npu_env, """
        import torch, torch_npu
        t = torch.arange(24, dtype=torch.float16).reshape(4, 6).to("npu")
        u = torch.zeros(4, 6, dtype=torch.float16, device="npu")
        idx = torch.tensor([3, 1], device="npu")
        u.index_copy_(0, idx, t.index_select(0, torch.tensor([0, 2], device="npu")))
        u.narrow(1, 4, 2).fill_(7)
        print(t.device, u.cpu()[3].tolist(), u.cpu()[1].tolist(), u.cpu()[0].tolist())
    """))
    assert out.split()[0] == "npu:0"
    assert "[0.0, 1.0, 2.0, 3.0, 7.0, 7.0]" in out and "[12.0, 13.0, 14.0, 15.0, 7.0, 7.0]" in out
    crashed = run(npu_env, """
        import ctypes, torch, torch_npu
        t = torch.ones(1024, device="npu")
        print(ctypes.string_at(t.data_ptr(), 8))  # a host read of device memory
    """)
    assert crashed.returncode == -signal.SIGSEGV, (crashed.returncode, crashed.stdout, crashed.stderr[-2000:])


def test_npu_tensors_are_refused_by_a_host_engine(npu_env: dict) -> None:
    out = ok(run(npu_env, """
        import torch, torch_npu
        from datadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMException, LLMRole
        config = LLMConfig()
        config.device_type = "cpu"
        engine = LLMDataDist(LLMRole.PROMPT, 1)
        engine.init(config.generate_options())
        tensors = [torch.ones(4, 8, dtype=torch.float16, device="npu") for _ in range(2)]
        try:
            engine.cache_manager.register_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT16), tensors,
                                                       BlocksCacheKey(1, 0))
        except LLMException as exc:
            print(exc.status_code.name, "|", exc)
        print("still", tensors[0].cpu().sum().item())
        engine.finalize()
    """))
    assert out.startswith("LLM_FEATURE_NOT_ENABLED |") and "npu" in out and "still 32.0" in out, out


def test_ems_v0_refuses_bare_npu_addresses(npu_env: dict) -> None:
    out = ok(run(npu_env, """
        import torch, torch_npu
        from ems import KvBufferWrapper
        t = torch.ones(64, dtype=torch.uint8, device="npu")
        print("npu", KvBufferWrapper(t.data_ptr, 64).locate() == (t.data_ptr(), "npu:0"))
        for wrapper in (KvBufferWrapper(t.data_ptr(), 64), KvBufferWrapper(t.data_ptr, 65)):
            try:
                wrapper.locate()
            except Exception as exc:  # EMS_INVALID_ARGUMENT at the API
                print("refused:", exc)
        host = torch.ones(64, dtype=torch.uint8)
        print("host ok", KvBufferWrapper(host.data_ptr, 64).locate() == (host.data_ptr(), "cpu"))
    """))
    refused = [line for line in out.splitlines() if line.startswith("refused:")]
    assert "npu True" in out and "host ok True" in out, out
    assert len(refused) == 2 and "bare address" in refused[0] and "exceeds" in refused[1], out


BLOCKS = Desc(4, (8, 16, 32), "fp16")  # 2 layers x K, V; 8 blocks of 1 KiB


def _npu_config(transport: str, **kw: Any) -> dict:
    return base_config(transport, device_type="npu", **kw)


@pytest.mark.parametrize("transport", ["shm", "tcp", "gloo"])
def test_npu_caches_move_between_processes(npu_peers: Any, transport: str) -> None:
    port = free_port()
    prompt = npu_peers("peer", "prompt", "PROMPT", PROMPT_ID, _npu_config(transport, listen_port=port))
    prompt.alloc("kv", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    data = prompt.fill("kv", BLOCKS, 5)
    dec = npu_peers("peer", "decoder", "DECODER", DECODER_ID, _npu_config(transport))
    dec.alloc("dst", BLOCKS, blocks=True)
    base = dec.fill("dst", BLOCKS, 6)
    assert {i["device"] for i in dec.call("tensor_info", "dst")} == {"npu:0"}
    dec.link(prompt, port=port)
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0, 5, 6], [7, 2, 3])
    np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, data, [0, 5, 6], [7, 2, 3], BLOCKS.row_bytes))
    # layer 1 (K1, V1) of the decoder's blocks [1, 2] -> the prompt's blocks [4, 0]
    dec.cm("push_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [1, 2], [4, 0], src_layer_range=range(1, 2),
           dst_layer_range=range(1, 2), tensor_num_per_layer=2)
    want = data.copy()
    mine = dec.read("dst")
    rb = BLOCKS.row_bytes
    for s, d in ((1, 4), (2, 0)):
        want[2:4, d * rb:(d + 1) * rb] = mine[2:4, s * rb:(s + 1) * rb]
    np.testing.assert_array_equal(prompt.read("kv"), want)


def test_npu_rows_move_with_cache_keys_and_layer_ranges(npu_peers: Any) -> None:
    """pull_cache and push_cache between NPU caches (rows, not blocks), over tcp."""
    rows = Desc(4, (3, 8, 16), "fp16")
    port = free_port()
    prompt = npu_peers("peer", "prompt", "PROMPT", PROMPT_ID, _npu_config("tcp", listen_port=port))
    prompt.alloc("rows", rows, keys=[cache_key(PROMPT_ID, 300 + i) for i in range(3)])
    data = prompt.fill("rows", rows, 13)
    dec = npu_peers("peer", "decoder", "DECODER", DECODER_ID, _npu_config("tcp"))
    dec.alloc("dst", rows)
    base = dec.fill("dst", rows, 14)
    dec.link(prompt, port=port)
    dec.cm("pull_cache", cache_key(PROMPT_ID, 301), Ref("dst"), 2, src_layer_range=range(1, 2),
           dst_layer_range=range(0, 1), tensor_num_per_layer=2)
    want = expect_rows(base, data, 1, 2, rows.row_bytes, src_layers=range(1, 2), dst_layers=range(0, 1))
    np.testing.assert_array_equal(dec.read("dst"), want)
    dec.cm("push_cache", cache_key(PROMPT_ID, 300), Ref("dst"), 2)
    np.testing.assert_array_equal(prompt.read("rows"), expect_rows(data, want, 2, 0, rows.row_bytes))


def test_layer_by_layer_push_from_an_npu_cache(npu_peers: Any) -> None:
    """transfer_cache_async: each layer leaves the prompt's NPU cache when its synchronizer
    releases it, into the decoder's NPU cache."""
    port = free_port()
    dec = npu_peers("peer", "decoder", "DECODER", DECODER_ID, _npu_config("shm", listen_port=port))
    dec.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 1))
    base = dec.fill("dst", BLOCKS, 11)
    prompt = npu_peers("peer", "prompt", "PROMPT", PROMPT_ID, _npu_config("shm"))
    prompt.alloc("src", BLOCKS, blocks=True)
    data = prompt.fill("src", BLOCKS, 12)
    prompt.link(dec, port=port)
    prompt.call("transfer_async", "task", "src", [key_config(blocks_key(DECODER_ID, 1), range(0, 2), range(0, 2))],
                src_block_indices=[0, 1, 2], dst_block_indices=[5, 6, 7])
    prompt.call("open_layers", "task", [0, 1])
    assert prompt.call("task", "task", "get_results", 20_000)["result"] == [0]
    np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, data, [0, 1, 2], [5, 6, 7], BLOCKS.row_bytes))


def test_registered_npu_tensors_are_served(npu_peers: Any) -> None:
    port = free_port()
    on_npu = Desc(4, (8, 16, 32), "fp16", device="npu")
    prompt = npu_peers("peer", "prompt", "PROMPT", PROMPT_ID, _npu_config("tcp", listen_port=port))
    prompt.register("kv", on_npu, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    data = prompt.fill("kv", on_npu, 8)
    dec = npu_peers("peer", "decoder", "DECODER", DECODER_ID, _npu_config("tcp"))
    dec.alloc("dst", BLOCKS, blocks=True)
    base = dec.fill("dst", BLOCKS, 9)
    dec.link(prompt, port=port)
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [2, 3], [0, 1])
    np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, data, [2, 3], [0, 1], BLOCKS.row_bytes))


def test_local_npu_copies_and_the_engine_thread_device(npu_env: dict) -> None:
    out = ok(run(npu_env, """
        import json, threading, torch, torch_npu
        from datadist import (CacheDesc, DataType, LLMConfig, LLMDataDist, LLMException, LLMRole, Placement)
        config = LLMConfig()
        config.device_type = "npu"
        config.mem_pool_cfg = json.dumps({"memory_size": 1 << 22})
        config.host_mem_pool_cfg = json.dumps({"memory_size": 1 << 22})
        engine = LLMDataDist(LLMRole.MIX, 1)
        engine.init(config.generate_options())
        cm = engine.cache_manager
        dev = cm.allocate_blocks_cache(CacheDesc(2, [8, 4], DataType.DT_FLOAT))
        host = cm.allocate_blocks_cache(CacheDesc(2, [8, 4], DataType.DT_FLOAT, Placement.HOST))
        for i, t in enumerate(cm.get_cache_tensors(dev)):
            t.copy_(torch.arange(32, dtype=torch.float32).reshape(8, 4) + 100 * i)
        cm.copy_blocks(dev, {1: [6, 7]})
        cm.swap_blocks(dev, host, {6: 0, 2: 5})
        print("devices", sorted({str(t.device) for t in cm.get_cache_tensors(dev)}),
              sorted({str(t.device) for t in cm.get_cache_tensors(host)}))
        print("host", cm.get_cache_tensors(host)[1][0].tolist(), cm.get_cache_tensors(host)[0][5].tolist())
        reg = [torch.zeros(8, 4, device="npu") for _ in range(2)]
        cache = cm.register_blocks_cache(CacheDesc(2, [8, 4], DataType.DT_FLOAT), reg)
        cm.swap_blocks(host, cache, {0: 3})
        print("registered", reg[1].cpu()[3].tolist())
        by_address = cm.register_blocks_cache(CacheDesc(2, [8, 4], DataType.DT_FLOAT), [t.data_ptr() for t in reg])
        cm.swap_blocks(host, by_address, {0: 2})
        print("by address", reg[0].cpu()[2].tolist())
        engine.finalize()
        print("set_device", [c for c in torch.npu.calls if c[0] == "set_device"])
    """))
    assert "devices ['npu:0'] ['cpu']" in out, out
    assert "host [104.0, 105.0, 106.0, 107.0] [8.0, 9.0, 10.0, 11.0]" in out, out
    assert "registered [104.0, 105.0, 106.0, 107.0]" in out and "by address [4.0, 5.0, 6.0, 7.0]" in out, out
    device_calls = out.split("set_device ", 1)[1]
    assert "('set_device', 0, 'datadist-agent" in device_calls and "MainThread" not in device_calls, out


def test_ems_v0_saves_and_loads_npu_buffers(npu_env: dict, ems_pool_dir: str) -> None:
    out = ok(run({**npu_env, "EMS_SERVER": ems_pool_dir}, """
        import torch, torch_npu
        from ems import CcConfig_v1, CcKvOption, Ems, EmsConfig, KvBufferWrapper, PrimaryKey
        Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id="npu-v0")))
        cc = Ems.get_cc()
        k, v = (torch.arange(256, dtype=torch.int16).to("npu") + i for i in (0, 1000))
        values = [[KvBufferWrapper(k.data_ptr, 512), KvBufferWrapper(v.data_ptr, 512)]]
        option = CcKvOption(timeout=5000)
        print(cc.save(option, [PrimaryKey("r1", "layer0")], values))
        want = (k.cpu().clone(), v.cpu().clone())
        k.zero_(), v.zero_()
        print(cc.load(option, [PrimaryKey("r1", "layer0")], values))
        print("equal", torch.equal(k.cpu(), want[0]) and torch.equal(v.cpu(), want[1]))
    """))
    assert out.count("CcResult(success=1, total=1)") == 2 and "equal True" in out, out


def test_ems_saves_and_loads_npu_caches(npu_env: dict, ems_pool_dir: str) -> None:
    out = ok(run({**npu_env, "EMS_SERVER": ems_pool_dir}, """
        import torch, torch_npu
        from ems import CcConfig_v1, CcKvOption, Ems, EmsConfig
        Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id="npu-test")))
        cc = Ems.get_cc()
        kv = [[(torch.arange(8 * 4 * 2 * 16, dtype=torch.float16).reshape(8, 4, 2, 16) + 100 * (2 * l + k)).to("npu")
               for k in range(2)] for l in range(2)]
        cc.register_kvcache(kv)
        option = CcKvOption(timeout=5000)
        print(cc.save(slot_mapping=list(range(8)), hashes=[11, 22], offsets=[4, 4], option=option))
        expected = [[t[:2].cpu().clone() for t in layer] for layer in kv]
        for layer in kv:
            for t in layer:
                t.zero_()
        print(cc.load(slot_mapping=list(range(8)), hashes=[11, 22], offsets=[4, 4], option=option))
        print("equal", all(torch.equal(t[:2].cpu(), e) for layer, el in zip(kv, expected) for t, e in zip(layer, el)))
    """))
    assert out.count("CcResult(success=2, total=2)") == 2 and "equal True" in out, out
