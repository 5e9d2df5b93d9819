"""The fake NPU where users touch it, NPU memory registered by address, and CANN's
llm_datadist samples on it.

The device: autoloaded by ``import torch`` through torch's ``torch.backends`` entry point
as torch_npu is; 8 devices narrowed by ``ASCEND_RT_VISIBLE_DEVICES``; per-thread current
device; per-device memory; a host read of device memory faults even while a copy of that
very memory runs; the asynchronous stream mode turns a missing synchronization into wrong
bytes.  Registration: int addresses (``tensor.data_ptr()``) on an NPU engine resolve to
the torch_npu allocation they lie in, an address in none is ``LLM_PARAM_INVALID``.  The
samples (hicann/hixl ``examples/python/llm_datadist``) run as our own scenarios making the
same calls in the same order (``vendor_shaped.py``), the prompt on device 0, the decoder
on device 1.  Each property runs in a process of its own.
"""
from __future__ import annotations

import signal

import pytest

from fake_npu_env import ok, run
from test_vendor_shaped import run_scenario

pytestmark = [pytest.mark.fake_npu, pytest.mark.timeout(300)]


# ---------------------------------------------------------------------------- the device
def test_import_torch_autoloads_the_npu_backend(npu_env: dict) -> None:
    out = ok(run(npu_env, """
        import sys, torch
        print("loaded", "torch_npu" in sys.modules, torch.npu.device_count(), torch.ones(2).npu().device)
    """))
    assert out.split() == ["loaded", "True", "8", "npu:0"], out
    off = ok(run(npu_env, """
        import sys, torch
        print("loaded", "torch_npu" in sys.modules, hasattr(torch, "npu"))
    """, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert off.split() == ["loaded", "False", "False"], off


def test_visible_devices_follow_ascend_rt_visible_devices(npu_env: dict) -> None:
    out = ok(run(npu_env, """
        import torch
        print("count", torch.npu.device_count())
        torch.npu.set_device(1)
        try:
            torch.npu.set_device(2)
        except RuntimeError as exc:
            print("refused", "does not exist" in str(exc))
    """, ASCEND_RT_VISIBLE_DEVICES="4,6"))
    assert "count 2" in out and "refused True" in out, out


def test_current_device_is_per_thread_and_memory_per_device(npu_env: dict) -> None:
    out = ok(run(npu_env, """
        import threading, torch
        torch.npu.set_device(3)
        a = torch.ones(1024, dtype=torch.uint8).npu()
        b = torch.ones(2048, dtype=torch.uint8, device="npu:5")
        seen = []
        thread = threading.Thread(target=lambda: seen.append((torch.npu.current_device(),
                                                              torch.ones(1).npu().device.index)))
        thread.start(); thread.join()
        segments = {s["address"]: s["device"] for s in torch.npu.memory_snapshot()}
        print("main", torch.npu.current_device(), a.device, b.device, "thread", seen[0])
        print("snapshot", segments[a.data_ptr()], segments[b.data_ptr()],
              torch.npu.memory_allocated(3), torch.npu.memory_allocated(5))
        print("cross", (a.to("npu:5")[:4].cpu() + b[:4].cpu()).tolist())
    """))
    assert "main 3 npu:3 npu:5 thread (0, 0)" in out, out
    assert "snapshot 3 5 1024 2048" in out and "cross [2, 2, 2, 2]" in out, out


def test_a_host_read_racing_a_copy_of_the_same_memory_faults(npu_env: dict) -> None:
    """The copy kernels reach device memory through a mapping of their own: the address
    torch hands out never becomes readable, not even while that memory is being copied."""
    crashed = run(npu_env, """
        import ctypes, threading, torch
        src = torch.ones(1 << 22, dtype=torch.uint8, device="npu")
        dst = torch.empty_like(src)
        copying = threading.Event()
        def copy_forever():
            while True:
                copying.set()
                dst.copy_(src)
        threading.Thread(target=copy_forever, daemon=True).start()
        copying.wait()
        for _ in range(1000):
            ctypes.string_at(src.data_ptr() + 4096, 8)  # a host read of the memory being copied
        print("read device memory from the host")
    """)
    assert crashed.returncode == -signal.SIGSEGV, (crashed.returncode, crashed.stdout, crashed.stderr[-2000:])


def test_the_async_stream_shows_a_missing_synchronization(npu_env: dict) -> None:
    out = ok(run(npu_env, """
        import torch
        src = torch.full((64,), 9.0).npu()
        dst = torch.zeros(64, device="npu")
        side = torch.npu.Stream()
        with torch.npu.stream(side):
            dst.copy_(src)                      # queued on the side stream
        print("unsynchronized", dst.cpu()[0].item(), torch.npu.queued())
        side.synchronize()
        print("synchronized", dst.cpu()[0].item(), torch.npu.queued())
        host = torch.zeros(64)
        host.copy_(src, non_blocking=True)      # a non-blocking device-to-host copy
        print("host before", host[0].item())
        torch.npu.synchronize()
        print("host after", host[0].item())
    """, FAKE_NPU_ASYNC="1"))
    assert "unsynchronized 0.0 1" in out and "synchronized 9.0 0" in out, out
    assert "host before 0.0" in out and "host after 9.0" in out, out


def test_a_device_address_wraps_through_torch_npus_storage_route(npu_env: dict) -> None:
    out = ok(run(npu_env, """
        import torch, torch_npu
        t = torch.arange(16, dtype=torch.float32).npu()
        dev = t.device
        storage = torch_npu._C._construct_storage_from_data_pointer(t.data_ptr() + 16, dev, 16)
        w = torch_npu._C._construct_NPU_Tensor_From_Storage_And_Metadata(
            {"dtype": torch.float32, "device": dev, "size": (4,), "stride": (1,), "storage_offset": 0}, storage)
        print("wrapped", w.device, w.cpu().tolist())
        w.fill_(-1)
        print("through", t.cpu()[3:9].tolist())
        stray = torch_npu._C._construct_storage_from_data_pointer(0x1000, dev, 16)
        bad = torch_npu._C._construct_NPU_Tensor_From_Storage_And_Metadata(
            {"dtype": torch.float32, "device": dev, "size": (4,), "stride": (1,), "storage_offset": 0}, stray)
        try:
            bad.cpu()
        except RuntimeError as exc:
            print("stray", "is not device memory" in str(exc))
    """))
    assert "wrapped npu:0 [4.0, 5.0, 6.0, 7.0]" in out and "through [3.0, -1.0, -1.0, -1.0, -1.0, 8.0]" in out, out
    assert "stray True" in out, out


# ---------------------------------------------------------------------------- addresses
_ENGINE = """
    import json, torch
    from datadist import (Cache, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMException, LLMRole, Placement,
                          create_tensors)
    torch.npu.set_device(1)
    config = LLMConfig()
    config.device_id = 1
    engine = LLMDataDist(LLMRole.MIX, 1)
    engine.init(config.generate_options())
    cm = engine.cache_manager
    desc = CacheDesc(2, [8, 4], DataType.DT_FLOAT)
    def refused(call):
        try:
            call()
        except LLMException as exc:
            return f"{exc.status_code.name}: {exc}"
        return "accepted"
"""


def test_register_blocks_cache_by_address_reaches_the_npu_memory(npu_env: dict) -> None:
    out = ok(run(npu_env, _ENGINE + """
    reg = [torch.arange(32, dtype=torch.float32).reshape(8, 4).npu() + 100 * i for i in range(2)]
    cache = cm.register_blocks_cache(desc, [int(t.data_ptr()) for t in reg])
    host = [torch.zeros(8, 4) for _ in range(2)]
    host_cache = Cache.create_cpu_cache(CacheDesc(2, [8, 4], DataType.DT_FLOAT, Placement.HOST),
                                        [t.data_ptr() for t in host])
    cm.swap_blocks(cache, host_cache, {3: 0})
    cm.copy_blocks(cache, {1: [6]})
    print("swapped", host[1][0].tolist(), "copied", reg[0].cpu()[6].tolist())
    print("tensors", [str(t.device) for t in cm.get_cache_tensors(cache)])
    engine.finalize()
    """))
    assert "swapped [112.0, 113.0, 114.0, 115.0] copied [4.0, 5.0, 6.0, 7.0]" in out, out
    assert "tensors ['npu:1', 'npu:1']" in out, out


def test_register_cache_by_address_moves_rows(npu_env: dict) -> None:
    out = ok(run(npu_env, _ENGINE + """
    rows = [torch.arange(32, dtype=torch.float32).reshape(8, 4).npu() for _ in range(2)]
    cache = cm.register_cache(desc, [t.data_ptr() for t in rows])
    host = [torch.zeros(8, 4) for _ in range(2)]
    host_cache = Cache.create_cpu_cache(CacheDesc(2, [8, 4], DataType.DT_FLOAT, Placement.HOST),
                                        [t.data_ptr() for t in host])
    cm.copy_cache(host_cache, cache, 0, 5)
    print("row", host[1][0].tolist())
    engine.finalize()
    """))
    assert "row [20.0, 21.0, 22.0, 23.0]" in out, out


def test_an_address_in_no_npu_allocation_is_param_invalid(npu_env: dict) -> None:
    out = ok(run(npu_env, _ENGINE + """
    t = torch.ones(8, 4).npu()
    host = torch.ones(8, 4)
    on_device_0 = torch.ones(8, 4, device="npu:0")
    gone = torch.ones(8, 4).npu()
    gone_addr = gone.data_ptr()
    del gone
    for name, addrs in (("host", [host.data_ptr(), host.data_ptr()]),
                        ("past the end", [t.data_ptr() + 64, t.data_ptr()]),
                        ("another device", [on_device_0.data_ptr(), on_device_0.data_ptr()]),
                        ("freed", [gone_addr, gone_addr])):
        print(name, "|", refused(lambda: cm.register_blocks_cache(desc, addrs)))
    engine.finalize()
    """))
    lines = [line for line in out.splitlines() if "|" in line]
    assert len(lines) == 4, out
    for line in lines:
        assert "| LLM_PARAM_INVALID: addrs[0]" in line and "not inside a live torch_npu allocation on npu:1" in line, out


def test_create_tensors_over_an_npu_address(npu_env: dict) -> None:
    out = ok(run(npu_env, _ENGINE + """
    t = torch.arange(16, dtype=torch.float32).npu()
    (view,) = create_tensors([2, 4], DataType.DT_FLOAT, [t.data_ptr() + 32], "npu:1")
    print("view", view.device, view.cpu().tolist())
    view.zero_()
    print("owner", t.cpu()[7:13].tolist())
    print("host", refused(lambda: create_tensors([4], DataType.DT_FLOAT, [torch.ones(4).data_ptr()], "npu:1"))[:17])
    engine.finalize()
    """))
    assert "view npu:1 [[8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]]" in out, out
    assert "owner [7.0, 0.0, 0.0, 0.0, 0.0, 0.0]" in out and "host LLM_PARAM_INVALID" in out, out


# ---------------------------------------------------------------------------- the samples
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name, world, ports", [
    ("push_from_decoder", 2, 1),        # push_blocks_sample.py
    ("rank_table_pull_and_swap", 2, 1),  # pull_blocks_sample.py
    ("push_cache_by_index", 2, 1),      # push_cache_sample.py
    ("pull_cache_by_keys", 2, 1),       # pull_cache_sample.py
    ("cache_rows_to_blocks", 2, 1),     # pull_from_cache_to_blocks.py
    ("async_whole_cache", 2, 2),        # transfer_cache_async_sample.py
    ("switch_roles", 2, 1),             # switch_role_sample.py
    ("link_both_ways", 2, 2),           # hixl_transfer_backend_sample.py
    ("two_prompts_two_decoders", 4, 4),  # pull_blocks_xpyd_sample.py
])
def test_cann_sample_on_npus(npu_env: dict, name: str, world: int, ports: int) -> None:
    run_scenario(name, world, ports, {**npu_env, "VENDOR_DEVICE": "npu"})

