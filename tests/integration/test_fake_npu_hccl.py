"""HCCL as the device path between NPU engines, on the fake NPU and its fake HCCL
(``tests/fake_npu/torch_npu/_hccl.py``: torch_npu's ``ProcessGroupHCCL`` binding, a
communicator that forms on the first operation after a delay, a switch that makes a peer
never post), and what an NPU machine's user is told (no silent fallbacks).

Links between two NPU engines with ``transfer_backend`` ``auto`` go over hccl (host
engines keep their sockets); the communicator is formed while the link is made, so a
transfer's ``sync_kv_timeout`` never pays for it; a peer that never posts ends a transfer
in ``LLM_TIMEOUT`` within that timeout, the link reports the failure, and a new link
works.  Each property runs in processes of its own.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datadist import LLMStatusCode
from fake_npu_env import ok, run
from harness import DECODER_ID, PROMPT_ID, Desc, Ref, base_config, blocks_key, expect_blocks, free_port, run_ranks

pytestmark = [pytest.mark.fake_npu, pytest.mark.timeout(300)]

BLOCKS = Desc(4, (8, 16, 32), "fp16")  # 2 layers x K, V; 8 blocks of 1 KiB


# ---------------------------------------------------------------------------- the fake HCCL
_GROUP = """
    import datetime, sys, time, torch, torch_npu
    from torch._C._distributed_c10d import PrefixStore, TCPStore
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    torch.npu.set_device(rank)
    store = PrefixStore("test", TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60)))
    group = torch_npu._C._distributed_c10d.ProcessGroupHCCL(store, rank, 2, datetime.timedelta(seconds=30))
