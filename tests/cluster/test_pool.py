"""The pool across hosts: an ems-server on each of two node hosts, their remote tier a
3-master Redis Cluster of real ``redis-server`` processes in three more hosts, and a pool
client process on each node host (pool_client.py).

A value saved on node A loads on node B through the cluster; a Redis master that dies turns
loads of what is gone into misses (never wrong bytes; at most the first load meets the
dead node's timeouts) while values in a node's memory still hit; a node's ems-server that
is killed and started again is found again by its client.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from ems_helpers import ENV, EmsDaemon
from waiting import PACED, until
from datadist.bench.netns import Cluster, Host

pytestmark = [pytest.mark.cluster, pytest.mark.redis, pytest.mark.timeout(240)]

REDIS_PORT = 7000
CLIENT = str(Path(__file__).with_name("pool_client.py"))
#: How long one client command may take (a load waits for the remote tier's timeouts).
ANSWER_S = 60.0
KEYS = [f"req-{i}" for i in range(24)]


class Client:
    """A pool_client.py process inside a host."""

    def __init__(self, host: Host, server: str) -> None:
        self.proc = subprocess.Popen(host.argv(sys.executable, CLIENT, server), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        assert self._answer(ANSWER_S * 2) == {"ready": True}

    def _answer(self, timeout: float) -> Dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"pool client gave no answer within {timeout} s "
                                 f"(exit {self.proc.returncode}):\n{err}")
        return json.loads(line)

    def ask(self, *cmd: Any) -> Dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(list(cmd)) + "\n")
        self.proc.stdin.flush()
        out = self._answer(ANSWER_S)
        assert "error" not in out, f"the pool client raised: {out['error']}"
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                code = self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(10)
            assert code == 0, f"pool client exit code {code}: {self.proc.stderr.read() if self.proc.stderr else ''}"


class Pool:
    def __init__(self, cluster: Cluster, daemons: List[EmsDaemon], redis: List[subprocess.Popen]) -> None:
        self.cluster = cluster
        self.daemons = daemons
        self.redis = redis
        self.clients: List[Client] = []


def _redis_cli(host: Host, *args: str) -> str:
    return host.run("redis-cli", "-h", host.address, "-p", str(REDIS_PORT), *args, check=False).stdout


def _start_redis(host: Host, directory: Path) -> subprocess.Popen:
    directory.mkdir()
    proc = subprocess.Popen(host.argv(
        "redis-server", "--port", str(REDIS_PORT), "--bind", host.address, "--save", "", "--appendonly", "no",
        "--dir", str(directory), "--protected-mode", "no", "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    until(lambda: "PONG" in _redis_cli(host, "ping") or proc.poll() is not None, 20,
          f"redis-server in {host}", every=PACED)
    assert proc.poll() is None, f"redis-server in {host} exited with {proc.returncode}"
    return proc


def _cluster_ok(hosts: List[Host]) -> bool:
    return all("cluster_state:ok" in _redis_cli(h, "cluster", "info") for h in hosts)


@pytest.fixture(scope="module")
def pool(cluster_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not on PATH (apt-get install redis-server)")
    pytest.importorskip("redis", reason="the 'redis' package is not installed (pip install 'redis>=5')")
    cluster = cluster_factory(5)
    tmp = tmp_path_factory.mktemp("pool")
    redis: List[subprocess.Popen] = []
    daemons: List[EmsDaemon] = []
    p = Pool(cluster, daemons, redis)
    try:
        masters = cluster.hosts[2:]
        for host in masters:
            redis.append(_start_redis(host, tmp / f"redis-{host.index}"))
        out = masters[0].run("redis-cli", "--cluster", "create", *[f"{h.address}:{REDIS_PORT}" for h in masters],
                             "--cluster-replicas", "0", "--cluster-yes")
        assert "[OK] All 16384 slots covered" in out.stdout, out.stdout
        until(lambda: _cluster_ok(masters), 30, "every Redis node reports cluster_state ok", every=PACED)
        url = f"redis+cluster://{masters[0].address}:{REDIS_PORT}"
        for host in cluster.hosts[:2]:
            daemon = EmsDaemon(tmp / f"node-{host.index}", remote=url, launcher=host.argv())
            daemons.append(daemon)
            daemon.start(timeout=60)
        p.clients = [Client(host, d.dir) for host, d in zip(cluster.hosts[:2], daemons)]
        yield p
    finally:
        errors = []
        for client in p.clients:
            try:
                client.close()
            except AssertionError as exc:
                errors.append(str(exc))
        for daemon in daemons:
            if daemon.alive() and daemon.stop() != 0:
                errors.append(f"ems-server of {daemon.dir} did not exit with 0")
        for proc in redis:
            proc.kill()
            proc.wait(10)
        assert not errors, "; ".join(errors)


def test_saved_on_node_a_loads_on_node_b(pool: Pool) -> None:
    a, b = pool.clients
    saved = a.ask("save", KEYS[:8])
    assert all(saved.values()), f"saves on node A failed: {saved}"
    got = b.ask("load", KEYS[:8])
    assert set(got.values()) == {"hit"}, (
        f"node B did not load what node A saved through the Redis Cluster (hit/miss/wrong per key): {got}")


def test_a_dead_redis_master_turns_loads_into_misses_never_wrong_bytes(pool: Pool) -> None:
    a, b = pool.clients
    keys = KEYS[8:20]
    assert all(a.ask("save", keys).values())
    masters = pool.cluster.hosts[2:]
    masters[-1].die()
    pool.redis[-1].wait(10)
    got = b.ask("load", keys)
    assert "wrong" not in got.values(), f"node B loaded wrong bytes after a Redis master died: {got}"
    assert "miss" in got.values(), f"a dead master's keys still loaded on node B: {got}"
    assert list(got.values()).count("timeout") <= 1, (
        f"more than the first load after a Redis master died ran into EMS_IO_TIMEOUT (the tier "
        f"was not marked down): {got}")
    local = a.ask("load", keys)
    assert set(local.values()) == {"hit"}, f"node A lost what its own memory holds when a Redis master died: {local}"


def test_killed_ems_server_restarts_and_its_client_reconnects(pool: Pool) -> None:
    a, _ = pool.clients
    daemon = pool.daemons[0]
    daemon.kill()
    assert a.ask("health") == {"health": False}, "a client of a killed ems-server still reported a healthy pool"
    daemon.start(timeout=60)
    until(lambda: a.ask("health") == {"health": True}, 30, "the client found the restarted ems-server", every=PACED)
    keys = KEYS[20:]
    assert all(a.ask("save", keys).values()), "saves after the ems-server restarted failed"
    assert set(a.ask("load", keys).values()) == {"hit"}, "loads after the ems-server restarted did not hit"
