"""On an NPU machine nothing reads device memory as host memory: run against a fake NPU
whose device memory the host cannot touch (tests/fake_npu: torch's PrivateUse1 backend
renamed ``npu``, pages PROT_NONE outside its own kernels, and a ``torch_npu`` stand-in).

A code path that took an NPU tensor's address for host memory would die with SIGSEGV
here; the tests check each path ends in its clear error instead, and that the device
itself works (so a refusal is a decision, not an accident).  Each case runs in a process
of its own, with ``tests/fake_npu`` on ``PYTHONPATH``; the extension is built once
(``torch.utils.cpp_extension``; skipped without a C++ compiler).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKE_NPU = Path(__file__).resolve().parents[1] / "fake_npu"

pytestmark = [pytest.mark.fake_npu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def npu_env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Environment of a child with the fake NPU; builds the extension once per run."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build the fake NPU")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_NPU), os.environ.get("PYTHONPATH", "")]),
           "DATADIST_FAKE_NPU_BUILD": str(tmp_path_factory.mktemp("fake-npu-build"))}
    built = subprocess.run([sys.executable, "-c", "import torch_npu"], env=env, capture_output=True, text=True,
                           timeout=280)
    assert built.returncode == 0, f"building the fake NPU failed:\n{built.stderr[-6000:]}"
    return env


def _run(env: dict, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-6000:]}"
    return done.stdout


def test_the_device_computes_and_its_memory_is_not_host_memory(npu_env: dict) -> None:
    out = _ok(_run(npu_env, """
        import torch, torch_npu
        t = torch.arange(24, dtype=torch.float16).reshape(4, 6).to("npu")
        u = torch.zeros(4, 6, dtype=torch.float16, device="npu")
        idx = torch.tensor([3, 1], device="npu")
        u.index_copy_(0, idx, t.index_select(0, torch.tensor([0, 2], device="npu")))
        u.narrow(1, 4, 2).fill_(7)
        print(t.device, u.cpu()[3].tolist(), u.cpu()[1].tolist(), u.cpu()[0].tolist())
    """))
    assert out.split()[0] == "npu:0"
    assert "[0.0, 1.0, 2.0, 3.0, 7.0, 7.0]" in out and "[12.0, 13.0, 14.0, 15.0, 7.0, 7.0]" in out
    crashed = _run(npu_env, """
        import ctypes, torch, torch_npu
        t = torch.ones(1024, device="npu")
        print(ctypes.string_at(t.data_ptr(), 8))  # a host read of device memory
    """)
    assert crashed.returncode == -signal.SIGSEGV, (crashed.returncode, crashed.stdout, crashed.stderr[-2000:])


@pytest.mark.parametrize("device_type", ["npu", "auto"])
def test_an_npu_engine_is_a_clear_error_not_host_memory(npu_env: dict, device_type: str) -> None:
    out = _ok(_run(npu_env, f"""
        import torch_npu
        from datadist import LLMConfig, LLMDataDist, LLMException, LLMRole
        config = LLMConfig()
        config.device_type = {device_type!r}
        try:
            LLMDataDist(LLMRole.PROMPT, 1).init(config.generate_options())
        except LLMException as exc:
            print(exc.status_code.name, "|", exc)
    """))
    assert out.startswith("LLM_FEATURE_NOT_ENABLED |") and "NPU" in out, out


def test_npu_tensors_are_refused_by_a_host_engine(npu_env: dict) -> None:
    out = _ok(_run(npu_env, """
        import torch, torch_npu
        from datadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMException, LLMRole
        config = LLMConfig()
        config.device_type = "cpu"
        engine = LLMDataDist(LLMRole.PROMPT, 1)
        engine.init(config.generate_options())
        tensors = [torch.ones(4, 8, dtype=torch.float16, device="npu") for _ in range(2)]
        try:
            engine.cache_manager.register_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT16), tensors,
                                                       BlocksCacheKey(1, 0))
        except LLMException as exc:
            print(exc.status_code.name, "|", exc)
        print("still", tensors[0].cpu().sum().item())
        engine.finalize()
    """))
    assert out.startswith("LLM_FEATURE_NOT_ENABLED |") and "npu" in out and "still 32.0" in out, out


def test_ems_refuses_npu_caches_and_bare_addresses(npu_env: dict) -> None:
    out = _ok(_run(npu_env, """
        import torch, torch_npu
        from ems import KvBufferWrapper
        from ems.kvcache import KvLayout
        cache = [[torch.zeros(4, 2, 2, 8, device="npu") for _ in range(2)] for _ in range(2)]
        try:
            KvLayout(cache, None, "MHA")
        except Exception as exc:
            print("kvcache:", type(exc).__name__, exc)
        t = torch.ones(64, dtype=torch.uint8, device="npu")
        for wrapper in (KvBufferWrapper(t.data_ptr, 64), KvBufferWrapper(t.data_ptr(), 64)):
            try:
                wrapper.address()
            except Exception as exc:  # EMS_INVALID_ARGUMENT at the API
                print("wrapper:", exc)
        host = torch.ones(64, dtype=torch.uint8)
        print("host ok", KvBufferWrapper(host.data_ptr, 64).address() == host.data_ptr())
    """))
    assert "kvcache:" in out and "npu" in out.split("kvcache:")[1].split("\n")[0], out
    wrappers = [line for line in out.splitlines() if line.startswith("wrapper:")]
    assert len(wrappers) == 2 and "npu" in wrappers[0] and "NPU" in wrappers[1], out
    assert "host ok True" in out, out
