"""DatadistConnector's decode worker with slow, hung and dying prefill peers, run with a
Python that has vLLM (see test_vllm_pulls.py): ``python vllm_pulls.py``
prints one JSON line.

Real workers (``vllm_worker_halves``), each in a process of its own (forked), linked over
tcp on 127.0.0.1, with vLLM's CPU KV cache layout ``(num_blocks, kv_heads, block_size,
2 * head_size)`` per layer.  Each process runs its worker the way vLLM's engine loop does:
one thread starts the work of a step and then asks the worker what finished, again and
again.  The prefill caches hold a pattern of their own (``seed``); the decode worker's
cache starts as zeros and every pulled block is compared with the pattern of the prefill
blocks it was pulled from.  Three prefill workers: ``live``, whose lease is
``LEASE_S``; ``hung``, stopped (SIGSTOP) before any link to it; ``victim``, linked and
pulled from once, then stopped while a pull from it is on its way and killed (SIGKILL)
while that pull waits for it.  The decode worker runs 2 pulls at once and gives a link
or transfer ``TIMEOUT_MS``.

- ``hung_peer``: one request from ``hung`` and one from ``live`` at once.
- ``queued``: two requests from ``hung`` take both pull threads (until the link to it
  times out), a request from ``live`` waits behind them for more than two of its leases.
- ``killed``: a request from ``victim`` is sent, the victim stops before it answers, a
  request from ``live`` comes after it; then the victim is killed, and a later request
  from ``live`` is pulled into the blocks of the failed one.
- ``split``: a second decode worker, of blocks twice as large (``2 * BLOCK`` tokens),
  pulls 4 and 5 blocks of ``live`` into 2 and 3 of its own; each is compared, as vLLM's
  CPU kernels read a block (per head the keys of its tokens, then their values), with
  the prefill blocks laid end to end (the half of the last block that no prefill block
  fills stays as it was).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

import torch
from vllm_worker_halves import make_worker
from waiting import PACED, until

from datadist.integrations.vllm.worker import DatadistWorker, Endpoint, RecvJob

HEADS, HEAD_SIZE, BLOCK, BLOCKS, LAYERS = 2, 32, 32, 16, 2
LEASE_S = 1.5
TIMEOUT_MS = 4000
HELD_S = 60.0  # the lease of blocks no test expects to expire
WAIT_S = 60.0  # the longest any step of a scenario may take


def caches(seed: Optional[int], block: int = BLOCK) -> list[torch.Tensor]:
    """The KV cache of a worker: the pattern of ``seed`` (None: zeros), vLLM's CPU layout."""
    shape = (BLOCKS, HEADS, block, 2 * HEAD_SIZE)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    count = BLOCKS * HEADS * block * 2 * HEAD_SIZE
    # Integers below 256 are exact in bfloat16; each layer and block differs.
    return [((torch.arange(count) * (2 * layer + 1) + seed) % 251).to(torch.bfloat16).view(shape)
            for layer in range(LAYERS)]


