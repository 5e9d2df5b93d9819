"""``python -m datadist.bench --hosts RATE``: the workloads between two hosts whose links
run at ``RATE``, next to one raw TCP stream over the same link in the same run.

The hosts are two network namespaces on a bridge of their own (:mod:`.netns`; needs root,
``ip``, ``tc`` and ``iptables``), each link shaped to ``RATE`` with ``tbf`` in both
directions, as a NIC of that speed.  The prompt engine (this process, moved into host 0 for
the run) pushes over ``tcp`` to the decoder process in host 1, both with a random link secret
(``DATADIST_LINK_SECRET``), and the bytes are checked as in every run.  Each row adds the
link's rate, the share of it the transfer reached, one TCP stream's rate over the same link
(a plain ``sendall`` loop: what the link gives one connection), and the rate's lower bound
on the batch's time (``bound_ms``).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import threading
import time
from multiprocessing import resource_tracker
from typing import Any, Callable, Dict, List, Set

from .netns import Cluster, Host, inside, rate_bits, sweep_stale, unavailable

__all__ = ["raw_tcp_gbit", "run_on_hosts", "main_hosts"]

SECRET_ENV = "DATADIST_LINK_SECRET"
_CHUNK = 4 << 20
#: Seconds the raw stream lasts at the link's rate (long enough to leave slow start).
_RAW_S = 1.0


def raw_tcp_gbit(sender: Host, receiver: Host, nbytes: int) -> float:
    """Gbit/s of one TCP stream of ``nbytes`` from ``sender`` to ``receiver``, timed at the
    receiver from its first byte to its last (connection setup excluded)."""
    ready = threading.Event()
    out: Dict[str, Any] = {}

    def receive() -> None:
        with inside(receiver.netns), socket.create_server((receiver.address, 0)) as server:
            out["port"] = server.getsockname()[1]
            ready.set()
            server.settimeout(30)
            conn, _ = server.accept()
            with conn:
                conn.settimeout(60)
                buf = bytearray(_CHUNK)
                got, first = 0, 0.0
                while got < nbytes:
                    k = conn.recv_into(buf)
                    if k == 0:
                        break
                    if not got:
                        first = time.perf_counter()
                    got += k
                out["s"], out["got"] = time.perf_counter() - first, got

    thread = threading.Thread(target=receive, name="raw-tcp-receiver")
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the raw TCP receiver did not start")
    payload = memoryview(bytearray(_CHUNK))
    with inside(sender.netns), socket.create_connection((receiver.address, out["port"]), timeout=60) as conn:
        sent = 0
        while sent < nbytes:
            conn.sendall(payload[:min(_CHUNK, nbytes - sent)])
            sent += min(_CHUNK, nbytes - sent)
    thread.join(60)
    if out.get("got") != nbytes:
        raise RuntimeError(f"raw TCP stream: {out.get('got')} of {nbytes} bytes arrived")
    return float(nbytes * 8 / out["s"] / 1e9)


def run_on_hosts(run: Callable[..., Dict[str, Any]], workload: str, rate: str, **shape: Any) -> Dict[str, Any]:
    """One workload over ``tcp`` between two hosts shaped to ``rate`` (``run``: the bench's
    run of one workload, :func:`.core.run`), with the raw stream; returns the row
    (RuntimeError where hosts cannot be made here, naming why)."""
    bits = rate_bits(rate)
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"--hosts: {why}")
    sweep_stale()
    # multiprocessing's resource tracker starts with the first spawned process; started
    # from inside a host it would live there, and die with the host at the end.
    resource_tracker.ensure_running()
    cluster = Cluster(2)
    # Both engines (the decoder inherits the environment) link with a secret, as engines on
    # separate hosts should.
    saved = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = secrets.token_hex(16)
    try:
        for host in cluster.hosts:
            host.shape(rate)
        prompt, decoder = cluster.hosts
        with inside(prompt.netns):
            row = run(workload, "tcp", hosts=(prompt.address, decoder.netns), **shape)
        raw = raw_tcp_gbit(prompt, decoder, max(16 << 20, int(bits / 8 * _RAW_S)))
    finally:
        cluster.close()
        if saved is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = saved
    line = bits / 1e9
    row.update(system=f"datadist-tcp-hosts-{rate}", line_gbit=line, line_share=round(row["gbps"] * 8 / line, 3),
               raw_tcp_gbit=round(raw, 3), raw_tcp_share=round(raw / line, 3),
               bound_ms=round(row["batch_ms"] * row["gbps"] * 8 / line, 3))
    return row


def main_hosts(ap: argparse.ArgumentParser, args: argparse.Namespace, workloads: List[str],
               run: Callable[..., Dict[str, Any]], layerwise: Set[str]) -> int:
    """``--hosts``: every workload at every rate, a row printed as it comes (``layerwise``:
    the workloads ``--requests`` and ``--layers`` apply to)."""
    if args.transport and set(args.transport) != {"tcp"}:
        ap.error("--hosts runs over tcp only (the hosts share no memory)")
    if args.device != "cpu":
        ap.error("--hosts runs host caches only (--device cpu)")
    for rate in args.hosts:
        try:
            rate_bits(rate)
        except ValueError as exc:
            ap.error(f"--hosts: {exc}")
    if not args.json:
        _header()
    for rate in args.hosts:
        for wl in workloads:
            shape = {"requests": args.requests, "layers": args.layers} if wl in layerwise else {}
            row = run_on_hosts(run, wl, rate, rounds=args.rounds, **shape)
            print(json.dumps(row) if args.json else _line(row), flush=True)
    return 0


def _header() -> None:
    print(f"{'workload':14s} {'link':8s} {'Gbit/s':>8s} {'of link':>8s} {'batch ms':>9s} {'bound ms':>9s} "
          f"{'raw TCP Gbit/s':>14s} {'of link':>8s}", flush=True)


def _line(r: Dict[str, Any]) -> str:
    return (f"{r['workload']:14s} {r['system'].rsplit('-', 1)[1]:8s} {r['gbps'] * 8:8.3f} {r['line_share']:8.1%} "
            f"{r['batch_ms']:9.1f} {r['bound_ms']:9.1f} {r['raw_tcp_gbit']:14.3f} {r['raw_tcp_share']:8.1%}")