"""


def _pair(env: dict, code: str, **extra: str) -> list[str]:
    """Run ``code`` as ranks 0 and 1 of a group; their outputs, asserting both exit 0."""
    port = str(free_port())
    script = textwrap.dedent(_GROUP) + textwrap.dedent(code)
    done = run_ranks([[sys.executable, "-c", script, str(rank), port] for rank in (0, 1)], {**env, **extra}, 120)
    for d in done:
        assert d.returncode == 0, f"rank exit {d.returncode}\n{d.stdout}\n{d.stderr[-4000:]}"
    return [d.stdout for d in done]


def test_fake_hccl_moves_npu_tensors_and_forms_on_first_use(npu_env: dict) -> None:
    outs = _pair(npu_env, """
        t = torch.arange(1024, dtype=torch.float16).npu() if rank == 0 else torch.zeros(1024, dtype=torch.float16).npu()
        for i in range(2):
            t0 = time.monotonic()
            work = group.send([t + i], 1, 7) if rank == 0 else group.recv([t], 0, 7)
            work.wait()
            print(f"op{i}", round(time.monotonic() - t0, 2))
        if rank == 1:
            print("got", t.device, t.cpu()[:3].tolist(), t.cpu()[-1].item())
    """, FAKE_HCCL_INIT_DELAY_S="1.5")
    first, second = (float(line.split()[1]) for line in outs[1].splitlines() if line.startswith("op"))
    assert first >= 1.5 and second < 1.0, outs
    assert "got npu:1 [1.0, 2.0, 3.0] 1024.0" in outs[1], outs


def test_abort_hccl_comm_ends_an_operation_the_peer_never_posts(npu_env: dict, tmp_path: Path) -> None:
    switch = tmp_path / "never-post"
    switch.write_text("")  # empty: every process with the switch is silent
    outs = _pair(npu_env, """
        import os
        t = torch.zeros(16).npu()
        if rank == 0:
            os.environ.pop("FAKE_HCCL_NEVER_POST")  # rank 0 posts, rank 1 never does
            work = group.recv([t], 1, 0)
            time.sleep(0.5)                          # a posted receive that nothing will match
            print("pending", work.is_completed())
            group.abort_hccl_comm("test")
            try:
                work.wait()
            except RuntimeError as exc:
                print("aborted", work.is_completed(), "aborted (test)" in str(exc))
            later = group.send([t], 1, 0)
            print("after", later.is_completed(), later.exception() is not None)
        else:
            print("silent", group.send([t], 0, 0).is_completed())
    """, FAKE_HCCL_NEVER_POST=str(switch), FAKE_HCCL_INIT_DELAY_S="0")
    assert "pending False" in outs[0] and "aborted True True" in outs[0] and "after True True" in outs[0], outs
    assert "silent False" in outs[1], outs


# ---------------------------------------------------------------------------- links
def _npu(port: int = 0, **kw: Any) -> dict:
    return base_config("auto", device_type="npu", **({"listen_port": port} if port else {}), **kw)


def _npu_pair(npu_peers: Any, decoder_device: int = 1, **kw: Any) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """A prompt on device 0 (listening, blocks filled) and a decoder (blocks filled),
    both ``auto``, not linked yet: (prompt, decoder, prompt's bytes, decoder's bytes)."""
    port = free_port()
    prompt = npu_peers("peer", "prompt", "PROMPT", PROMPT_ID, _npu(port, device_id=0, **kw))
    prompt.alloc("kv", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    data = prompt.fill("kv", BLOCKS, 5)
    dec = npu_peers("peer", "decoder", "DECODER", DECODER_ID, _npu(device_id=decoder_device, **kw))
    dec.alloc("dst", BLOCKS, blocks=True)
    base = dec.fill("dst", BLOCKS, 6)
    prompt.port = port
    return prompt, dec, data, base


def _pull_and_check(prompt: Any, dec: Any, data: np.ndarray, base: np.ndarray) -> None:
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0, 5, 6], [7, 2, 3])
    want = expect_blocks(base, data, [0, 5, 6], [7, 2, 3], BLOCKS.row_bytes)
    np.testing.assert_array_equal(dec.read("dst"), want)
    dec.cm("push_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [1, 2], [4, 0])
    np.testing.assert_array_equal(prompt.read("kv"), expect_blocks(data, want, [1, 2], [4, 0], BLOCKS.row_bytes))


def test_auto_links_npu_engines_over_hccl(npu_peers: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_HCCL_INIT_DELAY_S", "0.2")
    prompt, dec, data, base = _npu_pair(npu_peers)
    dec.link(prompt, port=prompt.port, timeout_ms=20_000)
    assert dec.call("engine", "link_path", PROMPT_ID) == "hccl"
    assert {v["path"] for v in prompt.call("links").values()} == {"hccl"}
    _pull_and_check(prompt, dec, data, base)


def test_auto_links_an_npu_engine_and_a_host_engine_over_sockets(npu_peers: Any) -> None:
    port = free_port()
    prompt = npu_peers("peer", "prompt", "PROMPT", PROMPT_ID, _npu(port, device_id=0))
    prompt.alloc("kv", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 1))
    data = prompt.fill("kv", BLOCKS, 5)
    dec = npu_peers("peer", "decoder", "DECODER", DECODER_ID, base_config("auto", device_type="cpu"))
    dec.alloc("dst", BLOCKS, blocks=True)
    base = dec.fill("dst", BLOCKS, 6)
    dec.link(prompt, port=port, timeout_ms=20_000)
    assert dec.call("engine", "link_path", PROMPT_ID) in ("shm", "tcp")
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [3], [1])
    np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, data, [3], [1], BLOCKS.row_bytes))


def test_two_host_engines_keep_gloo_when_they_ask_for_it(npu_peers: Any) -> None:
    port = free_port()
    prompt = npu_peers("peer", "prompt", "PROMPT", PROMPT_ID, base_config("gloo", listen_port=port,
                                                                          device_type="cpu"))
    dec = npu_peers("peer", "decoder", "DECODER", DECODER_ID, base_config("gloo", device_type="cpu"))
    dec.link(prompt, port=port, timeout_ms=20_000)
    assert dec.call("engine", "link_path", PROMPT_ID) == "gloo"


def test_the_link_absorbs_the_communicator_delay_not_the_first_transfer(npu_peers: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """HCCL takes seconds to form a communicator, transfers get sync_kv_timeout (1 s here)."""
    monkeypatch.setenv("FAKE_HCCL_INIT_DELAY_S", "2")
    prompt, dec, data, base = _npu_pair(npu_peers, sync_kv_timeout=1000)
    ret, rets, took = dec.call("timed_link", [(PROMPT_ID, "127.0.0.1", prompt.port)], 20_000, timeout=60)
    assert (ret, rets) == (0, [0]) and took >= 2.0, (ret, rets, took)
    _, elapsed = dec.timed_cm("pull_blocks", blocks_key(PROMPT_ID, 1), Ref("dst"), [0, 1], [2, 3])
    assert elapsed < 1.0, elapsed
    np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, data, [0, 1], [2, 3], BLOCKS.row_bytes))


def test_a_peer_that_never_posts_ends_in_timeout_and_the_link_reports_it(npu_peers: Any, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    switch = tmp_path / "never-post"
    monkeypatch.setenv("FAKE_HCCL_NEVER_POST", str(switch))
    monkeypatch.setenv("FAKE_HCCL_INIT_DELAY_S", "0")
    prompt, dec, data, base = _npu_pair(npu_peers, sync_kv_timeout=1000)
    dec.link(prompt, port=prompt.port, timeout_ms=20_000)
    switch.write_text(str(prompt.pid))  # from now on the prompt's HCCL never posts
    failed = dec.call("timed_cm", "pull_blocks", (blocks_key(PROMPT_ID, 1), Ref("dst"), [0], [1]), {})
    assert failed["status_code"] == int(LLMStatusCode.LLM_TIMEOUT), failed
    assert 0.9 <= failed["elapsed"] < 3.0, failed
    again = dec.call("timed_cm", "pull_blocks", (blocks_key(PROMPT_ID, 1), Ref("dst"), [0], [1]), {})
    assert again["status_code"] in (int(LLMStatusCode.LLM_LINK_FAILED), int(LLMStatusCode.LLM_NOT_YET_LINK)), again
    switch.unlink()
    dec.call("unlink", [(PROMPT_ID, "127.0.0.1", prompt.port)], 3000, True)
    dec.link(prompt, port=prompt.port, timeout_ms=20_000)  # a new link, a new communicator
    _pull_and_check(prompt, dec, data, base)


def test_hccl_transfers_synchronize_in_the_async_stream_mode(npu_peers: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NPU_ASYNC", "1")
    monkeypatch.setenv("FAKE_HCCL_INIT_DELAY_S", "0")
    prompt, dec, data, base = _npu_pair(npu_peers)
    dec.link(prompt, port=prompt.port, timeout_ms=20_000)
    assert dec.call("engine", "link_path", PROMPT_ID) == "hccl"
    _pull_and_check(prompt, dec, data, base)


def test_npu_engines_on_one_device_link_over_hccl_too(npu_peers: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_HCCL_INIT_DELAY_S", "0")
    prompt, dec, data, base = _npu_pair(npu_peers, decoder_device=0)
    dec.link(prompt, port=prompt.port, timeout_ms=20_000)
    assert dec.call("engine", "link_path", PROMPT_ID) == "hccl"
    _pull_and_check(prompt, dec, data, base)


# ---------------------------------------------------------------------------- what users are told
def test_the_doctor_reports_npus_and_hccl(npu_env: dict) -> None:
    facts = json.loads(ok(subprocess.run([sys.executable, "-m", "datadist", "--json"], env=npu_env,
                                         capture_output=True, text=True, timeout=120)))
    assert [d for d in facts["devices"] if d.startswith("npu")] == [f"npu:{i}" for i in range(8)], facts
    assert "hccl" in facts["transports"] and "hccl" in facts["npu"] and "device memory" in facts["npu"], facts


@pytest.fixture
def broken_torch_npu(npu_env: dict, tmp_path: Path) -> dict:
    """An environment whose torch_npu is installed but fails to import."""
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text('raise ImportError("libascendcl.so: cannot open shared object file")\n')
    return {**npu_env, "PYTHONPATH": f"{tmp_path}:{npu_env['PYTHONPATH'].split(':', 1)[1]}"}


_INIT = """
    import logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
    from datadist import LLMConfig, LLMDataDist, LLMException, LLMRole
    config = LLMConfig()
    config.device_type = sys.argv[1] if len(sys.argv) > 1 else "auto"
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    try:
        engine.init(config.generate_options())
        print("device", engine._engine_or_raise().device)
    except LLMException as exc:
        print(exc.status_code.name, "|", exc)
