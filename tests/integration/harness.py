"""Real-process harness for the datadist integration tests.

Every engine runs in its own spawned process (the contract allows one initialized engine
per process) and is driven step by step from the test body over a ``Pipe``: the test sends
a command, the child runs it against its engine and answers with the result or with the
exception it raised (type, status code, message and formatted traceback).  A failure in a
child is re-raised in the test as :class:`PeerError` carrying the child's traceback.

Every wait has a deadline.  A child that dies answers with its exit code; a child that
does not answer in time is killed and the test fails.  Teardown shuts children down with
an ``exit`` command and asserts exit code 0, and kills whatever did not exit.

The test process holds no datadist objects: caches are named by strings (:class:`Ref`),
keys and descriptors travel as small picklable specs (:class:`Key`, :class:`Desc`, see
harness_specs.py) that the child turns into datadist objects (harness_child.py), and cache
contents travel as ``bytes`` (one per tensor) so tests compare them byte for byte against
the numpy model in harness_oracle.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pytest

from harness_child import child_main
from harness_oracle import (as_array, expect_blocks, expect_row_to_blocks, expect_rows,
                            layer_tensors, random_bytes)
from harness_specs import (DECODER_ID, POOL_CFG, PROMPT_ID, SYNC_KV_TIMEOUT_MS, TRANSPORTS, Desc,
                           Key, Ref, base_config, blocks_key, cache_key, id_key, key_config,
                           transfer_config)
from ports import free_port
from waiting import PACED, until

__all__ = [
    "TRANSPORTS", "PROMPT_ID", "DECODER_ID", "POOL_CFG", "SYNC_KV_TIMEOUT_MS",
    "Key", "Ref", "Desc", "PeerError", "PeerDied", "Peer", "Pair", "Pending", "PairHolder",
    "cache_key", "id_key", "blocks_key", "transfer_config", "key_config", "free_port", "base_config", "start_pair",
    "expect_llm", "expect_exc", "random_bytes", "layer_tensors", "expect_blocks",
    "expect_row_to_blocks", "expect_rows", "as_array", "shm_listing", "rss_bytes", "close_peers", "run_ranks",
    "peer_factory", "pair_holder", "pair",
]

#: Deadline of one command; generous because the machine is small and shared.
CALL_TIMEOUT_S = 20.0
#: Spawning a child means importing torch, which takes seconds on a loaded 2-core box.
START_TIMEOUT_S = 45.0
EXIT_TIMEOUT_S = 15.0
#: How long a frozen child may take until all its threads have stopped.
STOP_TIMEOUT_S = 5.0

_CTX = multiprocessing.get_context("spawn")


# --------------------------------------------------------------------------- errors


class PeerError(Exception):
    """A command raised in a child; carries what the child saw."""

    def __init__(self, peer: str, exc_type: str, status_code: Optional[int], message: str,
                 remote_traceback: str, bases: Sequence[str] = ()) -> None:
        super().__init__(f"{peer}: {exc_type}(status_code={status_code}): {message}\n"
                         f"--- traceback in {peer} ---\n{remote_traceback}")
        self.peer = peer
        self.exc_type = exc_type
        self.status_code = status_code
        self.message = message
        self.remote_traceback = remote_traceback
        #: Class names of the exception's MRO, so tests check ``isinstance`` by name.
        self.bases = tuple(bases) or (exc_type,)

    def is_a(self, *names: str) -> bool:
        """Whether the child's exception is an instance of a class with one of ``names``."""
        return any(n in self.bases for n in names)


class PeerDied(Exception):
    """A child ended (or hung and was killed) while the test waited on it."""


@contextlib.contextmanager
def expect_llm(code: Any, *alternatives: Any) -> Iterator[List[PeerError]]:
    """Expect the child's command to raise ``LLMException`` with ``code`` (or an alternative).

    Yields a list that holds the caught :class:`PeerError` afterwards, for message checks.
    """
    caught: List[PeerError] = []
    wanted = {int(c) for c in (code,) + alternatives}
    with pytest.raises(PeerError) as info:
        yield caught
    err = info.value
    caught.append(err)
    assert err.is_a("LLMException"), f"expected LLMException {sorted(wanted)}, got {err}"
    assert err.status_code in wanted, f"expected status {sorted(wanted)}, got {err}"


