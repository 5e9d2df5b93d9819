"""Comm domains (``link``/``query_register_mem_status``/``unlink``) and ``switch_role``,
in real processes: every member links in the background, reports when its domain is up,
moves data to its neighbour and checks what arrived."""
from __future__ import annotations

import json
import multiprocessing as mp
import traceback
from typing import Any, Dict, List

import pytest
from ports import free_ports

pytestmark = pytest.mark.timeout(90)

BASE_CLUSTER = 100


def _rank_table(ports: List[int]) -> str:
    return json.dumps({
        "version": "1.0", "status": "completed", "server_count": str(len(ports)),
        "server_list": [{"server_id": "127.0.0.1",
                         "device": [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": str(r), "port": p}]}
                        for r, p in enumerate(ports)],
    })


def _config(transport: str) -> Dict[str, str]:
    from datadist import LLMConfig

    cfg = LLMConfig()
    cfg.sync_kv_timeout = 5000
    cfg.link_total_time = 20
    cfg.host_mem_pool_cfg = json.dumps({"memory_size": 1 << 22, "page_shift": 12})
    cfg.transfer_backend = transport
    return cfg.generate_options()


def _member(rank: int, n: int, ports: List[int], transport: str, conn) -> None:
    """One domain member: link, wait for OK, push a block to the next rank, report what
    the previous rank pushed here, unlink."""
    try:
        import torch

        from datadist import (BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMException, LLMRole,
                              LLMStatusCode, Placement, RegisterMemStatus)

        me = BASE_CLUSTER + rank
        engine = LLMDataDist(LLMRole.MIX, me)
        engine.init(_config(transport))
        cm = engine.cache_manager
        cache = cm.allocate_blocks_cache(CacheDesc(2, [4, 256], DataType.DT_INT8, Placement.HOST),
                                         BlocksCacheKey(me, 0))
        for i, t in enumerate(cm.get_cache_tensors(cache)):
            t.copy_(torch.full((4, 256), rank * 10 + i, dtype=torch.int8))
        members = {BASE_CLUSTER + r: r for r in range(n)}
        nxt = BASE_CLUSTER + (rank + 1) % n
        comm_id = engine.link("domain-a", members, _rank_table(ports))
        try:
            cm.push_blocks(BlocksCacheKey(nxt, 0), cache, [0], [3])
            early = "no error"
        except LLMException as exc:  # the links may already be up on a fast machine
            early = exc.status_code.name
        if early not in ("no error", LLMStatusCode.LLM_NOT_YET_LINK.name):
            raise AssertionError(f"push before the domain is up: {early}")
        conn.send(("linking", None))
        assert conn.recv() == "status"
        while engine.query_register_mem_status(comm_id) == RegisterMemStatus.PREPARING:
            if conn.poll(0.02):
                raise AssertionError(f"parent gave up: {conn.recv()}")
        conn.send(("status", engine.query_register_mem_status(comm_id).name))
        assert conn.recv() == "push"
        cm.push_blocks(BlocksCacheKey(nxt, 0), cache, [0], [1])
        conn.send(("pushed", None))
        assert conn.recv() == "read"
        conn.send(("data", [t[1].tolist()[:2] for t in cm.get_cache_tensors(cache)]))
        assert conn.recv() == "unlink"
        engine.unlink(comm_id)
        try:
            cm.push_blocks(BlocksCacheKey(nxt, 0), cache, [0], [1])
            after = "no error"
        except LLMException as exc:
            after = exc.status_code.name
        conn.send(("after_unlink", after))
        engine.finalize()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _run_domain(n: int, transport: str) -> None:
    ctx = mp.get_context("spawn")
    ports = free_ports(n)
    pipes, procs = [], []
    for rank in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_member, args=(rank, n, ports, transport, child))
        p.start()
        pipes.append(parent)
        procs.append(p)

    def gather(step: str) -> List[Any]:
        out = []
        for rank, conn in enumerate(pipes):
            if not conn.poll(60):
                raise AssertionError(f"rank {rank} did not answer {step!r} within 60 s")
            kind, value = conn.recv()
            if kind == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            assert kind == step, (kind, value)
            out.append(value)
        return out

    try:
        gather("linking")
        for c in pipes:
            c.send("status")
        assert gather("status") == ["OK"] * n
        for c in pipes:
            c.send("push")
        gather("pushed")
        for c in pipes:
            c.send("read")
        data = gather("data")
        for rank, got in enumerate(data):
            prev = (rank - 1) % n
            assert got == [[prev * 10 + i] * 2 for i in range(2)], (rank, got)
        for c in pipes:
            c.send("unlink")
        after = gather("after_unlink")
        assert after == ["LLM_NOT_YET_LINK"] * n, after
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * n


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_comm_domain_links_every_pair(n: int, transport: str) -> None:
    """2- and 4-member domains: OK once linked, data moves rank r -> r+1, unlink ends it."""
    _run_domain(n, transport)


def test_comm_argument_checks() -> None:
    """CANN's checks: 2-4 members, ranks ascending from 0, comm_name length, own cluster."""
    from datadist import LLMDataDist, LLMException, LLMRole, LLMStatusCode

    engine = LLMDataDist(LLMRole.MIX, 7)
    engine.init(_config("shm"))
    table = _rank_table(free_ports(2))
    try:
        bad = [
            ("x" * 200, {7: 0, 8: 1}),     # comm_name too long
            ("", {7: 0, 8: 1}),            # empty comm_name
            ("c", {7: 0}),                 # one member
            ("c", {7: 0, 8: 1, 9: 2, 10: 3, 11: 4}),  # five members
            ("c", {7: 1, 8: 0}),           # ranks not ascending
            ("c", {7: 0, 8: 2}),           # ranks not contiguous
            ("c", {8: 0, 9: 1}),           # this engine is not a member
        ]
        for name, members in bad:
            with pytest.raises(LLMException) as err:
                engine.link(name, members, table)
            assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, (name, members)
        with pytest.raises(TypeError):
            engine.link("c", [7, 8], table)
        with pytest.raises(LLMException) as err:
            engine.link("c", {7: 0, 8: 1}, "{not json")
        assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(LLMException) as err:
            engine.query_register_mem_status(12345)
        assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    finally:
        engine.finalize()


def _switcher(port: int, conn) -> None:
    """A decoder that becomes a prompt server on ``port`` (no links yet)."""
    try:
        from datadist import LLMDataDist, LLMRole

        engine = LLMDataDist(LLMRole.DECODER, 201)
        engine.init(_config("tcp"))
        engine.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
        conn.send(("switched", engine.role.name))
        assert conn.recv() == "done"
        engine.finalize()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def test_switch_role_without_and_with_links() -> None:
    """switch_role with listen options makes a server others can link to; with a link in
    place it is refused with LLM_EXIST_LINK; after unlinking it works again."""
    from datadist import LLMClusterInfo, LLMDataDist, LLMException, LLMRole, LLMStatusCode

    ctx = mp.get_context("spawn")
    (port,) = free_ports(1)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_switcher, args=(port, child))
    proc.start()
    engine = LLMDataDist(LLMRole.PROMPT, 200)
    try:
        assert parent.poll(60), "switcher did not answer"
        kind, value = parent.recv()
        assert kind == "switched", value
        assert value == "PROMPT"
        engine.init(_config("tcp"))
        engine.switch_role(LLMRole.DECODER)
        assert engine.role == LLMRole.DECODER
        info = LLMClusterInfo()
        info.remote_cluster_id = 201
        info.append_remote_ip_info("127.0.0.1", port)
        ret, _ = engine.link_clusters([info], 5000)
        assert ret == LLMStatusCode.LLM_SUCCESS
        with pytest.raises(LLMException) as err:
            engine.switch_role(LLMRole.PROMPT)
        assert err.value.status_code == LLMStatusCode.LLM_EXIST_LINK
        assert engine.role == LLMRole.DECODER
        ret, _ = engine.unlink_clusters([info], 5000)
        assert ret == LLMStatusCode.LLM_SUCCESS
        engine.switch_role(LLMRole.PROMPT)
        assert engine.role == LLMRole.PROMPT
        parent.send("done")
    finally:
        engine.finalize()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
