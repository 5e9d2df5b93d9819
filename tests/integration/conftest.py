"""Fixtures of the real-process harness (see harness.py), for every module in this folder,
the fake NPU's environment (fake_npu_env.py: defined here once, so its session-scoped
build runs once per run, not once per module that imports it), and a private
``ems-server`` for tests that run client code as a user would."""
import os
import select
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator

import pytest

from fake_npu_env import npu_env, npu_peers
from harness import pair, pair_holder, peer_factory

__all__ = ["pair", "pair_holder", "peer_factory", "npu_env", "npu_peers", "ems_pool_dir"]


@pytest.fixture(scope="session", autouse=True)
def _vllm_sockets_in_a_folder_of_the_run() -> Iterator[None]:
    """vLLM's processes make their ZeroMQ sockets in ``VLLM_RPC_BASE_PATH`` (the temp
    folder by default) and leave them behind when stopped or killed: the run's go into a
    folder of its own, removed at its end."""
    folder = tempfile.mkdtemp(prefix="vllm-rpc-")
    before = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = folder
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = before
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def ems_pool_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An ``ems-server`` of this module's own; yields its directory (an ``EMS_SERVER``
    value), so client code never touches the node's ``/dev/shm/ems``."""
    directory = str(tmp_path_factory.mktemp("ems-pool"))
    ready_r, ready_w = os.pipe()
    daemon = subprocess.Popen([sys.executable, "-m", "ems.server", "serve", "--dir", directory, "--capacity", "64M",
                               "--log-level", "WARNING", "--ready-fd", str(ready_w)], pass_fds=(ready_w,),
                              stdin=subprocess.DEVNULL)
    os.close(ready_w)
    try:
        readable, _, _ = select.select([ready_r], [], [], 30)
        assert readable and os.read(ready_r, 256).startswith(b"READY"), "ems-server did not start in 30 s"
        yield directory
    finally:
        os.close(ready_r)
        daemon.terminate()
        assert daemon.wait(30) == 0
