"""CANN's llm_datadist samples (hicann/hixl ``examples/python/llm_datadist``), unchanged, run
the way their README runs them: on two hosts ``10.10.10.0`` and ``10.10.10.1`` (network
namespaces on one bridge, ``GLOO_SOCKET_IFNAME`` naming the interface as the README does),
each process on an NPU of the fake NPU (``tests/fake_npu``, autoloaded by ``import torch``
as torch_npu is), ``import llm_datadist`` resolving to this project.  The fixed ports the
samples use (26000, 26001, 29500, 16666) are free in namespaces of their own.

The samples are not part of this repository: ``LLM_DATADIST_SAMPLES`` names that
directory of a hixl checkout; without it the module skips.  A sample passes when every
process exits 0 (the samples raise on every failed status) and the tensors a process
prints after its transfer hold what the transfer must have left there.  Not run: the
``--is_single`` variants, which list ``/dev/davinci*`` and ask ``hccn_tool`` for device
addresses.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
import pytest

from datadist.bench.netns import Cluster
from fake_npu_env import FAKE_NPU, npu_env  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.cluster, pytest.mark.fake_npu, pytest.mark.timeout(300)]

SAMPLES = os.environ.get("LLM_DATADIST_SAMPLES", "")
#: The README's two hosts.
A, B = "10.10.10.0", "10.10.10.1"
RUN_S = 150.0

#: (host index, the sample's arguments) of each process of a run.
Procs = Sequence[Tuple[int, Sequence[str]]]


def _prompt_decoder(*extra: str) -> Procs:
    """The README's socket-linked pair: the prompt on A (device 0), the decoder on B (device 1)."""
    return [(0, ["--device_id", "0", "--role", "p", "--local_host_ip", A, "--remote_host_ip", B, *extra]),
            (1, ["--device_id", "1", "--role", "d", "--local_host_ip", B, "--remote_host_ip", A, *extra])]


#: The rank-table samples: cluster 1 (the prompt) on A, cluster 2 on B, device 0 on each.
RANK_TABLE: Procs = [(0, ["--device_id", "0", "--cluster_id", "1"]), (1, ["--device_id", "0", "--cluster_id", "2"])]
#: The README's xpyd command: two prompts and two decoders on host A, one device each.
XPYD: Procs = [(0, ["--device_id", "0", "--role", "p", "--local_ip_port", f"{A}:26000"]),
               (0, ["--device_id", "1", "--role", "p", "--local_ip_port", f"{A}:26001"]),
               (0, ["--device_id", "2", "--role", "d", "--local_ip_port", f"{A}:26002",
                    "--remote_ip_port", f"{A}:26000;{A}:26001"]),
               (0, ["--device_id", "3", "--role", "d", "--local_ip_port", f"{A}:26003",
                    "--remote_ip_port", f"{A}:26000;{A}:26001"])]


def _rows(*values: float) -> np.ndarray:
    """A 3 x 10 tensor of the samples whose row i holds ``values[i]``."""
    return np.repeat(np.array(values, dtype=np.float64)[:, None], 10, axis=1)


def _xpyd_id(port: int) -> int:
    """The xpyd sample's cluster id of ``A:port`` (the address and port in one integer)."""
    return (0x0A0A0A00 << 16) | port


_PUSHED = {"after decoder push, tensor": _rows(0, 1, 0), "after decoder push, tensor2": _rows(0, 1, 0)}
#: What a decoder of the xpyd sample prints after pulling blocks 0, 1 of each prompt into its 0, 2.
_PULLED_FROM = {f"after decoder pull from {_xpyd_id(p)}, tensor": _rows(_xpyd_id(p), 0, _xpyd_id(p))
                for p in (26000, 26001)}

