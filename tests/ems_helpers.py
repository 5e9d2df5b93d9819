"""Shared helpers of the ems tests: real daemons and redis-servers in temporary directories.

``tests/`` is on ``sys.path`` under pytest (``pythonpath`` in pyproject.toml's
``[tool.pytest.ini_options]``), so test modules import what they need directly::

    from ems_helpers import EmsDaemon, daemon_factory, ems_cc, run_client

Child interpreters started with :data:`ENV` (``run_client`` does) see the source tree and
``tests/`` through ``PYTHONPATH``: a client script imports ``ems_helpers`` the same way.

Every process started here is killed at teardown, and the fixtures assert that none is left
behind and that no shared-memory entry appeared in /dev/shm.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator, List, Optional

import pytest
from ports import free_port  # noqa: F401  (the tests import it from here)
from waiting import until

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
#: The environment of every child interpreter: the source tree and ``tests/`` (this module)
#: ahead of the caller's ``PYTHONPATH``.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    p for p in (str(ROOT), str(TESTS), os.environ.get("PYTHONPATH")) if p)}


def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


class EmsDaemon:
    """An ``ems-server`` process serving a temporary directory."""

    def __init__(self, directory: Path, capacity: str = "64M", disk_dir: Optional[Path] = None,
                 disk_capacity: str = "256M", remote: Optional[str] = None,
                 credentials: Optional[Path] = None, tcp: bool = False, extra: List[str] = (),
                 launcher: List[str] = ()) -> None:
        self.dir = str(directory)
        #: What the daemon's command line is run through (``ip netns exec NS``: another host).
        self.launcher = list(launcher)
        self.args = ["--dir", self.dir, "--capacity", capacity, "--log-level", "WARNING"]
        if disk_dir is not None:
            self.args += ["--disk-dir", str(disk_dir), "--disk-capacity", disk_capacity]
        if remote:
            self.args += ["--remote", remote]
        if credentials is not None:
            self.args += ["--credentials", str(credentials)]
        if tcp:
            self.args += ["--tcp", "127.0.0.1:0"]
        self.args += list(extra)
        self.proc: Optional[subprocess.Popen] = None
        self.tcp: Optional[str] = None
        self.log = Path(self.dir + ".log")
        self.killed = False  # a SIGKILLed daemon leaves its socket file (the next start replaces it)

    def start(self, timeout: float = 20.0) -> "EmsDaemon":
        from ems.client.autostart import read_ready

        self.killed = False
        r, w = os.pipe()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*self.launcher, sys.executable, "-m", "ems.server", "serve", *self.args,
                                          "--ready-fd", str(w)], pass_fds=(w,), env=ENV,
                                         stdout=log, stderr=log)
        os.close(w)
        try:
            line = read_ready(r, time.monotonic() + timeout)
        finally:
            os.close(r)
        if line is None:
            raise AssertionError(f"ems-server did not get ready: {self.log.read_text()}")
        text = line.split()
        if not text or text[0] != "READY":
            raise AssertionError(f"ems-server failed: {line!r} {self.log.read_text()}")
        self.tcp = text[2] if text[2] != "-" else None
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful: spills to disk) and wait; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the daemon dies without any cleanup."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
            self.killed = True

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """The daemon stopped (SIGSTOP) for the block.  ``kill`` returns before every thread
        has stopped (one may still answer a request); ``waitpid(WUNTRACED)`` returns once
        the kernel has stopped them all, so nothing in the block races the signal."""
        os.kill(self.pid, signal.SIGSTOP)
        try:
            _, status = os.waitpid(self.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), status
            yield
        finally:
            os.kill(self.pid, signal.SIGCONT)


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator:
    """``make(**kwargs) -> EmsDaemon`` (started); all are stopped at teardown, and the test
    fails if one does not exit or /dev/shm gained entries."""
    before = _shm_entries()
    made: List[EmsDaemon] = []
    count = [0]

    def make(directory: Optional[Path] = None, **kwargs) -> EmsDaemon:
        count[0] += 1
        d = EmsDaemon(directory or tmp_path / f"d{count[0]}", **kwargs)
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.stop()
        assert not d.alive(), f"daemon {d.pid} did not exit"
        if not d.killed:
            assert not os.path.exists(os.path.join(d.dir, "ems.sock")), "socket file left behind"
    leaked = {e for e in _shm_entries() - before if "ems" in e}
    assert not leaked, f"shared memory left in /dev/shm: {leaked}"


@pytest.fixture
def ems_daemon(daemon_factory) -> EmsDaemon:
    return daemon_factory()


def init_cc(server: str, model_id: str = "m-test", access_id: Optional[str] = None,
            access_key: Optional[str] = None, **cc_kwargs):
    """``Ems.init`` against ``server`` and return the ContextCaching (call Ems._shutdown after)."""
    from ems import CcConfig_v1, Ems, EmsConfig

    Ems._shutdown()
    cc_cfg = CcConfig_v1(rank_id=cc_kwargs.pop("rank_id", 0), device_id=0, model_id=model_id, **cc_kwargs)
    Ems.init(EmsConfig(cc_config=cc_cfg, server=server, access_id=access_id, access_key=access_key))
    return Ems.get_cc()


@pytest.fixture
def ems_cc(ems_daemon) -> Iterator:
    """A ContextCaching on a fresh daemon, shut down after the test."""
    from ems import Ems

    cc = init_cc(ems_daemon.dir)
    yield cc
    Ems._shutdown()


def kvcache(layers: int = 2, kv: int = 2, blocks: int = 8, block_size: int = 4, heads: int = 2,
            head_size: int = 4, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(blocks, block_size, heads, head_size, generator=g) for _ in range(kv)]
            for _ in range(layers)]


def run_client(code: str, timeout: float = 60.0, env: Optional[dict] = None,
               cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; returns the completed process (stdout, stderr)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env={**ENV, **(env or {})}, cwd=cwd)


def check(proc: subprocess.CompletedProcess, code: int = 0) -> str:
    """Assert the exit code, surfacing the child's output on failure; returns stdout."""
    assert proc.returncode == code, (f"exit {proc.returncode} (wanted {code})\n--- stdout\n{proc.stdout}"
                                     f"\n--- stderr\n{proc.stderr}")
    return proc.stdout


class RedisServer:
    """A ``redis-server`` on a loopback port, in a temporary directory."""

    def __init__(self, directory: Path, port: int, cluster: bool = False) -> None:
        self.port = port
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(directory), "--protected-mode", "no"]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                     "--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 20.0) -> None:
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)

        def answers() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server on port {self.port} exited with {self.proc.returncode}")
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False  # still binding

        try:
            until(answers, timeout, f"redis-server on port {self.port} answers", every=0.05)
        except AssertionError:
            self.stop()
            raise
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def need_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    pytest.importorskip("redis", reason="the 'redis' package is not installed (pip install 'redis>=5')")


def daemon_queues(sock: socket.socket) -> tuple[int, int]:
    """The daemon's end of ``sock``: bytes it has not sent yet and bytes it has not read
    (the kernel's ``/proc/net/tcp`` queues of the connection seen from that side)."""
    local = "%04X" % sock.getsockname()[1]
    remote = "%04X" % sock.getpeername()[1]
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1].endswith(":" + remote) and fields[2].endswith(":" + local):
                tx, rx = fields[4].split(":")
                return int(tx, 16), int(rx, 16)
    raise AssertionError("the connection is not in /proc/net/tcp")