"""


def test_auto_with_a_torch_npu_that_fails_to_import_warns_with_its_error(broken_torch_npu: dict) -> None:
    out = ok(run(broken_torch_npu, _INIT))
    assert "WARNING device_type 'auto' looks past the NPU: torch_npu is installed but its import failed" in out, out
    assert "libascendcl.so" in out and "device cpu" in out, out


def test_npu_with_a_torch_npu_that_fails_to_import_is_its_error(broken_torch_npu: dict) -> None:
    out = ok(subprocess.run([sys.executable, "-c", textwrap.dedent(_INIT), "npu"], env=broken_torch_npu,
                            capture_output=True, text=True, timeout=120))
    assert out.startswith("LLM_FEATURE_NOT_ENABLED |") and "libascendcl.so" in out, out


def test_the_torch_executors_slow_path_says_so_once(npu_env: dict) -> None:
    out = ok(run(npu_env, """
        import logging, sys, numpy as np, torch
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
        from datadist.engine import npu
        from datadist.engine.executor import torch_copy_plan
        from datadist.engine.layout import Plan
        a, b = (torch.full((4096,), v, dtype=torch.uint8, device="npu") for v in (1, 2))
        dst = torch.zeros(8192, dtype=torch.uint8, device="npu")
        for t in (a, b, dst):
            npu.track(t)
        u64 = lambda *v: np.array(v, dtype=np.uint64)
        # one tensor pair whose two runs lie in two allocations: not one span of one tensor
        plan = Plan(u64(a.data_ptr()), u64(dst.data_ptr()), u64(0, (b.data_ptr() - a.data_ptr()) % (1 << 64)), u64(0, 4096),
                    u64(4096, 4096), "npu:0", "npu:0")
        for _ in range(2):
            print("copied", torch_copy_plan(plan))
        print("bytes", dst.cpu()[4095].item(), dst.cpu()[4096].item())
    """))
    assert out.count("WARNING torch executor:") == 1 and out.count("copied 8192") == 2, out
    assert "bytes 1 2" in out, out
