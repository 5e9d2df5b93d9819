"""Hosts on one machine: network namespaces on a bridge of their own (root, ``ip``, ``tc``
and ``iptables``), for the cluster tests and ``python -m datadist.bench --hosts``.

A :class:`Cluster` makes ``n`` hosts, each a network namespace with one veth interface
(``eth0``, address ``10.213.0.<index + 1>/24``) whose other end is a port of the cluster's
bridge.  The root namespace gets no address on that bridge: only the cluster's hosts talk to
each other, and two clusters (two test runs at once) are separate layer-2 segments, so they
may use the same addresses.

What a host's link does is set per host: a rate (``tbf`` on both directions of its link, as a
NIC of that speed would), random loss (``iptables -m statistic`` on what it receives), a
partition from other hosts (``iptables`` drops, healed on demand) and death (everything it
sends or receives dropped, then every process in it killed: peers see silence, not a reset).

Names are ``ddn<run><kind><index>`` with a random per-run ``<run>``, so two runs never collide;
every run registers its owner pid in :data:`RUN_DIR`, and :func:`sweep_stale` removes what
runs whose owner died (a killed pytest) left behind.  :meth:`Cluster.close` removes
everything a run made, processes first; it runs at fixture teardown and, for an interrupted
run, from ``atexit``.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from ..engine.conn_owner import process_alive

__all__ = ["PREFIX", "RUN_DIR", "Host", "Cluster", "unavailable", "sweep_stale", "leftovers", "enter",
           "inside", "rate_bits"]

#: Every namespace, interface and bridge of these clusters starts with this.
PREFIX = "ddn"
#: One file per live run, holding its owner's pid.
RUN_DIR = Path("/run/datadist-netns")
SUBNET = "10.213.0"
_CMD_TIMEOUT_S = 20.0
#: ``CLONE_NEWNET`` of <sched.h>: the namespace type ``setns`` is asked to enter.
_CLONE_NEWNET = 0x40000000


def _setns(fd: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into network namespace {what}: {os.strerror(err)}")


def enter(netns: str) -> None:
    """Move the calling thread into network namespace ``netns`` (one ``ip netns add``
    made), as ``ip netns exec`` would: sockets it opens from now on, and threads it starts,
    live there.  Called first thing in a process, this moves the whole process.
    (``os.setns`` arrives only with Python 3.12.)"""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd, repr(netns))
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside(netns: str) -> Iterator[None]:
    """The calling thread in ``netns`` for the block, back in its own namespace after it."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter(netns)
        try:
            yield
        finally:
            _setns(own, "of this thread")
    finally:
        os.close(own)


def _run(*argv: str, check: bool = True) -> "subprocess.CompletedProcess[str]":
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def unavailable() -> Optional[str]:
    """Why no cluster can be made here (None when one can): the tools, root, and a probe
    namespace that is made and removed again."""
    if os.geteuid() != 0:
        return "network namespaces need root (these tests make hosts with `ip netns`)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 iptables)"
    probe = f"{PREFIX}{secrets.token_hex(2)}probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        rule = _run("ip", "netns", "exec", probe, "iptables", "-A", "INPUT", "-m", "statistic", "--mode",
                    "random", "--probability", "0.5", "-j", "DROP", check=False)
        if rule.returncode != 0:
            return f"iptables cannot drop at random in a namespace: {rule.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _names(kind: str) -> List[str]:
    if kind == "netns":
        out = _run("ip", "-j", "netns", "list", check=False).stdout.strip()
        return [e["name"] for e in json.loads(out or "[]")]
    out = _run("ip", "-j", "link", "show", check=False).stdout.strip()
    return [e["ifname"] for e in json.loads(out or "[]")]


def leftovers(run: str = "") -> List[str]:
    """Namespaces and interfaces of run ``run`` (every run: ``""``) that still exist."""
    mine = PREFIX + run
    return sorted(n for n in _names("netns") + _names("link") if n.startswith(mine))


