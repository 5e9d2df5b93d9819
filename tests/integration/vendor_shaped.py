"""Client programs in the shape of CANN's published llm_datadist samples, written against
``import llm_datadist`` exactly as those samples use it (torch tensors registered by
address with ``Placement.DEVICE``, a gloo process group for barriers, ``link_clusters`` or
``link`` with a rank table, fixed roles and cluster ids).  Only what cannot run here
changed: addresses are loopback and ports are given.  Tensors are CPU tensors, or with
``VENDOR_DEVICE=npu`` NPU tensors (``.npu()``, each process's device its rank, made current
with ``torch.npu.set_device`` before anything else as the samples do; ``torch.npu`` comes
from torch's backend autoload, as with torch_npu: nothing here imports torch_npu).

Run as ``python vendor_shaped.py SCENARIO RANK WORLD PORTS`` with ``MASTER_ADDR`` and
``MASTER_PORT`` set; ``PORTS`` is a comma-separated list of free ports.  Exit code 0 means
every check of the scenario held; anything else raises with a message.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from llm_datadist import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType,
                          LayerSynchronizer, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole, LLMStatusCode, Placement,
                          RegisterMemStatus, TransferWithCacheKeyConfig)

IP = "127.0.0.1"
BLOCKS_NUM = 3
KV_SHAPE = 10
NPU = os.environ.get("VENDOR_DEVICE", "cpu") == "npu"
DEVICE_ID = [0]  # this process's device: its rank on NPUs, else 0


def dev(tensor: torch.Tensor) -> torch.Tensor:
    """Where the samples put their caches: ``tensor.npu()`` (here: on NPUs only)."""
    return tensor.npu() if NPU else tensor


def barrier() -> None:
    dist.barrier()


def make_engine(role: LLMRole, cluster_id: int, listen: str = "", backend: str = "",
                cache_manager: bool = False, pool: int = 0) -> LLMDataDist:
    engine = LLMDataDist(role, cluster_id)
    config = LLMConfig()
    config.device_id = DEVICE_ID[0]
    config.local_comm_res = ""
    if pool:
        config.mem_pool_cfg = f'{{"memory_size": {pool}}}'
    if cache_manager:
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
    if backend:
        config.transfer_backend = backend
    if listen:
        config.listen_ip_info = listen
    engine.init(config.generate_options())
    return engine


def register(engine: LLMDataDist, tensors, key) -> Cache:
    desc = CacheDesc(num_tensors=len(tensors), shape=list(tensors[0].shape), data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    return engine.cache_manager.register_blocks_cache(desc, [int(t.data_ptr()) for t in tensors], key)


def cluster(remote_id: int, remote_port: int, local_port: int = 0) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_id
    info.append_local_ip_info(IP, local_port)
    info.append_remote_ip_info(IP, remote_port)
    return info


def ok(ret) -> None:
    status, _ = ret
    if status != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"expected LLM_SUCCESS, got {status}")


def expect(tensor: torch.Tensor, rows: dict, what: str) -> None:
    for row, value in rows.items():
        got = tensor[row].cpu()
        if not torch.equal(got, torch.full((KV_SHAPE,), float(value))):
            raise AssertionError(f"{what}: row {row} is {got.tolist()}, expected all {value}")


# ---------------------------------------------------------------------------- scenarios

def push_from_decoder(rank: int, ports: list) -> None:
    """The push_blocks sample: the DECODER links to the prompt and pushes into it."""
    prompt_id, decoder_id = 0, 1
    if rank == 0:
        engine = make_engine(LLMRole.PROMPT, prompt_id, f"{IP}:{ports[0]}")
        tensors = [dev(torch.ones(BLOCKS_NUM, KV_SHAPE)), dev(torch.ones(BLOCKS_NUM, KV_SHAPE))]
        cache = register(engine, tensors, BlocksCacheKey(prompt_id, 0))
        barrier()  # registered
        barrier()  # the decoder pushed
        for t in tensors:
            expect(t, {0: 0, 1: 1, 2: 0}, "prompt after the decoder's push")
        ok(engine.unlink_clusters([cluster(decoder_id, 0)], 5000, force=True))
    else:
        engine = make_engine(LLMRole.DECODER, decoder_id)
        tensors = [dev(torch.zeros(BLOCKS_NUM, KV_SHAPE)), dev(torch.zeros(BLOCKS_NUM, KV_SHAPE))]
        cache = register(engine, tensors, BlocksCacheKey(decoder_id, 0))
        barrier()
        ok(engine.link_clusters([cluster(prompt_id, ports[0])], 5000))
        engine.cache_manager.push_blocks(BlocksCacheKey(prompt_id, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])
        barrier()
        ok(engine.unlink_clusters([cluster(prompt_id, ports[0])], 5000, force=True))
    engine.cache_manager.unregister_cache(cache.cache_id)
    engine.finalize()


def link_both_ways(rank: int, ports: list) -> None:
    """The hixl backend sample: both ends listen and link to each other; the prompt pulls,
    the decoder pushes, both unlink their own link."""
    me, peer = rank, 1 - rank
    engine = make_engine(LLMRole.PROMPT if rank == 0 else LLMRole.DECODER, me, f"{IP}:{ports[me]}", backend="hixl")
    tensors = [dev(torch.full((BLOCKS_NUM, KV_SHAPE), float(1 - rank))) for _ in range(2)]
    cache = register(engine, tensors, BlocksCacheKey(me, 0))
    barrier()  # registered
    ok(engine.link_clusters([cluster(peer, ports[peer], ports[me])], 5000))
    if rank == 0:
        engine.cache_manager.pull_blocks(BlocksCacheKey(peer, 0), cache, src_blocks=[2], dst_blocks=[2])
    else:
        engine.cache_manager.push_blocks(BlocksCacheKey(peer, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1])
    barrier()  # both transfers done
    ok(engine.unlink_clusters([cluster(peer, ports[peer])], 5000))
    barrier()  # both unlinked
    if rank == 0:
        for t in tensors:
            expect(t, {0: 0, 1: 0, 2: 0}, "prompt after its pull and the decoder's push")
    engine.cache_manager.unregister_cache(cache.cache_id)
    engine.finalize()


def switch_roles(rank: int, ports: list) -> None:
    """The switch_role sample: the decoder pulls from the prompt, then both switch roles
    and the old decoder listens on the very ip:port the old prompt gave up."""
    port = ports[0]
    prompt_id, decoder_id = 0, 1
    if rank == 0:
        engine = make_engine(LLMRole.PROMPT, prompt_id, f"{IP}:{port}")
        tensors = [dev(torch.ones(BLOCKS_NUM, KV_SHAPE)), dev(torch.ones(BLOCKS_NUM, KV_SHAPE))]
        cache = register(engine, tensors, BlocksCacheKey(prompt_id, 0))
        barrier()  # registered
        barrier()  # the decoder pulled and unlinked
        engine.switch_role(LLMRole.DECODER)
        barrier()  # switched; the port is free
        barrier()  # the other end listens there now
        ok(engine.link_clusters([cluster(decoder_id, port, port)], 5000))
        barrier()  # linked
        barrier()  # it pushed
        for t in tensors:
            expect(t, {0: 2, 1: 2, 2: 2}, "old prompt after the push of the old decoder")
        ok(engine.unlink_clusters([cluster(decoder_id, port)], 5000, force=True))
    else:
        engine = make_engine(LLMRole.DECODER, decoder_id)
        tensors = [dev(torch.zeros(BLOCKS_NUM, KV_SHAPE)), dev(torch.zeros(BLOCKS_NUM, KV_SHAPE))]
        cache = register(engine, tensors, BlocksCacheKey(decoder_id, 0))
        barrier()
        ok(engine.link_clusters([cluster(prompt_id, port, port)], 5000))
        engine.cache_manager.pull_blocks(BlocksCacheKey(prompt_id, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])
        for t in tensors:
            expect(t, {0: 1, 1: 0, 2: 1}, "decoder after its pull")
        ok(engine.unlink_clusters([cluster(prompt_id, port)], 5000))
        barrier()
        barrier()
        config = LLMConfig()
        config.listen_ip_info = f"{IP}:{port}"
        engine.switch_role(LLMRole.PROMPT, config.generate_options())
        barrier()
        barrier()
        for t in tensors:
            t.fill_(2.0)
        engine.cache_manager.push_blocks(BlocksCacheKey(prompt_id, 0), cache, src_blocks=[0, 1, 2],
                                         dst_blocks=[0, 1, 2], src_layer_range=range(0, 2),
                                         dst_layer_range=range(0, 2), tensor_num_per_layer=1)
        barrier()
        ok(engine.unlink_clusters([cluster(prompt_id, port)], 5000, force=True))
    engine.cache_manager.unregister_cache(cache.cache_id)
    engine.finalize()


def _ip_port_id(port: int) -> int:
    # the xpyd sample names clusters by ip:port packed into one integer
    return (0x7F000001 << 16) | port


def two_prompts_two_decoders(rank: int, ports: list) -> None:
    """The xpyd sample: one-tensor caches; two decoders (not listening) link to both
    prompts at once, each with one ``link_clusters`` of both and the sample's 5 s, and pull
    the same blocks from each; tensor_num_per_layer keeps its default of 2.  Over HCCL a
    communicator takes seconds to form (the fake's 2 s), so the list links in parallel
    and a prompt forms one decoder's while it serves the other's requests."""
    if rank < 2:
        me = _ip_port_id(ports[rank])
        engine = make_engine(LLMRole.PROMPT, me, f"{IP}:{ports[rank]}")
        tensor = dev(torch.full((BLOCKS_NUM, KV_SHAPE), float(rank + 1)))
        cache = register(engine, [tensor], BlocksCacheKey(me, 0))
        barrier()  # registered
        barrier()  # the decoders are done
    else:
        me = _ip_port_id(ports[rank])
        engine = make_engine(LLMRole.DECODER, me)
        tensor = dev(torch.zeros(BLOCKS_NUM, KV_SHAPE))
        cache = register(engine, [tensor], BlocksCacheKey(me, 0))
        barrier()
        clusters = [cluster(_ip_port_id(p), p) for p in ports[:2]]
        ok(engine.link_clusters(clusters, 5000))
        for i, p in enumerate(ports[:2]):
            engine.cache_manager.pull_blocks(BlocksCacheKey(_ip_port_id(p), 0), cache, src_blocks=[0, 1],
                                             dst_blocks=[0, 2])
            expect(tensor, {0: i + 1, 1: 0, 2: i + 1}, f"decoder {rank} after pulling from prompt {i}")
        ok(engine.unlink_clusters(clusters, 5000))
        barrier()
    engine.cache_manager.unregister_cache(cache.cache_id)
    engine.finalize()


class _Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis) -> bool:
        return True


def async_whole_cache(rank: int, ports: list) -> None:
    """The transfer_cache_async sample: a blocks-registered source, layer ranges, and no
    block indices: the whole cache goes, block i to block i."""
    prompt_id, decoder_id = 0, 1
    if rank == 0:
        engine = make_engine(LLMRole.PROMPT, prompt_id, f"{IP}:{ports[1]}", cache_manager=True)
        tensors = [dev(torch.arange(BLOCKS_NUM * KV_SHAPE, dtype=torch.float32).reshape(BLOCKS_NUM, KV_SHAPE)
                       + 100 * i) for i in range(2)]
        cache = register(engine, tensors, BlocksCacheKey(prompt_id, 0))
        barrier()
        ok(engine.link_clusters([cluster(decoder_id, ports[0], ports[1])], 5000))
        config = TransferWithCacheKeyConfig(BlocksCacheKey(decoder_id, 0), range(0, 1), range(0, 1))
        results = engine.cache_manager.transfer_cache_async(cache, _Ready(), [config]).get_results()
        if results != [LLMStatusCode.LLM_SUCCESS]:
            raise RuntimeError(f"transfer_cache_async results {results}")
        barrier()
        ok(engine.unlink_clusters([cluster(decoder_id, ports[0])], 5000, force=True))
    else:
        engine = make_engine(LLMRole.DECODER, decoder_id, f"{IP}:{ports[0]}", cache_manager=True)
        tensors = [dev(torch.zeros(BLOCKS_NUM, KV_SHAPE)) for _ in range(2)]
        cache = register(engine, tensors, BlocksCacheKey(decoder_id, 0))
        barrier()
        barrier()  # the prompt's task is done
        for i, t in enumerate(tensors):
            want = torch.arange(BLOCKS_NUM * KV_SHAPE, dtype=torch.float32).reshape(BLOCKS_NUM, KV_SHAPE) + 100 * i
            if not torch.equal(t.cpu(), want):
                raise AssertionError(f"decoder tensor {i} is {t.cpu().tolist()}")
        ok(engine.unlink_clusters([cluster(prompt_id, ports[1])], 5000, force=True))
    engine.cache_manager.unregister_cache(cache.cache_id)
    engine.finalize()


def domain(engine: LLMDataDist, port: int) -> int:
    """The samples' ``link``: a comm domain of clusters 1 and 2 from CANN's single-host rank
    table ("port", our addition, default HCCL's 16666, keeps parallel runs apart), polled
    with ``query_register_mem_status`` until it is up."""
    table = {"server_count": "1", "status": "completed", "version": "1.2", "port": port, "server_list": [
        {"host_ip": IP, "server_id": "1", "device": [
            {"device_id": "0", "device_ip": IP, "rank_id": "0"},
            {"device_id": "1", "device_ip": IP, "rank_id": "1"}]}]}
    comm_id = engine.link("link", {1: 0, 2: 1}, json.dumps(table))
    deadline = time.monotonic() + 30
    while engine.query_register_mem_status(comm_id) != RegisterMemStatus.OK:
        if engine.query_register_mem_status(comm_id) == RegisterMemStatus.FAILED or time.monotonic() > deadline:
            raise RuntimeError("comm domain did not come up")
        time.sleep(0.05)  # the sample polls too
    return comm_id


def rank_table_pull_and_swap(rank: int, ports: list) -> None:
    """The pull_blocks sample: a comm domain from a rank table, a one-tensor cache pulled by
    the decoder (default tensor_num_per_layer), then swapped out to a CPU cache and back."""
    cluster_id = rank + 1
    engine = make_engine(LLMRole.PROMPT if rank == 0 else LLMRole.DECODER, cluster_id, cache_manager=True)
    desc = CacheDesc(num_tensors=1, shape=[2, 1024], data_type=DataType.DT_FLOAT, placement=Placement.DEVICE)
    tensor = dev(torch.full((2, 1024), 7.0) if rank == 0 else torch.zeros(2, 1024))
    key = BlocksCacheKey(1, 0) if rank == 0 else None
    cache = engine.cache_manager.register_blocks_cache(desc, [int(tensor.data_ptr())], key)
    comm_id = domain(engine, ports[0])
    barrier()  # cache ready
    if rank == 1:
        engine.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1])
        if not torch.equal(tensor.cpu(), torch.full((2, 1024), 7.0)):
            raise AssertionError("decoder did not receive the prompt's blocks")
        host = torch.zeros(2, 1024)
        host_desc = CacheDesc(num_tensors=1, shape=[2, 1024], data_type=DataType.DT_FLOAT, placement=Placement.HOST)
        host_cache = Cache.create_cpu_cache(host_desc, [int(host.data_ptr())])
        engine.cache_manager.swap_blocks(cache, host_cache, {0: 0, 1: 1})
        tensor.zero_()
        engine.cache_manager.swap_blocks(host_cache, cache, {0: 0, 1: 1})
        if not torch.equal(tensor.cpu(), torch.full((2, 1024), 7.0)) or not torch.equal(host, tensor.cpu()):
            raise AssertionError("swap out and in did not round-trip")
    barrier()  # pulled
    engine.unlink(comm_id)
    barrier()
    engine.finalize()


def adapter_pair_domains(rank: int, ports: list) -> None:
    """The way vllm-ascend's connector links: one two-member comm domain per prefill and
    decoder pair (the prefill always rank 0), its rank table naming servers by
    ``server_id`` and devices by ``device_id``; two prefills on this host, one decoder
    that joins both domains and pulls MLA-style (two caches, model ids 0 and 1)."""
    base = ports[0]
    devices = {0: "0", 1: "1", 2: "2"}  # ranks 0 and 1 are prefills, 2 the decoder
    cluster_ids = {0: 100, 1: 101, 2: 200}

    def table(prefill: int) -> str:
        entry = lambda r, rank_id: {"device_id": devices[r], "device_ip": IP, "rank_id": rank_id}  # noqa: E731
        return json.dumps({"version": "1.2", "server_count": "1", "status": "completed", "port": base,
                           "server_list": [{"server_id": IP, "device": [entry(prefill, "0"), entry(2, "1")]}]})

    role = LLMRole.PROMPT if rank < 2 else LLMRole.DECODER
    engine = LLMDataDist(role, cluster_ids[rank])
    config = LLMConfig()
    config.device_id = rank
    config.sync_kv_timeout = 20000
    config.enable_switch_role = True
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    engine.init(config.generate_options())
    k_normed = [dev(torch.full((BLOCKS_NUM, KV_SHAPE), float(10 * rank + 1))) for _ in range(2)]
    k_pe = [dev(torch.full((BLOCKS_NUM, 4), float(10 * rank + 2))) for _ in range(2)]
    caches = []
    for model_id, tensors in enumerate((k_normed, k_pe)):
        desc = CacheDesc(len(tensors), [*tensors[0].shape], DataType.DT_FLOAT)
        key = BlocksCacheKey(cluster_id=cluster_ids[rank], model_id=model_id) if rank < 2 else None
        caches.append(engine.cache_manager.register_blocks_cache(desc, [t.data_ptr() for t in tensors], key))
    prefills = [0, 1] if rank == 2 else [rank]
    comm_ids = [engine.link(f"pd_comm_{p}_2", {cluster_ids[p]: 0, cluster_ids[2]: 1}, table(p)) for p in prefills]
    deadline = time.monotonic() + 30
    for comm_id in comm_ids:
        while (status := engine.query_register_mem_status(comm_id=comm_id)) != RegisterMemStatus.OK:
            if status == RegisterMemStatus.FAILED or time.monotonic() > deadline:
                raise RuntimeError(f"comm domain {comm_id} did not come up: {status}")
            time.sleep(0.05)  # the adapter polls too
    barrier()  # linked and registered everywhere
    if rank == 2:
        for p in prefills:
            for model_id, tensors in enumerate((k_normed, k_pe)):
                engine.cache_manager.pull_blocks(BlocksCacheKey(cluster_id=cluster_ids[p], model_id=model_id),
                                                 caches[model_id], [0, 1], [1, 2])
                for t in (t.cpu() for t in tensors):
                    want = float(10 * p + model_id + 1)
                    if not (torch.all(t[1:] == want) and torch.all(t[0] == float(20 + model_id + 1))):
                        raise AssertionError(f"decoder model {model_id} after pulling from prefill {p}: {t.tolist()}")
    barrier()  # pulled
    for comm_id in comm_ids:
        engine.unlink(comm_id)
    barrier()
    engine.finalize()


CACHE_SHAPE = [2, 16 * 1024]
FP16_DESC = CacheDesc(num_tensors=4, shape=CACHE_SHAPE, data_type=DataType.DT_FLOAT16, placement=Placement.DEVICE)


def _row_value(tensor: int, row: int) -> float:
    return float(10 * tensor + row + 1)


def _fill_rows(engine: LLMDataDist, cache: Cache) -> None:
    """Our addition to the samples: rows the receiving end can recognize."""
    for i, t in enumerate(engine.cache_manager.get_cache_tensors(cache)):
        for row in range(t.shape[0]):
            t[row].fill_(_row_value(i, row))


def pull_cache_by_keys(rank: int, ports: list) -> None:
    """The pull_cache sample: a comm domain first, then pool caches; the prompt's two rows
    under cache keys, the decoder pulls each into its own batch index; the prompt removes
    the keys (a no-op once pulled) and frees its cache."""
    engine = make_engine(LLMRole.PROMPT if rank == 0 else LLMRole.DECODER, rank + 1, cache_manager=True,
                         pool=4 << 20)
    comm_id = domain(engine, ports[0])
    keys = [CacheKey(prompt_cluster_id=1, req_id=r, model_id=0) for r in range(2)]
    cache = engine.cache_manager.allocate_cache(FP16_DESC, keys if rank == 0 else [])
    if rank == 0:
        _fill_rows(engine, cache)
    barrier()  # cache ready
    if rank == 1:
        engine.cache_manager.pull_cache(keys[0], cache, batch_index=0)
        engine.cache_manager.pull_cache(keys[1], cache, batch_index=1)
        for i, t in enumerate(engine.cache_manager.get_cache_tensors(cache)):
            for row in range(2):
                if not torch.all(t[row].cpu() == _row_value(i, row)):
                    raise AssertionError(f"decoder tensor {i} row {row} after pull_cache: {t[row].cpu()[:4]}")
    barrier()  # pulled
    engine.unlink(comm_id)
    barrier()  # both unlinked
    if rank == 0:
        for key in keys:
            engine.cache_manager.remove_cache_key(key)
    engine.cache_manager.deallocate_cache(cache)
    engine.finalize()


def cache_rows_to_blocks(rank: int, ports: list) -> None:
    """The pull_from_cache_to_blocks sample: the prompt's pool cache row under a cache key,
    the decoder's registered blocks cache (tensors by address), ``pull_blocks`` with an empty
    ``src_blocks`` into block 0."""
    engine = make_engine(LLMRole.PROMPT if rank == 0 else LLMRole.DECODER, rank + 1, cache_manager=True,
                         pool=4 << 20)
    key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    tensors = []
    if rank == 1:
        tensors = [dev(torch.ones(*CACHE_SHAPE, dtype=torch.float16)) for _ in range(4)]
        cache = engine.cache_manager.register_blocks_cache(FP16_DESC, [t.data_ptr() for t in tensors])
    comm_id = domain(engine, ports[0])
    if rank == 0:
        cache = engine.cache_manager.allocate_cache(FP16_DESC, [key])
        _fill_rows(engine, cache)
    barrier()  # cache ready
    if rank == 1:
        engine.cache_manager.pull_blocks(key, cache, src_blocks=[], dst_blocks=[0])
        for i, t in enumerate(tensors):
            got = t.cpu()
            if not (torch.all(got[0] == _row_value(i, 0)) and torch.all(got[1] == 1.0)):
                raise AssertionError(f"decoder tensor {i} after pull_blocks from a cache row: {got[:, :4]}")
    barrier()  # pulled
    engine.unlink(comm_id)
    barrier()  # both unlinked
    if rank == 0:
        engine.cache_manager.remove_cache_key(key)
        engine.cache_manager.deallocate_cache(cache)
    engine.finalize()


def push_cache_by_index(rank: int, ports: list) -> None:
    """The push_cache sample: caches registered by address (rows, not blocks), the decoder
    links and pushes its batch 0 into the prompt's cache 1, batch 0, then unlinks."""
    prompt_id, decoder_id = 0, 1
    value = float(rank)
    engine = make_engine(LLMRole.PROMPT if rank == 0 else LLMRole.DECODER, rank,
                         f"{IP}:{ports[0]}" if rank == 0 else "")
    tensors = [dev(torch.full((BLOCKS_NUM, KV_SHAPE), value)) for _ in range(2)]
    desc = CacheDesc(num_tensors=2, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    cache = engine.cache_manager.register_cache(desc, [int(t.data_ptr()) for t in tensors])
    barrier()  # registered
    if rank == 1:
        ok(engine.link_clusters([cluster(prompt_id, ports[0])], 5000))
        engine.cache_manager.push_cache(CacheKeyByIdAndIndex(cluster_id=prompt_id, cache_id=1, batch_index=0),
                                        cache, src_batch_index=0)
    barrier()  # pushed
    if rank == 0:
        if cache.cache_id != 1:
            raise AssertionError(f"the sample pushes into cache 1; the prompt's cache is {cache.cache_id}")
        for t in tensors:
            expect(t, {0: 1, 1: 0, 2: 0}, "prompt after the decoder's push_cache")
    else:
        ok(engine.unlink_clusters([cluster(prompt_id, ports[0])], 5000))
    barrier()  # unlinked
    engine.cache_manager.unregister_cache(cache.cache_id)
    engine.finalize()


SCENARIOS = {f.__name__: f for f in (push_from_decoder, link_both_ways, switch_roles, two_prompts_two_decoders,
                                     async_whole_cache, rank_table_pull_and_swap, adapter_pair_domains,
                                     pull_cache_by_keys, cache_rows_to_blocks, push_cache_by_index)}


def main() -> None:
    scenario, rank, world, ports = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if NPU:
        DEVICE_ID[0] = rank
        torch.npu.set_device(rank)  # type: ignore[attr-defined]  # torch_npu's, autoloaded
    dist.init_process_group(backend="gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        SCENARIOS[scenario](rank, [int(p) for p in ports.split(",")])
        barrier()  # nobody exits while another still uses the group
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
