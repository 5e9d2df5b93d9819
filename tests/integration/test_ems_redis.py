"""The remote tier against real redis-server processes: standalone and a 3-master Cluster.
Two daemons stand for two nodes; a value saved through one is loaded through the other."""
from __future__ import annotations

import subprocess

import pytest
from ems_helpers import RedisServer, daemon_factory, free_port, init_cc, kvcache, need_redis  # noqa: F401
from waiting import PACED, until

from ems import CcKvOption, Ems, KvBufferWrapper, PrimaryKey

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis]


def _start(directory, cluster=False):
    bus = 10000 if cluster else 0  # a cluster node's bus port is its port + 10000
    try:
        return RedisServer(directory, free_port(bus), cluster=cluster)
    except AssertionError:  # the free port was taken meanwhile: one more try on another
        return RedisServer(directory, free_port(bus), cluster=cluster)


@pytest.fixture
def redis_url(tmp_path):
    need_redis()
    server = RedisServer(tmp_path / "redis", free_port())
    yield f"redis://127.0.0.1:{server.port}/0"
    server.stop()


@pytest.fixture
def cluster_url(tmp_path):
    need_redis()
    servers = []
    try:
        for i in range(3):
            servers.append(_start(tmp_path / f"r{i}", cluster=True))
        out = subprocess.run(["redis-cli", "--cluster", "create",
                              *[f"127.0.0.1:{s.port}" for s in servers],
                              "--cluster-replicas", "0", "--cluster-yes"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        import redis
        from redis.cluster import RedisCluster
        # slots are assigned; wait until every node agrees the cluster is up
        until(lambda: all(redis.Redis(port=s.port).cluster("info").get("cluster_state") == "ok"
                          for s in servers), 30, "every cluster node reports cluster_state ok", every=PACED)
        RedisCluster(host="127.0.0.1", port=servers[0].port).ping()
        yield f"redis+cluster://127.0.0.1:{servers[0].port}", servers
    finally:
        for s in servers:
            s.stop()


def _share_between_nodes(daemon_factory, url):
    node_a = daemon_factory(remote=url)
    node_b = daemon_factory(remote=url)
    try:
        cc = init_cc(node_a.dir)
        kv = kvcache(seed=4)
        cc.register_kvcache(kv)
        assert cc.save(slot_mapping=list(range(8)), hashes=[31, 32], offsets=[4, 4]).success == 2
        a = __import__("torch").arange(300, dtype=__import__("torch").float32)
        assert cc.save(CcKvOption(), [PrimaryKey("dk", "x")], [[KvBufferWrapper(a.data_ptr, 1200)]]).success == 1
        ref = [[t.clone() for t in layer] for layer in kv]

        cc = init_cc(node_b.dir)
        kv = kvcache(seed=8)
        cc.register_kvcache(kv)
        assert cc.exists([31, 32], CcKvOption(read_local_only=True)).success == 0
        assert cc.load(slot_mapping=list(range(8)), hashes=[31, 32], offsets=[4, 4],
                       option=CcKvOption(read_local_only=True)).success == 0
        assert cc.exists([31, 32]).success == 2
        assert cc.load(slot_mapping=list(range(8, 16)), hashes=[31, 32], offsets=[4, 4]).success == 2
        import torch
        assert all(torch.equal(kv[i][k][2:4], ref[i][k][0:2]) for i in range(2) for k in range(2))
        # now in node B's memory: a local-only read hits
        assert cc.exists([31, 32], CcKvOption(read_local_only=True)).success == 2
        out = torch.zeros(300)
        assert cc.load(CcKvOption(), [PrimaryKey("dk", "x")], [[KvBufferWrapper(out.data_ptr, 1200)]]).success == 1
        assert torch.equal(out, a)
    finally:
        Ems._shutdown()


def test_standalone_redis_shares_values_between_nodes(daemon_factory, redis_url):
    _share_between_nodes(daemon_factory, redis_url)


def test_cluster_shares_values_and_hash_tags_follow_distribute_key(daemon_factory, cluster_url):
    url, servers = cluster_url
    _share_between_nodes(daemon_factory, url)
    from redis.cluster import RedisCluster
    from ems.server.tiers.remote import redis_key
    from ems.keys import Namespace
    from ems.config import CcConfig_v1

    rc = RedisCluster(host="127.0.0.1", port=servers[0].port)
    # all tp ranks' shards of one hash share a distribute part, hence a slot (a node)
    keys = [Namespace(None, CcConfig_v1(rank_id=r, device_id=0, model_id="m", tp_world_size=4,
                                        rank_in_tp_group=r).layout()).hash_keys([0xABCD])[0] for r in range(4)]
    assert len(set(keys)) == 4
    slots = {rc.keyslot(redis_key("", k)) for k in keys}
    assert len(slots) == 1
    stored = [k for s in servers for k in __import__("redis").Redis(port=s.port).keys("ems:*")]
    assert stored, "values were written to the cluster"
    rc.close()


def test_write_rcache_false_keeps_value_only_remote(daemon_factory, redis_url):
    node = daemon_factory(remote=redis_url)
    try:
        cc = init_cc(node.dir)
        import torch
        a = torch.arange(64, dtype=torch.float32)
        assert cc.save(CcKvOption(write_rcache=False), ["r"], [[KvBufferWrapper(a.data_ptr, 256)]]).success == 1
        assert cc.exists(key_list=["r"], option=CcKvOption(read_local_only=True)).success == 0
        assert cc.exists(key_list=["r"]).success == 1
    finally:
        Ems._shutdown()


def test_remote_down_reads_as_miss_not_error(daemon_factory, tmp_path):
    need_redis()
    server = RedisServer(tmp_path / "redis", free_port())
    node = daemon_factory(remote=f"redis://127.0.0.1:{server.port}/0")
    server.stop()
    try:
        cc = init_cc(node.dir)
        import torch
        a = torch.arange(64, dtype=torch.float32)
        assert cc.save(CcKvOption(), ["z"], [[KvBufferWrapper(a.data_ptr, 256)]]).success == 1  # local copy
        assert cc.exists(key_list=["z", "missing"]).success == 1
        out = torch.zeros(64)
        assert cc.load(CcKvOption(), ["missing"], [[KvBufferWrapper(out.data_ptr, 256)]]).success == 0
    finally:
        Ems._shutdown()
