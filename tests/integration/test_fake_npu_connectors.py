"""The connectors' worker halves on NPU workers (the fake NPU), driven directly:
vLLM itself does not run on the fake device, so the two workers get what vLLM would give
them (vllm-ascend-shaped per-layer KV caches ``(2, num_blocks, block_size, heads,
head_dim)`` on the worker's NPU, a ``KVCacheConfig``-shaped record, tensor-parallel rank 0
of 1 from a stand-in ``vllm.distributed.parallel_state``).  The prefill worker (NPU 0)
registers its caches (their region addresses, ints) and holds a request's blocks; the
decode worker (NPU 1) pulls them over hccl and tells the prefill worker, which frees them.
``EmsConnector``'s halves do the same through an ``ems-server``: the prefill worker saves a
request's blocks from NPU 0 into the pool, the decode worker loads them into other blocks of
NPU 1.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import free_port
from vllm_standins import write_vllm_standins

pytestmark = [pytest.mark.fake_npu, pytest.mark.timeout(300)]

_WORKER = """
    import json, sys, time, types, torch
    from datadist.integrations.vllm.worker import DatadistWorker, Endpoint, RecvJob, Settings
    role, device, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.npu.set_device(device)
    NB, SHAPE = 8, (2, 8, 4, 2, 16)  # K and V, num_blocks, block_size, kv heads, head_dim

    def layer(l):
        return (torch.arange(2 * 8 * 4 * 2 * 16, dtype=torch.float32) % 1000 + l).reshape(SHAPE).half()

    producer = role == "prefill"
    caches = {f"model.layers.{l}.self_attn.attn": (layer(l) if producer else torch.zeros(SHAPE).half()).npu()
              for l in range(3)}
    settings = Settings(host="127.0.0.1", port=port, transfer_backend="auto", timeout_ms=20000,
                        lease_s=60.0, max_pulls=4, idle_wait_ms=10, link_secret_file=None, producer=producer,
                        consumer=not producer, engine_id="npu-test")
    worker = DatadistWorker(None, settings, types.SimpleNamespace(kv_cache_groups=[object()], num_blocks=NB))
    worker.register(caches)
    deadline = time.monotonic() + 120
    if producer:
        endpoint = worker.endpoint
        print(json.dumps([endpoint.host, endpoint.port, endpoint.cluster_id]), flush=True)
        worker.start({}, {"req-1": 120.0})
        while time.monotonic() < deadline:
            sent, _, _ = worker.finished(set())
            if sent:
                print("freed", sorted(sent), flush=True)
                break
            time.sleep(0.01)  # the worker's own step loop
        sys.stdin.readline()  # the decode worker is done with the link: close it only now
    else:
        host, port, cluster_id = json.loads(sys.stdin.readline())
        job = RecvJob(local_blocks=[5, 6], remote_blocks=[1, 2], remote_request_id="req-1",
                      peers=[Endpoint(host, port, cluster_id)], awaited=True)
        worker.start({"req-1": job}, {})
        received = failed = set()
        while time.monotonic() < deadline and not received:
            _, received, failed = worker.finished(set())
            time.sleep(0.01)
        print("received", sorted(received), "failed", sorted(failed), flush=True)
        print("path", worker._engine().link_path(cluster_id), flush=True)
        right = all(torch.equal(t.cpu()[:, [5, 6]], layer(l)[:, [1, 2]]) and not t.cpu()[:, [0, 1, 2, 3, 4, 7]].any()
                    for l, t in enumerate(caches.values()))
        print("blocks", "right" if right else "WRONG", flush=True)
    worker.close()
"""


@pytest.fixture
def worker_env(npu_env: dict, tmp_path: Path) -> dict:
    """The fake NPU, and the stand-ins for vLLM's modules."""
    write_vllm_standins(tmp_path)
    return {**npu_env, "PYTHONPATH": f"{npu_env['PYTHONPATH']}:{tmp_path}", "FAKE_HCCL_INIT_DELAY_S": "0.5"}


