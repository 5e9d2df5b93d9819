"""CUDA device caches, on a machine with a GPU (skipped cleanly without one).

The same real processes as the transfer matrix, with ``device_type`` cuda: the device
pool is GPU memory, ``get_cache_tensors`` returns CUDA tensors over it, registered CUDA
tensors are caches, same-host links move device caches by CUDA IPC (checked: the IPC
mapping is open and the path is shm), tcp and gloo stage them through host memory, and
nccl moves them between two GPUs.  Every transfer is checked byte for byte against the
numpy model.  On a machine with a GPU, the rest of the suite also runs on device caches:
its engines use ``device_type`` auto, which picks CUDA there.
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest

from datadist.engine import cuda
from harness import (DECODER_ID, PROMPT_ID, Desc, Peer, Ref, base_config, blocks_key, cache_key, expect_blocks,
                     expect_row_to_blocks, free_port)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180),
              pytest.mark.skipif(not cuda.available(), reason="needs a CUDA device")]

#: 8 tensors (4 layers of K,V) of 8 blocks x 16 tokens x 64 elements.
BLOCKS = Desc(8, (8, 16, 64), "fp16")
ROWS = Desc(8, (2, 64, 64), "fp16")
HOST_BLOCKS = Desc(8, (8, 16, 64), "fp16", "HOST")
GPU_BLOCKS = Desc(8, (8, 16, 64), "fp16", device="cuda:0")


def _gpu_config(transport: str, **kw: Any) -> Dict[str, Any]:
    return base_config(transport, device_type="cuda", **kw)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _pair(peer_factory, transport: str, prompt_device: int = 0, decoder_device: int = 0):
    port = free_port()
    prompt = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID,
                          _gpu_config(transport, listen_port=port, device_id=prompt_device))
    decoder = peer_factory("peer", "decoder", "DECODER", DECODER_ID, _gpu_config(transport, device_id=decoder_device))
    prompt.wait_ready()
    decoder.wait_ready()
    decoder.link(prompt)
    return prompt, decoder


def test_device_pool_caches_are_gpu_memory_and_local_copies_work(peer_factory) -> None:
    peer: Peer = peer_factory("peer", "mix", "MIX", PROMPT_ID, _gpu_config("shm")).wait_ready()
    peer.alloc("dev", BLOCKS, blocks=True)
    info = peer.call("tensor_info", "dev")
    assert {t["device"] for t in info} == {"cuda:0"}
    assert [t["ptr"] for t in info] == [info[0]["ptr"] + i * BLOCKS.tensor_bytes for i in range(8)]
    dev = peer.fill("dev", BLOCKS, 1)
    np.testing.assert_array_equal(peer.read("dev"), dev)

    peer.cm("copy_blocks", Ref("dev"), {0: [3, 5], 6: [7]})
    want = expect_blocks(dev, dev, [0, 0, 6], [3, 5, 7], BLOCKS.row_bytes, n=1)
    np.testing.assert_array_equal(peer.read("dev"), want)

    peer.alloc("host", HOST_BLOCKS, blocks=True)
    assert {t["device"] for t in peer.call("tensor_info", "host")} == {"cpu"}
    host = peer.fill("host", HOST_BLOCKS, 2)
    peer.cm("swap_blocks", Ref("dev"), Ref("host"), {1: 2, 4: 0})        # device -> host
    host_want = expect_blocks(host, want, [1, 4], [2, 0], BLOCKS.row_bytes, n=1)
    np.testing.assert_array_equal(peer.read("host"), host_want)
    peer.cm("swap_blocks", Ref("host"), Ref("dev"), {5: 6})               # host -> device
    np.testing.assert_array_equal(peer.read("dev"), expect_blocks(want, host_want, [5], [6], BLOCKS.row_bytes, n=1))


def test_registered_cuda_tensors_are_caches(peer_factory) -> None:
    peer: Peer = peer_factory("peer", "mix", "MIX", PROMPT_ID, _gpu_config("shm")).wait_ready()
    peer.register("user", GPU_BLOCKS, blocks=True)
    assert {t["device"] for t in peer.call("tensor_info", "user")} == {"cuda:0"}
    data = peer.fill("user", GPU_BLOCKS, 3)
    peer.cm("copy_blocks", Ref("user"), {2: [0]})
    np.testing.assert_array_equal(peer.read("user"), expect_blocks(data, data, [2], [0], BLOCKS.row_bytes, n=1))


def test_create_tensors_views_device_memory() -> None:
    import torch

    from datadist import DataType, create_tensors

    owner = torch.arange(64, dtype=torch.int32, device="cuda:0")
    (view,) = create_tensors([4, 16], DataType.DT_INT32, [owner.data_ptr()], "cuda:0")
    assert view.device == owner.device and view.data_ptr() == owner.data_ptr() and view.shape == (4, 16)
    view[1, 0] = -5
    torch.cuda.synchronize()
    assert int(owner[16]) == -5


@pytest.mark.parametrize("dst_kind", ["alloc", "register"])
@pytest.mark.parametrize("transport", ["shm", "tcp", "gloo"])
def test_device_caches_move_between_processes(peer_factory, transport: str, dst_kind: str) -> None:
    prompt, decoder = _pair(peer_factory, transport)
    prompt.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    src = prompt.fill("src", BLOCKS, 4)
    if dst_kind == "alloc":
        made = decoder.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 2))
    else:
        made = decoder.register("dst", GPU_BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 2))
    dst = decoder.fill("dst", BLOCKS, 5)

    # pull, scattered, over a layer range
    decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [5, 0, 7], [1, 6, 3],
               src_layer_range=range(1, 3), dst_layer_range=range(2, 4))
    dst = expect_blocks(dst, src, [5, 0, 7], [1, 6, 3], BLOCKS.row_bytes, src_layers=range(1, 3),
                        dst_layers=range(2, 4))
    np.testing.assert_array_equal(decoder.read("dst"), dst)
    # push, in order, all layers
    prompt.cm("push_blocks", blocks_key(DECODER_ID, 2), Ref("src"), [0, 1, 2], [4, 5, 6])
    dst = expect_blocks(dst, src, [0, 1, 2], [4, 5, 6], BLOCKS.row_bytes)
    np.testing.assert_array_equal(decoder.read("dst"), dst)
    np.testing.assert_array_equal(prompt.read("src"), src)
    assert made["cache_id"] > 0

    links = decoder.call("links")[PROMPT_ID]
    assert links["path"] == transport
    if transport == "shm":  # the prompt's device pool is mapped here: no socket involved
        assert links["ipc_open"] >= 1


def test_row_of_a_device_cache_into_device_blocks_over_shm(peer_factory) -> None:
    prompt, decoder = _pair(peer_factory, "shm")
    prompt.alloc("row", ROWS, keys=[cache_key(PROMPT_ID, 11), cache_key(PROMPT_ID, 12)])
    rows = prompt.fill("row", ROWS, 6)
    decoder.alloc("dst", BLOCKS, blocks=True)
    dst = decoder.fill("dst", BLOCKS, 7)
    decoder.cm("pull_blocks", cache_key(PROMPT_ID, 12), Ref("dst"), (), [7, 2, 0, 5])
    want = expect_row_to_blocks(dst, rows, 1, ROWS.row_bytes, [7, 2, 0, 5], BLOCKS.row_bytes)
    np.testing.assert_array_equal(decoder.read("dst"), want)


@pytest.mark.skipif(_gpus() < 2 if cuda.available() else True, reason="needs two CUDA devices")
def test_nccl_moves_device_caches_between_two_gpus(peer_factory) -> None:
    prompt, decoder = _pair(peer_factory, "nccl", prompt_device=0, decoder_device=1)
    prompt.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    src = prompt.fill("src", BLOCKS, 8)
    decoder.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 2))
    dst = decoder.fill("dst", BLOCKS, 9)
    decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [3, 1], [0, 7])
    dst = expect_blocks(dst, src, [3, 1], [0, 7], BLOCKS.row_bytes)
    prompt.cm("push_blocks", blocks_key(DECODER_ID, 2), Ref("src"), [6], [2])
    dst = expect_blocks(dst, src, [6], [2], BLOCKS.row_bytes)
    np.testing.assert_array_equal(decoder.read("dst"), dst)
    assert {t["device"] for t in decoder.call("tensor_info", "dst")} == {"cuda:1"}


@pytest.mark.parametrize("runs", [[(0, 1 << 15)], [(3, 5000), (9001, 777)], [(8192, 4096), (0, 4096)]],
                         ids=["whole", "unaligned", "scattered"])
def test_device_halves_are_summed_on_the_gpu_as_the_c_loops_sum_them(runs) -> None:
    import torch

    from datadist.engine import native
    from datadist.engine.checksum import StreamSum
    from datadist.engine.transports.device_sum import device_checksum

    gen = torch.Generator(device="cuda:0").manual_seed(3)
    tensors = [torch.randint(0, 256, (1 << 15,), dtype=torch.uint8, device="cuda:0", generator=gen) for _ in range(5)]
    hosts = [t.cpu().numpy() for t in tensors]
    offs = np.array([o for o, _ in runs], dtype=np.uint64)
    lens = np.array([n for _, n in runs], dtype=np.uint64)
    on_host = StreamSum(int(lens.sum()) * len(hosts))
    native.sum_plan(np.array([h.ctypes.data for h in hosts], dtype=np.uint64), offs, lens, on_host)
    bases = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
    for group in (1, 1 << 14, 1 << 30):
        assert device_checksum(bases, offs, lens, "cuda:0", group_bytes=group) == on_host.checksum()


#: 8 tensors of 8 blocks of 512 KiB (32 MiB of the 64 MiB pools): a pull of 5 blocks
#: (20 MiB) or a push of 4 (16 MiB) is summed on the GPU.
BIG_BLOCKS = Desc(8, (8, 256, 1024), "fp16")
BIG_HOST_BLOCKS = Desc(8, (8, 256, 1024), "fp16", "HOST")


@pytest.mark.parametrize("prompt_desc", [BIG_BLOCKS, BIG_HOST_BLOCKS], ids=["device", "host"])
def test_checked_shm_copies_of_device_caches(peer_factory, prompt_desc: Desc) -> None:
    """``transfer_checksum`` over shm with a device cache on the decoder: its copies of
    16 MiB and more are summed on the GPU and compared with the prompt's sums of the same runs (on
    the GPU for a device cache, by the C loops for a host one), so the two agree on real
    transfers."""
    port = free_port()
    prompt = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID,
                          _gpu_config("shm", listen_port=port, sync_kv_timeout=10000))
    decoder = peer_factory("peer", "decoder", "DECODER", DECODER_ID,
                           _gpu_config("shm", transfer_checksum=True, sync_kv_timeout=10000))
    prompt.wait_ready()
    decoder.wait_ready()
    decoder.link(prompt, port=port)
    prompt.alloc("src", prompt_desc, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    src = prompt.fill("src", prompt_desc, 10)
    decoder.alloc("dst", BIG_BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 2))
    dst = decoder.fill("dst", BIG_BLOCKS, 11)
    decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [5, 0, 7, 2, 4], [1, 6, 3, 0, 2])
    dst = expect_blocks(dst, src, [5, 0, 7, 2, 4], [1, 6, 3, 0, 2], BIG_BLOCKS.row_bytes)
    np.testing.assert_array_equal(decoder.read("dst"), dst)
    decoder.cm("push_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [1, 6, 3, 0], [2, 4, 5, 7])
    want = expect_blocks(src, dst, [1, 6, 3, 0], [2, 4, 5, 7], BIG_BLOCKS.row_bytes)
    np.testing.assert_array_equal(prompt.read("src"), want)
    assert decoder.call("links")[PROMPT_ID]["path"] == "shm"
