"""The cluster harness itself: hosts reach each other and nobody else, rates, loss and
partitions act on the link, and nothing a run made (namespaces, interfaces, processes)
survives it, even when its owner is killed."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from typing import Callable

import pytest

from ems_helpers import ENV
from waiting import PACED, until
from datadist.bench.netns import Cluster, leftovers, sweep_stale

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

ECHO = ("import socket,sys\n"
        "s=socket.create_server(('0.0.0.0',int(sys.argv[1])));print('up',flush=True)\n"
        "while True:\n c,_=s.accept();c.sendall(c.recv(64));c.close()\n")
ASK = ("import socket,sys\n"
       "try:\n c=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=float(sys.argv[3]));"
       "c.sendall(b'hi');print(c.recv(64).decode())\nexcept OSError as e:print(type(e).__name__)\n")


def _echo(host, port: int = 7000) -> subprocess.Popen:
    proc = subprocess.Popen(host.argv(sys.executable, "-c", ECHO, str(port)), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up", "echo server did not start"
    return proc


def _ask(host, peer, timeout: float = 3.0, port: int = 7000) -> str:
    return host.run(sys.executable, "-c", ASK, peer.address, str(port), str(timeout)).stdout.strip()


def test_hosts_talk_partitions_heal_and_loss_drops(cluster_factory: Callable[[int], Cluster]) -> None:
    c = cluster_factory(3)
    server = _echo(c[0])
    try:
        assert _ask(c[1], c[0]) == "hi", "host 1 cannot reach host 0 over the bridge"
        c[0].cut_from([c[1]])
        assert _ask(c[1], c[0], 0.5) == "TimeoutError", "a partitioned host still answered"
        assert _ask(c[2], c[0]) == "hi", "a partition cut more than the hosts named"
        c.heal()
        assert _ask(c[1], c[0]) == "hi", "the healed partition still drops"
        c[0].lose(1.0)
        assert _ask(c[1], c[0], 0.5) == "TimeoutError", "loss 1.0 still delivered"
        c[0].lose(0.0)
        assert _ask(c[1], c[0]) == "hi"
        c[0].shape("10mbit")
        out = c[0].run("tc", "qdisc", "show", "dev", "eth0").stdout
        assert "tbf" in out and "10Mbit" in out, out
    finally:
        server.kill()
        server.wait(10)


def test_close_removes_namespaces_links_and_processes(netns_ok: None) -> None:
    c = Cluster(2)
    sleeper = subprocess.Popen(c[1].argv("sleep", "300"))
    try:
        # `ip netns exec` enters the namespace a moment after it starts
        until(c[1].pids, 10, "the process started inside host 1", every=PACED)
        assert len(leftovers(c.run_id)) >= 3  # two namespaces and the bridge at least
    finally:
        c.close()
    assert sleeper.wait(10) == -signal.SIGKILL, "a process of a removed host survived"
    assert leftovers(c.run_id) == [], f"left behind: {leftovers(c.run_id)}"


def test_a_killed_run_is_swept(netns_ok: None) -> None:
    """A run whose owner is SIGKILLed (no teardown, no atexit) is removed by the next sweep."""
    code = ("import sys,time\nfrom datadist.bench.netns import Cluster\n"
            "c=Cluster(2)\nprint(c.run_id,flush=True)\ntime.sleep(300)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=ENV)
    assert owner.stdout is not None
    run = owner.stdout.readline().strip()
    assert run and leftovers(run), f"the owner made no cluster: {run!r}"
    owner.kill()
    owner.wait(10)
    assert run in sweep_stale(), "the sweep did not see the dead owner's run"
    assert leftovers(run) == [], f"the sweep left: {leftovers(run)}"


def test_without_root_the_reason_is_given() -> None:
    """Where namespaces cannot be made (here: an unprivileged user), the cluster tests skip
    with the reason :func:`unavailable` gives."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run as another user")
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                           "from datadist.bench.netns import unavailable; print(unavailable())"],
                          capture_output=True, text=True, timeout=60, env=ENV)
    if done.returncode != 0 and "setpriv" in done.stderr:
        pytest.skip(f"cannot drop privileges here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert "need root" in done.stdout, done.stdout