def test_a_prefill_npu_worker_hands_a_requests_blocks_to_a_decode_npu_worker(worker_env: dict) -> None:
    script = textwrap.dedent(_WORKER)
    port = str(free_port())
    prefill = subprocess.Popen([sys.executable, "-c", script, "prefill", "0", port], env=worker_env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert prefill.stdout is not None and prefill.stderr is not None
        endpoint = prefill.stdout.readline()  # the prefill worker's endpoint, once it registered
        if not endpoint.startswith("["):
            prefill.wait(30)
            pytest.fail(f"prefill worker did not start (exit {prefill.returncode}):\n{prefill.stderr.read()[-4000:]}")
        decode = subprocess.run([sys.executable, "-c", script, "decode", "1", "0"], env=worker_env, input=endpoint,
                                capture_output=True, text=True, timeout=180)
        out, err = prefill.communicate("done\n", timeout=120)
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
    assert decode.returncode == 0, f"decode exit {decode.returncode}\n{decode.stdout}\n{decode.stderr[-4000:]}"
    assert prefill.returncode == 0, f"prefill exit {prefill.returncode}\n{out}\n{err[-4000:]}"
    assert "received ['req-1'] failed []" in decode.stdout and "blocks right" in decode.stdout, decode.stdout
    assert "path hccl" in decode.stdout, decode.stdout
    assert "freed ['req-1']" in out, out


_EMS_WORKER = """
    import sys, time, types, torch
    from ems.integrations.vllm.worker import BlockJob, EmsWorker, Settings
    role, device = sys.argv[1], int(sys.argv[2])
    torch.npu.set_device(device)
    SHAPE = (2, 8, 4, 2, 16)  # K and V, num_blocks, block_size, kv heads, head_dim

    def layer(l):
        return (torch.arange(2 * 8 * 4 * 2 * 16, dtype=torch.float32) % 1000 + l).reshape(SHAPE).half()

    saving = role == "prefill"
    caches = {f"model.layers.{l}.self_attn.attn": (layer(l) if saving else torch.zeros(SHAPE).half()).npu()
              for l in range(3)}
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=4),
                                   model_config=types.SimpleNamespace(model="npu-tiny"))
    worker = EmsWorker(config, Settings(server=None, timeout_ms=20000, lookup_timeout_ms=5000, model_id=None),
                       types.SimpleNamespace(kv_cache_groups=[object()], num_blocks=8))
    worker.register(caches)
    print("device", next(iter(caches.values())).device, "identity device", worker.identity.device_id, flush=True)
    deadline = time.monotonic() + 120
    if saving:
        worker.save({"req-1": [BlockJob(block_ids=[1, 2], hashes=[0x51, 0x52])]})
        sent = set()
        while time.monotonic() < deadline and not sent:
            sent, _, _ = worker.finished({"req-1"})
            time.sleep(0.01)  # the worker's own step loop
        print("saved", sorted(sent), flush=True)
    else:
        worker.load({"req-1": BlockJob(block_ids=[5, 6], hashes=[0x51, 0x52])})
        received = set()
        while time.monotonic() < deadline and not received:
            _, received, failed = worker.finished(set())
            time.sleep(0.01)
        print("received", sorted(received), "failed", sorted(failed), flush=True)
        right = all(torch.equal(t.cpu()[:, [5, 6]], layer(l)[:, [1, 2]]) and not t.cpu()[:, [0, 1, 2, 3, 4, 7]].any()
                    for l, t in enumerate(caches.values()))
        print("blocks", "right" if right else "WRONG", flush=True)
    worker.close()
"""


def test_a_prefill_npu_worker_saves_blocks_an_ems_decode_npu_worker_loads(worker_env: dict, ems_pool_dir: str) -> None:
    script = textwrap.dedent(_EMS_WORKER)
    env = {**worker_env, "EMS_SERVER": ems_pool_dir}
    outs = []
    for role, device in (("prefill", "0"), ("decode", "1")):
        done = subprocess.run([sys.executable, "-c", script, role, device], env=env, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, f"{role} exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
        outs.append(done.stdout)
    assert "device npu:0 identity device 0" in outs[0] and "saved ['req-1']" in outs[0], outs[0]
    assert "device npu:1 identity device 1" in outs[1], outs[1]
    assert "received ['req-1'] failed []" in outs[1] and "blocks right" in outs[1], outs[1]