#: name -> (sample file, processes, {process index: {printed name: tensor it must show}}).
RUNS: Dict[str, Tuple[str, Procs, Dict[int, Dict[str, np.ndarray]]]] = {
    "push_blocks": ("push_blocks_sample.py", _prompt_decoder(), {0: _PUSHED}),
    "push_blocks-hixl": ("push_blocks_sample.py", _prompt_decoder("--transfer_backend", "hixl"), {0: _PUSHED}),
    "push_cache": ("push_cache_sample.py", _prompt_decoder(),
                   {0: {"after decoder push, tensor": _rows(1, 0, 0), "after decoder push, tensor2": _rows(1, 0, 0)}}),
    "push_cache-hixl": ("push_cache_sample.py", _prompt_decoder("--transfer_backend", "hixl"),
                        {0: {"after decoder push, tensor": _rows(1, 0, 0)}}),
    "switch_role": ("switch_role_sample.py", _prompt_decoder(),
                    {0: {"after decoder push, tensor": _rows(1, 0, 1), "after decoder push, tensor2": _rows(1, 0, 1)},
                     1: {"after decoder pull, tensor": _rows(1, 0, 1), "after decoder pull, tensor2": _rows(1, 0, 1)}}),
    "transfer_cache_async": ("transfer_cache_async_sample.py", _prompt_decoder(),
                             {1: {"after prompt transfer cache, tensor": _rows(1, 1, 1),
                                  "after prompt transfer cache, tensor2": _rows(1, 1, 1)}}),
    "transfer_cache_async-hixl": ("transfer_cache_async_sample.py", _prompt_decoder("--transfer_backend", "hixl"),
                                  {1: {"after prompt transfer cache, tensor": _rows(1, 1, 1)}}),
    "hixl_transfer_backend": ("hixl_transfer_backend_sample.py", _prompt_decoder(), {}),  # checks its own bytes
    "pull_blocks": ("pull_blocks_sample.py", RANK_TABLE, {}),  # prints a 2 x 1M tensor, elided
    "pull_cache": ("pull_cache_sample.py", RANK_TABLE, {}),
    "pull_from_cache_to_blocks": ("pull_from_cache_to_blocks.py", RANK_TABLE, {}),
    "pull_blocks_xpyd": ("pull_blocks_xpyd_sample.py", XPYD, {2: _PULLED_FROM, 3: _PULLED_FROM}),
}


@pytest.fixture(scope="module")
def hosts(netns_ok: None) -> Iterator[Cluster]:
    """Two hosts with the README's addresses (beside the cluster's own)."""
    if not SAMPLES:
        pytest.skip("LLM_DATADIST_SAMPLES is not set (the directory examples/python/llm_datadist of a hixl "
                    "checkout): CANN's samples are not part of this repository")
    cluster = Cluster(2)
    try:
        for host, address in zip(cluster.hosts, (A, B)):
            host.run("ip", "addr", "add", f"{address}/24", "dev", "eth0")
        yield cluster
    finally:
        cluster.close()


def printed(output: str, name: str) -> np.ndarray:
    """The last tensor a sample logged as ``name=tensor([...])``."""
    start = output.rindex(f"{name}=tensor(") + len(f"{name}=tensor(")
    depth = 0
    for end in range(start, len(output)):
        depth += {"[": 1, "]": -1}.get(output[end], 0)
        if depth == 0:
            return np.array(ast.literal_eval(output[start:end + 1]), dtype=np.float64)
    raise AssertionError(f"{name}: the tensor printed is cut off")


def _run(hosts: Cluster, sample: Path, procs: Procs, env: dict, logs: Path) -> List[Tuple[int, str]]:
    """Start every process of a run at once; their exit codes and output, in order."""
    started = []
    for i, (host, args) in enumerate(procs):
        log = open(logs / f"{i}.log", "w+")
        started.append((subprocess.Popen(hosts[host].argv(sys.executable, str(sample), *args), stdout=log,
                                         stderr=subprocess.STDOUT, cwd=logs, env=env), log))
    deadline = time.monotonic() + RUN_S
    done = []
    for proc, log in started:
        try:
            code = proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _ in started:
                other.kill()
            code = proc.wait()
        log.seek(0)
        done.append((code, log.read()))
        log.close()
    return done


@pytest.mark.parametrize("name", list(RUNS))
def test_cann_sample_unchanged(hosts: Cluster, npu_env: dict, tmp_path: Path, name: str) -> None:
    file, procs, expected = RUNS[name]
    sample = Path(SAMPLES) / file
    assert sample.is_file(), f"{sample} is missing from LLM_DATADIST_SAMPLES"
    env = {**npu_env, "GLOO_SOCKET_IFNAME": "eth0", "HCCL_INTRA_ROCE_ENABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(FAKE_NPU), str(Path(__file__).resolve().parents[2])])}
    done = _run(hosts, sample, procs, env, tmp_path)
    failed = [f"--- process {i} ({' '.join(procs[i][1])}) exited {code}\n{out[-4000:]}"
              for i, (code, out) in enumerate(done) if code != 0]
    assert not failed, "\n".join(failed)
    for i, tensors in expected.items():
        for label, want in tensors.items():
            got = printed(done[i][1], label)
            # rtol: torch prints 5 significant digits of the xpyd sample's large values
            np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=f"process {i}: {label}")