def rate_bits(rate: str) -> int:
    """Bits per second of a ``tc`` rate (``1gbit``, ``100mbit``); ValueError naming it."""
    units = {"gbit": 10 ** 9, "mbit": 10 ** 6, "kbit": 10 ** 3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            try:
                value = float(rate[:-len(unit)])
            except ValueError:
                break
            if value > 0:
                return int(value * scale)
    raise ValueError(f"rate {rate!r}: want a positive number followed by gbit, mbit or kbit")


def _pids(netns: str) -> List[int]:
    out = _run("ip", "netns", "pids", netns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def _remove_run(run: str) -> None:
    """Kill the processes of run ``run``'s namespaces, then remove its namespaces and links."""
    mine = PREFIX + run
    spaces = [n for n in _names("netns") if n.startswith(mine)]
    for netns in spaces:
        for pid in _pids(netns):
            try:
                os.kill(pid, signal.SIGCONT)  # a stopped process dies only once continued
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for netns in spaces:
        _run("ip", "netns", "del", netns, check=False)
    for link in _names("link"):
        if link.startswith(mine):  # the bridge; veth ends go with their namespace
            _run("ip", "link", "del", link, check=False)
    (RUN_DIR / run).unlink(missing_ok=True)



def sweep_stale() -> List[str]:
    """Remove what runs whose owner process is gone left behind; returns those runs."""
    runs = {}
    if RUN_DIR.is_dir():
        for entry in RUN_DIR.iterdir():
            try:
                runs[entry.name] = int(entry.read_text().strip() or 0)
            except (OSError, ValueError):
                runs[entry.name] = 0
    seen = {n[len(PREFIX):len(PREFIX) + 4] for n in _names("netns") + _names("link")
            if n.startswith(PREFIX) and len(n) > len(PREFIX) + 4}
    stale = sorted(r for r in set(runs) | seen if runs.get(r, 0) <= 0 or not process_alive(runs[r]))
    for run in stale:
        _remove_run(run)
    return stale


class Host:
    """One namespace of a cluster: its name, address and index."""

    def __init__(self, cluster: "Cluster", index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.netns = f"{cluster.prefix}h{index}"
        self.address = f"{SUBNET}.{index + 1}"
        self.port = f"{cluster.prefix}v{index}"  # the bridge's end of its link

    def __repr__(self) -> str:
        return f"Host({self.netns}, {self.address})"

    def argv(self, *argv: str) -> List[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, *argv: str, check: bool = True) -> "subprocess.CompletedProcess[str]":
        """Run a short command inside this host."""
        return _run(*self.argv(*argv), check=check)

    def pids(self) -> List[int]:
        """Processes running inside this host."""
        return _pids(self.netns)

    def counters(self) -> Dict[str, int]:
        """Bytes this host's ``eth0`` has received and sent."""
        out = json.loads(self.run("ip", "-s", "-j", "link", "show", "eth0").stdout)[0]["stats64"]
        return {"rx": int(out["rx"]["bytes"]), "tx": int(out["tx"]["bytes"])}

    def shape(self, rate: str) -> None:
        """Limit this host's link to ``rate`` (a ``tc`` rate: ``1gbit``) in both directions."""
        bits = rate_bits(rate)
        # A bucket of 2 ms at the rate (at least 64 KiB so a GSO packet fits) and a queue of
        # 20 ms: TCP sees a link of that speed with a modest buffer, as a NIC would give it.
        burst = max(64 * 1024, bits // 8 // 500)
        for dev_argv in (self.argv("tc"), ["tc"]):
            dev = "eth0" if dev_argv[0] == "ip" else self.port
            _run(*dev_argv, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", str(burst), "latency", "20ms")

    def unshape(self) -> None:
        """Take the rate limit off this host's link."""
        self.run("tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        _run("tc", "qdisc", "del", "dev", self.port, "root", check=False)

    def lose(self, probability: float) -> None:
        """Drop each packet this host receives or sends with ``probability`` (0 removes)."""
        for chain in ("INPUT", "OUTPUT"):
            self.run("iptables", "-F", chain)
            if probability > 0:
                self.run("iptables", "-A", chain, "-m", "statistic", "--mode", "random",
                         "--probability", f"{probability:.6f}", "-j", "DROP")

    def cut_from(self, others: Sequence["Host"]) -> None:
        """Drop everything between this host and ``others`` (both directions, silently)."""
        for other in others:
            self.run("iptables", "-I", "INPUT", "-s", other.address, "-j", "DROP")
            self.run("iptables", "-I", "OUTPUT", "-d", other.address, "-j", "DROP")

    def heal(self) -> None:
        """Remove every drop rule of this host (partitions and loss)."""
        for chain in ("INPUT", "OUTPUT"):
            self.run("iptables", "-F", chain)

    def die(self) -> float:
        """The host dies: its link goes silent (no reset reaches a peer), then every process
        in it is killed.  Returns the monotonic time the link went silent."""
        for chain in ("INPUT", "OUTPUT"):
            self.run("iptables", "-I", chain, "-j", "DROP")
        t_dead = time.monotonic()
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return t_dead


class Cluster:
    """``n`` hosts on a bridge of their own; :meth:`close` removes all of it."""

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 64:
            raise ValueError(f"n={n}: a cluster has 1 to 64 hosts")
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        while True:
            self.run_id = secrets.token_hex(2)
            if not leftovers(self.run_id) and not (RUN_DIR / self.run_id).exists():
                break
        (RUN_DIR / self.run_id).write_text(str(os.getpid()))
        self.prefix = PREFIX + self.run_id
        self.bridge = f"{self.prefix}br"
        self.hosts: List[Host] = []
        self._closed = False
        atexit.register(self.close)
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(n):
                self._add_host(Host(self, i))
        except BaseException:
            self.close()
            raise

    def _add_host(self, host: Host) -> None:
        self.hosts.append(host)
        _run("ip", "netns", "add", host.netns)
        inner = f"{self.prefix}p{host.index}"
        _run("ip", "link", "add", host.port, "type", "veth", "peer", "name", inner, "netns", host.netns)
        _run("ip", "link", "set", host.port, "master", self.bridge, "up")
        host.run("ip", "link", "set", inner, "name", "eth0")
        host.run("ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
        host.run("ip", "link", "set", "eth0", "up")
        host.run("ip", "link", "set", "lo", "up")

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def heal(self) -> None:
        """Every host's drop rules removed: partitions healed, loss off."""
        for host in self.hosts:
            host.heal()

    def close(self) -> None:
        """Kill every process in the hosts, remove the namespaces, links and bridge."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        _remove_run(self.run_id)