@contextlib.contextmanager
def expect_exc(*exc_types: str, codes: Sequence[Any] = ()) -> Iterator[List[PeerError]]:
    """Expect the child's command to raise one of ``exc_types`` (by class name).

    An ``LLMException`` among them must carry one of ``codes`` when codes are given.
    """
    caught: List[PeerError] = []
    with pytest.raises(PeerError) as info:
        yield caught
    err = info.value
    caught.append(err)
    assert err.is_a(*exc_types), f"expected one of {exc_types}, got {err}"
    if err.is_a("LLMException") and codes:
        assert err.status_code in {int(c) for c in codes}, f"unexpected status: {err}"


# --------------------------------------------------------------------------- parent side


class Pending:
    """A command in flight: notes the child sends while running it, then its result."""

    def __init__(self, peer: "Peer", op: str) -> None:
        self._peer = peer
        self._op = op
        self._done = False
        self._result: Any = None

    def note(self, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Wait for the next progress note of the command."""
        kind, payload = self._peer._receive(self._op, timeout)
        if kind != "note":
            self._finish(kind, payload)
            raise AssertionError(f"{self._peer.name}: {self._op} finished before its note: "
                                 f"{self._result!r}")
        return payload

    def result(self, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Wait for the command's answer; re-raises the child's exception as PeerError."""
        while not self._done:
            kind, payload = self._peer._receive(self._op, timeout)
            if kind != "note":
                self._finish(kind, payload)
        return self._result

    def _finish(self, kind: str, payload: Any) -> None:
        self._done = True
        self._peer._busy = False
        if kind == "exc":
            raise PeerError(self._peer.name, **payload)
        self._result = payload


class Peer:
    """One engine process driven over a Pipe.

    ``config`` holds ``LLMConfig`` property values; with ``init=True`` the child creates
    ``LLMDataDist(role, cluster_id)`` and initializes it before it reports ready.  With
    ``netns`` the child runs in that network namespace, where peers reach it at ``address``.
    """

    def __init__(self, name: str, role: str, cluster_id: int, config: Dict[str, Any], *,
                 init: bool = True, netns: Optional[str] = None, address: str = "127.0.0.1") -> None:
        self.name = name
        self.role = role
        self.cluster_id = cluster_id
        self.config = dict(config)
        self.address = address
        self._conn, child_conn = _CTX.Pipe()
        self.process = _CTX.Process(
            target=child_main, name=f"datadist-{name}",
            args=(child_conn, role, cluster_id, self.config, init, netns), daemon=True)
        self.process.start()
        child_conn.close()
        self._ready = False
        self._busy = False
        self._stopped = False
        self.info: Dict[str, Any] = {}

    # lifecycle

    @property
    def pid(self) -> int:
        """The child's process id."""
        assert self.process.pid is not None
        return self.process.pid

    @property
    def alive(self) -> bool:
        """Whether the child still runs."""
        return self.process.is_alive()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "Peer":
        """Wait until the child has imported datadist (and initialized its engine)."""
        if not self._ready:
            kind, payload = self._receive("start", timeout)
            if kind == "exc":
                raise PeerError(self.name, **payload)
            assert kind == "ready", (kind, payload)
            self.info = payload
            self._ready = True
        return self

    def stop(self) -> None:
        """Freeze the child (SIGSTOP), and return once every thread of it has stopped: a
        thread running on another core (an agent polling for its next request) would
        otherwise still serve a request sent right after."""
        os.kill(self.pid, signal.SIGSTOP)
        self._stopped = True
        until(lambda: _all_stopped(self.pid), STOP_TIMEOUT_S, f"{self.name} (pid {self.pid}) stopped",
              every=PACED)

    def cont(self) -> None:
        """Resume a frozen child (SIGCONT)."""
        if self._stopped:
            os.kill(self.pid, signal.SIGCONT)
            self._stopped = False

    def kill(self) -> float:
        """SIGKILL the child, reap it and assert it died of the signal.

        Returns the monotonic time just before the signal was sent.
        """
        self.cont()
        t_kill = time.monotonic()
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(EXIT_TIMEOUT_S)
        assert self.process.exitcode == -signal.SIGKILL, (
            f"{self.name}: exit code {self.process.exitcode} after SIGKILL")
        self._conn.close()
        return t_kill

    def shutdown(self, timeout: float = EXIT_TIMEOUT_S) -> None:
        """Ask the child to finalize and exit; assert it exits with code 0."""
        if self.process.exitcode is not None or not self.alive:
            return
        self.cont()
        self.call("exit", timeout=timeout)
        self.process.join(timeout)
        assert self.process.exitcode == 0, f"{self.name}: exit code {self.process.exitcode}"
        self._conn.close()

    def close(self) -> None:
        """Teardown: graceful exit when possible (exit code asserted), else SIGKILL."""
        if self.process.exitcode is not None:
            return
        try:
            if self._ready and not self._busy:
                self.shutdown()
        finally:
            if self.process.exitcode is None:
                self.cont()
                self.process.kill()
                self.process.join(EXIT_TIMEOUT_S)
            self._conn.close()

    # commands

    def start_call(self, op: str, *args: Any, **kwargs: Any) -> Pending:
        """Send a command without waiting for its answer."""
        self.wait_ready()
        assert not self._busy, f"{self.name}: a command is still in flight"
        self._conn.send((op, args, kwargs))
        self._busy = True
        return Pending(self, op)

    def call(self, op: str, *args: Any, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        """Run a command in the child and return its result (PeerError if it raised)."""
        return self.start_call(op, *args, **kwargs).result(timeout)

    def cm(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S,
           **kwargs: Any) -> Any:
        """Call ``engine.cache_manager.<method>(*args, **kwargs)`` in the child."""
        return self.call("cm", method, args, kwargs, timeout=timeout)["result"]

    def timed_cm(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S,
                 **kwargs: Any) -> Tuple[Any, float]:
        """Like :meth:`cm`, also returning the seconds the call took inside the child."""
        out = self.call("cm", method, args, kwargs, timeout=timeout)
        return out["result"], out["elapsed"]

    def link(self, remote: "Peer", *, port: Optional[int] = None, timeout_ms: int = 3000,
             expect_ok: bool = True) -> Tuple[int, List[int]]:
        """``link_clusters`` from this peer (the client) to ``remote`` (the server)."""
        port = port if port is not None else remote.listen_port
        remote.wait_ready()  # its listener is up only once its engine has initialized
        ret, rets = self.call("link", [(remote.cluster_id, remote.address, port)], timeout_ms,
                              timeout=timeout_ms / 1000 + CALL_TIMEOUT_S)
        if expect_ok:
            assert ret == 0 and rets == [0], f"link {self.name} -> {remote.name}: {ret} {rets}"
        return ret, rets

    @property
    def listen_port(self) -> int:
        """The port given in ``listen_ip_info``."""
        return int(self.config["listen_ip_info"].rsplit(":", 1)[1])

    def alloc(self, name: str, desc: Desc, **kwargs: Any) -> Dict[str, Any]:
        """Allocate a cache from the pool (``blocks=True`` for a blocks cache)."""
        return self.call("alloc", name, desc, **kwargs)

    def register(self, name: str, desc: Desc, **kwargs: Any) -> Dict[str, Any]:
        """Register child-owned torch tensors as a cache (``blocks=True`` for blocks)."""
        return self.call("register", name, desc, **kwargs)

    def write(self, name: str, data: np.ndarray) -> None:
        """Overwrite the cache's tensors with the rows of ``data`` (uint8, one per tensor)."""
        self.call("write", name, [bytes(row) for row in data])

    def read(self, name: str) -> np.ndarray:
        """The cache's bytes as a ``(num_tensors, tensor_bytes)`` uint8 array."""
        return as_array(self.call("read", name))

    def fill(self, name: str, desc: Desc, seed: int) -> np.ndarray:
        """Fill the cache with seeded random bytes; returns what was written."""
        data = random_bytes(desc, seed)
        self.write(name, data)
        return data

    def snapshot(self) -> Dict[str, Any]:
        """Open fds, Python threads and mapped /dev/shm files of the child."""
        return self.call("snapshot")

    # plumbing

    def _receive(self, op: str, timeout: float) -> Tuple[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                ready = self._conn.poll(max(0.0, min(left, 0.5)))
            except (OSError, EOFError):
                ready = True
            if ready:
                try:
                    return self._conn.recv()
                except (EOFError, OSError):
                    self.process.join(EXIT_TIMEOUT_S)
                    raise PeerDied(f"{self.name} (pid {self.process.pid}) ended during "
                                   f"{op!r}: exit code {self.process.exitcode}") from None
            if not self.alive and not self._conn.poll(0):
                raise PeerDied(f"{self.name} (pid {self.process.pid}) ended during {op!r}: "
                               f"exit code {self.process.exitcode}")
            if left <= 0:
                self.cont()
                self.process.kill()
                self.process.join(EXIT_TIMEOUT_S)
                raise PeerDied(f"{self.name}: no answer to {op!r} within {timeout:.1f} s; "
                               "killed it")


@dataclasses.dataclass
class Pair:
    """A prompt (server) and a decoder (client) linked to it."""

    prompt: Peer
    decoder: Peer
    transport: str

    def peers(self) -> Tuple[Peer, Peer]:
        """Both peers."""
        return self.prompt, self.decoder


def start_pair(transport: str, *, link: bool = True, init: bool = True,
               prompt_id: int = PROMPT_ID, decoder_id: int = DECODER_ID,
               sync_kv_timeout: int = SYNC_KV_TIMEOUT_MS,
               spawned: Optional[List[Peer]] = None) -> Pair:
    """Spawn both engines at once (their start-up overlaps) and link them.

    Every peer started is appended to ``spawned`` first, so the caller's teardown
    reaches it even when start-up fails.
    """
    port = free_port()
    prompt = Peer("prompt", "PROMPT", prompt_id,
                  base_config(transport, listen_port=port, sync_kv_timeout=sync_kv_timeout),
                  init=init)
    if spawned is not None:
        spawned.append(prompt)
    decoder = Peer("decoder", "DECODER", decoder_id,
                   base_config(transport, sync_kv_timeout=sync_kv_timeout), init=init)
    if spawned is not None:
        spawned.append(decoder)
    prompt.wait_ready()
    decoder.wait_ready()
    if link:
        decoder.link(prompt)
    return Pair(prompt, decoder, transport)


def close_peers(peers: Iterable["Peer"]) -> None:
    """Shut every peer down (exit codes asserted) or kill it, then assert that none failed,
    naming each that did: every peer is reaped even if one fails."""
    errors = []
    for peer in peers:
        try:
            peer.close()
        except Exception as exc:
            errors.append(f"{peer.name}: {exc!r}")
    assert not errors, "teardown: " + "; ".join(errors)


def run_ranks(commands: Sequence[List[str]], env: Dict[str, str], timeout: float) -> List[subprocess.CompletedProcess]:
    """Start one process per command at once (the ranks of a group) and wait for each, at
    most ``timeout`` seconds apiece; any still running afterwards (a failed wait) is killed
    and reaped.  Their exit codes and outputs, in order."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in commands]
    done = []
    try:
        for cmd, p in zip(commands, procs):
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


@pytest.fixture
def peer_factory() -> Iterator[Callable[..., Any]]:
    """Start peers and pairs that are shut down (exit code checked) or killed at teardown."""
    spawned: List[Peer] = []

    def make(kind: str = "peer", *args: Any, **kwargs: Any) -> Any:
        if kind == "pair":
            return start_pair(*args, spawned=spawned, **kwargs)
        peer = Peer(*args, **kwargs)
        spawned.append(peer)
        return peer

    yield make
    close_peers(reversed(spawned))


class PairHolder:
    """A module's linked pair; started again when a test left a peer dead."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.spawned: List[Peer] = []
        self.pair: Optional[Pair] = None

    def get(self) -> Pair:
        """The pair, (re)started if needed."""
        if self.pair is None or not all(p.alive for p in self.pair.peers()):
            self.close()
            self.pair = start_pair(self.transport, spawned=self.spawned)
        return self.pair

    def close(self) -> None:
        """Shut both peers down (exit codes asserted) or kill them."""
        spawned, self.spawned, self.pair = self.spawned, [], None
        close_peers(spawned)


@pytest.fixture(scope="module", params=TRANSPORTS)
def pair_holder(request: pytest.FixtureRequest) -> Iterator[PairHolder]:
    """One linked pair per transport for the whole module."""
    holder = PairHolder(request.param)
    yield holder
    holder.close()


@pytest.fixture
def pair(pair_holder: PairHolder) -> Iterator[Pair]:
    """The module's linked pair of the current transport; caches are freed afterwards."""
    current = pair_holder.get()
    yield current
    for peer in current.peers():
        if peer.alive and not peer._busy:
            peer.call("free_all")


# --------------------------------------------------------------------------- host state


def shm_listing() -> set:
    """Names in /dev/shm, without multiprocessing's semaphores."""
    return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.")}


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (bytes), from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for pid {pid}")


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state ``T`` in ``/proc``)."""
    task = f"/proc/{pid}/task"
    try:
        states = []
        for tid in os.listdir(task):
            with open(f"{task}/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except FileNotFoundError:  # a thread ended meanwhile: look again
        return False
    return bool(states) and all(state in ("T", "t") for state in states)