def assembled(theirs: torch.Tensor, remote: list[int], ratio: int) -> torch.Tensor:
    """Blocks of ``ratio`` times ``theirs``'s block size made of its blocks ``remote``, laid
    end to end as vLLM's CPU kernels read a block (``cpu_attn.py`` views a head of a block
    as ``2 * block_size`` rows of ``head_size``: the keys of its tokens, then their values),
    zeros after the last one."""
    _, heads, size, width = theirs.shape
    count = -(-len(remote) // ratio)
    rows = torch.zeros((count * ratio, heads, 2, size, width // 2), dtype=theirs.dtype)
    rows[:len(remote)] = theirs[remote].view(len(remote), heads, 2, size, width // 2)
    return rows.view(count, ratio, heads, 2, size, width // 2).permute(0, 2, 3, 1, 4, 5).reshape(
        count, heads, ratio * size, width)


class Loop:
    """A worker driven like vLLM drives it: ``start`` a step's work, then ``finished``,
    on one thread; what finished is recorded with the time (``time.monotonic``, one clock
    for every process of the machine) and waited for under a condition."""

    def __init__(self, worker: DatadistWorker, own: list[torch.Tensor]) -> None:
        self.worker, self.own = worker, own
        self.steps: "queue.Queue[tuple[dict, dict, dict]]" = queue.Queue()
        self.changed = threading.Condition()
        self.freed: dict[str, float] = {}
        self.done: dict[str, dict[str, Any]] = {}
        self.load_errors: set[int] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        expected: dict[str, tuple[int, RecvJob]] = {}
        while not self.stop.is_set():
            try:  # the engine loop's pace: a step every few milliseconds while there is no work
                to_recv, to_send, checks = self.steps.get(timeout=0.005)
                expected.update(checks)
                self.worker.start(to_recv, to_send)
            except queue.Empty:
                pass
            sent, received, failed = self.worker.finished(set())
            errors = self.worker.take_load_errors()
            now = time.monotonic()
            with self.changed:
                for req_id in sent:
                    self.freed[req_id] = now
                for req_id in received:
                    seed, job = expected.pop(req_id)
                    self.done[req_id] = {"t": now, "failed": req_id in failed,
                                         "exact": req_id not in failed and self._exact(seed, job)}
                self.load_errors |= errors
                self.changed.notify_all()

    def _exact(self, seed: int, job: RecvJob) -> bool:
        want = caches(seed)
        if job.ratio > 1:
            return all(torch.equal(mine[job.local_blocks], assembled(theirs, job.remote_blocks, job.ratio))
                       for mine, theirs in zip(self.own, want))
        return all(torch.equal(mine[job.local_blocks], theirs[job.remote_blocks]) for mine, theirs in zip(self.own, want))

    def state(self, what: Callable[["Loop"], bool]) -> dict[str, Any]:
        """Once ``what`` holds (at most ``WAIT_S``): what finished so far."""
        with self.changed:
            assert self.changed.wait_for(lambda: what(self), WAIT_S), "a worker did not get there in time"
            stats = self.worker.stats.data
            return {"freed": dict(self.freed), "done": {k: dict(v) for k, v in self.done.items()},
                    "load_errors": sorted(self.load_errors),
                    "expired": len(stats.get("num_kv_expired_reqs", [])),
                    "renewals": sum(stats.get("num_lease_renewals", []))}


def _serve(conn: Connection, producer: bool, seed: Optional[int], block: int, settings: dict[str, Any]) -> None:
    """One worker in a process of its own (datadist runs one engine per process)."""
    own = caches(seed, block)
    worker = make_worker(own, BLOCKS, producer, **settings)
    loop = Loop(worker, own)
    serve_commands(conn, loop, {"done": lambda arg: loop.state(lambda lp: set(arg) <= set(lp.done))})


def serve_commands(conn: Connection, loop: Loop, answers: dict[str, Callable[[Any], Any]]) -> None:
    """Send the worker's endpoint, then answer the parent's commands until ``stop``:
    ``step`` queues a step, ``freed`` says whether requests were freed, the others are
    ``answers``; the loop and the worker end with it."""
    try:
        conn.send(loop.worker.endpoint)
        while True:
            cmd, arg = conn.recv()
            if cmd == "step":
                loop.steps.put(arg)
                conn.send(None)
            elif cmd == "freed":
                conn.send(loop.state(lambda lp: set(arg) <= set(lp.freed)))
            elif cmd in answers:
                conn.send(answers[cmd](arg))
            else:
                return
    finally:
        loop.stop.set()
        loop.thread.join(10)
        loop.worker.close()


class Child:
    """A worker process and the pipe that drives it (``target(conn, *args)`` serves it)."""

    def __init__(self, ctx: Any, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(theirs, *args))
        self.proc.start()
        self.endpoint: Optional[Endpoint] = None

    def _recv(self) -> Any:
        assert self.conn.poll(2 * WAIT_S), f"worker process {self.proc.pid} did not answer (exit code {self.proc.exitcode})"
        return self.conn.recv()

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        return self._recv()

    def close(self) -> int:
        """Stop the process (killed if it does not stop); its exit code, -1 if none."""
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", None))
            except OSError:
                pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        return int(self.proc.exitcode if self.proc.exitcode is not None else -1)


class Half(Child):
    """A worker half: its KV caches are ``caches(seed, block)``."""

    def __init__(self, ctx: Any, producer: bool, seed: Optional[int], block: int = BLOCK, **settings: Any) -> None:
        super().__init__(ctx, _serve, (producer, seed, block, settings))
        self.seed = seed

    def ready(self) -> None:
        self.endpoint = self._recv()

    def hold(self, *req_ids: str, lease_s: float = HELD_S) -> None:
        self.call("step", ({}, {r: lease_s for r in req_ids}, {}))

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)


def pull(decode: Half, jobs: dict[str, tuple[Half, str, list[int], list[int], float]], ratio: int = 1) -> None:
    """Start decode requests: id -> (prefill, its request, local blocks, remote blocks, lease)."""
    recv, checks = {}, {}
    for req_id, (peer, remote_id, local, remote, lease) in jobs.items():
        assert peer.endpoint is not None and peer.seed is not None
        recv[req_id] = RecvJob(local_blocks=local, remote_blocks=remote, remote_request_id=remote_id,
                               peers=[peer.endpoint], awaited=True, lease_s=lease, ratio=ratio)
        checks[req_id] = (peer.seed, recv[req_id])
    decode.call("step", (recv, {}, checks))


def unread_bytes(port: int) -> int:
    """Bytes that arrived on connections to local ``port`` and were not read yet (the
    kernel's receive queues, from /proc/net/tcp)."""
    total = 0
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if int(local.split(":")[1], 16) == port and state == "01":  # ESTABLISHED
                total += int(queues.split(":")[1], 16)
    return total


def hung_peer(decode: Half, live: Half, hung: Half) -> dict[str, Any]:
    live.hold("a", lease_s=LEASE_S)
    start = time.monotonic()
    pull(decode, {"d-h1": (hung, "h1", [1, 2], [3, 4], HELD_S), "d-a": (live, "a", [3, 4], [5, 6], LEASE_S)})
    state = decode.call("done", ["d-h1", "d-a"])
    done = state["done"]
    return {"live": done["d-a"], "hung": done["d-h1"], "live_s": done["d-a"]["t"] - start,
            "hung_s": done["d-h1"]["t"] - start, "load_errors": state["load_errors"]}


def queued(decode: Half, live: Half, hung: Half) -> dict[str, Any]:
    live.hold("b", lease_s=LEASE_S)
    start = time.monotonic()
    renewals = decode.call("done", [])["renewals"]
    pull(decode, {"d-h2": (hung, "h2", [5], [1], HELD_S), "d-h3": (hung, "h3", [6], [2], HELD_S),
                  "d-b": (live, "b", [7, 8, 9], [8, 9, 10], LEASE_S)})
    state = decode.call("done", ["d-h2", "d-h3", "d-b"])
    freed = live.call("freed", ["b"])
    return {"live": state["done"]["d-b"], "hung": [state["done"]["d-h2"], state["done"]["d-h3"]],
            "waited_s": state["done"]["d-b"]["t"] - start, "held_s": freed["freed"]["b"] - start,
            "expired": freed["expired"], "renewals": state["renewals"] - renewals, "load_errors": state["load_errors"]}


def killed(decode: Half, live: Half, victim: Half) -> dict[str, Any]:
    victim.hold("v0", "v1")
    pull(decode, {"d-v0": (victim, "v0", [10, 11], [1, 2], HELD_S)})
    warm = decode.call("done", ["d-v0"])["done"]["d-v0"]
    victim.call("freed", ["v0"])  # the decode worker's notice was read: the victim's links are quiet
    victim.signal(signal.SIGSTOP)
    assert victim.endpoint is not None
    pull(decode, {"d-v1": (victim, "v1", [12, 13, 14], [3, 4, 5], 0.0)})
    until(lambda: unread_bytes(victim.endpoint.port) > 0, WAIT_S, every=PACED)  # the pull reached the victim: it is on its way
    live.hold("c", lease_s=LEASE_S)
    pull(decode, {"d-c": (live, "c", [1, 2], [11, 12], LEASE_S)})
    meanwhile = decode.call("done", ["d-c"])["done"]
    killed_at = time.monotonic()
    victim.signal(signal.SIGKILL)
    victim.proc.join(30)
    state = decode.call("done", ["d-v1"])
    live.hold("e", lease_s=LEASE_S)
    pull(decode, {"d-e": (live, "e", [12, 13, 14], [13, 14, 15], LEASE_S)})
    later = decode.call("done", ["d-e"])["done"]["d-e"]
    return {"warm": warm, "other": meanwhile["d-c"], "victim_pending_then": "d-v1" not in meanwhile,
            "victim": state["done"]["d-v1"], "failed_after_kill_s": state["done"]["d-v1"]["t"] - killed_at,
            "load_errors": state["load_errors"], "later": later, "victim_exit": victim.proc.exitcode}


def split(decode: Half, live: Half) -> dict[str, Any]:
    live.hold("s1", "s2", lease_s=LEASE_S)
    pull(decode, {"s-whole": (live, "s1", [1, 2], [2, 3, 4, 5], LEASE_S),
                  "s-part": (live, "s2", [3, 4, 5], [6, 7, 8, 9, 10], LEASE_S)}, ratio=2)
    done = decode.call("done", ["s-whole", "s-part"])["done"]
    return {"whole": done["s-whole"], "part": done["s-part"]}


def main() -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")  # vLLM and torch are imported once, here
    live = Half(ctx, True, 1, lease_s=LEASE_S)
    hung = Half(ctx, True, 2)
    victim = Half(ctx, True, 3)
    decode = Half(ctx, False, None, timeout_ms=TIMEOUT_MS, max_pulls=2)
    larger = Half(ctx, False, None, 2 * BLOCK)
    halves = [live, hung, victim, decode, larger]
    try:
        for half in halves:
            half.ready()
        hung.hold("h1")
        hung.signal(signal.SIGSTOP)
        report = {"split": split(larger, live), "hung_peer": hung_peer(decode, live, hung),
                  "queued": queued(decode, live, hung), "killed": killed(decode, live, victim)}
        hung.signal(signal.SIGCONT)
        for half in halves:
            half.close()
        report["exit_codes"] = [h.proc.exitcode for h in (live, hung, decode, larger)]
        return report
    finally:
        for half in halves:
            if half.proc.is_alive():
                half.signal(signal.SIGCONT)
                half.proc.kill()
                half.proc.join(10)


if __name__ == "__main__":
    print(json.dumps(main()))
