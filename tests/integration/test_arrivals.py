"""Arrival notices in real processes: the decoder learns that each pushed layer landed
(waitable and callback), that a push failed, and that the pushing peer died."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import traceback
from typing import Any, Dict

import pytest
from ports import free_port

pytestmark = pytest.mark.timeout(90)

PROMPT, DECODER = 301, 302
LAYERS = 4


def _config(transport: str, listen: str = "") -> Dict[str, str]:
    from datadist import LLMConfig

    cfg = LLMConfig()
    cfg.sync_kv_timeout = 3000
    cfg.host_mem_pool_cfg = json.dumps({"memory_size": 1 << 22, "page_shift": 12})
    cfg.transfer_backend = transport
    if listen:
        cfg.listen_ip_info = listen
    return cfg.generate_options()


def _desc():
    from datadist import CacheDesc, DataType, Placement

    return CacheDesc(2 * LAYERS, [4, 512], DataType.DT_INT8, Placement.HOST)


def _prompt(port: int, transport: str, conn) -> None:
    """Push layer i of block 0 into the decoder's block 2 whenever told to."""
    try:
        import torch

        from datadist import BlocksCacheKey, LLMDataDist, LLMRole

        engine = LLMDataDist(LLMRole.PROMPT, PROMPT)
        engine.init(_config(transport, f"127.0.0.1:{port}"))
        cache = engine.cache_manager.allocate_blocks_cache(_desc())
        for i, t in enumerate(engine.cache_manager.get_cache_tensors(cache)):
            t.copy_(torch.full(t.shape, i + 1, dtype=torch.int8))
        conn.send(("ready", os.getpid()))
        while True:
            cmd = conn.recv()
            if cmd == "exit":
                break
            model, layer = (1, cmd[1]) if isinstance(cmd, tuple) else (0, cmd)
            r = range(layer, layer + 1)
            engine.cache_manager.push_blocks(BlocksCacheKey(DECODER, model), cache, [0], [2],
                                             src_layer_range=r, dst_layer_range=r)
            conn.send(("pushed", layer))
        engine.finalize()
        conn.send(("bye", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _expect(conn, kind: str) -> Any:
    assert conn.poll(30), f"no {kind!r} from the prompt process"
    got, value = conn.recv()
    if got == "error":
        raise AssertionError(f"prompt process failed:\n{value}")
    assert got == kind, (got, value)
    return value


@pytest.mark.parametrize("transport", ["shm", "tcp", "gloo"])
def test_layer_arrivals_are_observed(transport: str) -> None:
    """Per-layer waits on a watched cache return that layer's notice (the data is there),
    callbacks see every notice, a wait with nothing pushed times out, an unwatched cache
    gets no notices, and the prompt's death fails a wait that names it."""
    from datadist import (BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMException, LLMRole, LLMStatusCode)

    ctx = mp.get_context("spawn")
    port = free_port()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prompt, args=(port, transport, child))
    proc.start()
    engine = LLMDataDist(LLMRole.DECODER, DECODER)
    try:
        pid = _expect(parent, "ready")
        engine.init(_config(transport))
        cm = engine.cache_manager
        cache = cm.allocate_blocks_cache(_desc(), BlocksCacheKey(DECODER, 0))
        cm.watch_arrivals(cache)
        seen = []
        cm.add_arrival_callback(cache, seen.append)
        quiet = cm.allocate_blocks_cache(_desc(), BlocksCacheKey(DECODER, 1))
        info = LLMClusterInfo()
        info.remote_cluster_id = PROMPT
        info.append_remote_ip_info("127.0.0.1", port)
        assert engine.link_clusters([info], 10000)[0] == LLMStatusCode.LLM_SUCCESS

        t0 = time.monotonic()
        with pytest.raises(LLMException) as err:
            cm.wait_arrival(cache, range(0, 1), 200)
        assert err.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert 0.15 < time.monotonic() - t0 < 2.0

        tensors = cm.get_cache_tensors(cache)
        for layer in range(LAYERS):
            parent.send(layer)
            got = cm.wait_arrival(cache, range(layer, layer + 1), 10000, src_cluster_id=PROMPT)
            assert [(a.cluster_id, a.tensors, a.status) for a in got] == \
                [(PROMPT, range(2 * layer, 2 * layer + 2), LLMStatusCode.LLM_SUCCESS)]
            assert got[0].layers() == range(layer, layer + 1)
            for t in (2 * layer, 2 * layer + 1):
                assert bool((tensors[t][2] == t + 1).all()), f"layer {layer} tensor {t} not there"
            _expect(parent, "pushed")
        assert [a.tensors for a in seen] == [range(2 * i, 2 * i + 2) for i in range(LAYERS)]

        # Pushes into a cache nobody watched leave no notice behind, even if watched later.
        parent.send(("quiet", 0))
        _expect(parent, "pushed")
        cm.watch_arrivals(quiet)
        with pytest.raises(LLMException) as err:
            cm.wait_arrival(quiet, range(0, 1), 100)
        assert err.value.status_code == LLMStatusCode.LLM_TIMEOUT

        os.kill(pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(LLMException) as err:
            cm.wait_arrival(cache, range(0, 1), 10000, src_cluster_id=PROMPT)
        assert err.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert time.monotonic() - t0 < 5.0
    finally:
        engine.finalize()
        if proc.is_alive():
            proc.kill()
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL


def test_wait_arrival_argument_checks() -> None:
    """Bad layer ranges, timeouts and unknown caches raise the contract's errors."""
    from datadist import LLMDataDist, LLMException, LLMRole, LLMStatusCode

    engine = LLMDataDist(LLMRole.DECODER, 9)
    engine.init(_config("shm"))
    try:
        cm = engine.cache_manager
        cache = cm.allocate_blocks_cache(_desc())
        for bad in (range(0, LAYERS + 1), range(2, 1)):
            with pytest.raises(LLMException) as err:
                cm.wait_arrival(cache, bad, 10)
            assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(LLMException) as err:
            cm.wait_arrival(cache, None, -1)
        assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(TypeError):
            cm.add_arrival_callback(cache, "not callable")
        cm.deallocate_blocks_cache(cache)
        with pytest.raises(LLMException) as err:
            cm.wait_arrival(cache, None, 10)
        assert err.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    finally:
        engine.finalize()
