"""The vLLM connectors as operators run them: ``vllm serve`` servers behind the proxy of
``samples/vllm_serve.py`` (NixlConnector's protocol), compared with a plain server.

One set of servers serves the whole module (each one is a heavy process on a small
machine), started together: a plain server; a DatadistConnector prefill server (a 6 s
lease on held blocks) and decode server (its own prefix cache on, failed loads
recomputed); a DatadistConnector server of tensor parallelism 2 (``kv_both``: prefill for
the decode server, decode for the prefill server); two EmsConnector servers sharing one
ems-server pool.  Every server loads the same random weights from files (vLLM's dummy
weights differ per tensor-parallel size).  The last test kills the prefill server.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import Dict, Iterator

import pytest
from vllm_env import ROOT, vllm_python
from waiting import until

from _launch import private_pool
from vllm_serve import Proxy, Server, complete, request, start_all
from vllm_serve_pd import (MAX_TOKENS, agreement, connector_metrics, kv_config, metric_values, pd_servers, prompts,
                           transferred_tokens)

# Starting the servers (minutes on a loaded machine) counts against the first test that runs.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LEASE_S = 6.0
#: How often a server's metrics are asked (each ask is an HTTP request to a server that
#: shares the machine's cores).
_ASK_S = 0.25
#: Six servers load together on a machine that may be shared: minutes.
START_TIMEOUT_S = 720.0
#: The servers' weights: random, from files, the same at every tensor-parallel size.
LOAD = "safetensors"


@dataclass
class Cluster:
    model: str
    plain: Server
    prefill: Server
    decode: Server
    ems_a: Server
    ems_b: Server
    tp2: Server
    proxy: Proxy
    ems_proxy: Proxy


def _write_model(python: str, path: str) -> str:
    done = subprocess.run([python, "-c", f"from vllm_instance import write_tiny_model; "
                                         f"write_tiny_model({path!r}, weights=True)"],
                          cwd=ROOT / "samples", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return path


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="vllm-serve-test-") as work, private_pool(256 << 20) as pool:
        model = _write_model(python, f"{work}/model")
        plain = Server(model, f"{work}/plain.log", python=python, load_format=LOAD)
        prefill, decode = pd_servers(model, work, python, "datadist", policy="recompute",
                                     prefill_extra={"kv_lease_duration": LEASE_S},
                                     decode_extra={"sync_kv_timeout_ms": 5000}, decode_prefix_caching=True,
                                     load_format=LOAD)
        ems_a, ems_b = pd_servers(model, work, python, "ems", pool, load_format=LOAD)
        tp2 = Server(model, f"{work}/tp2.log", python=python, load_format=LOAD, tensor_parallel=2,
                     kv=kv_config("datadist", "kv_both", {"host": "127.0.0.1"}))
        servers = [plain, prefill, decode, ems_a, ems_b, tp2]
        start_all(servers, timeout_s=START_TIMEOUT_S)
        proxy = Proxy([prefill.url], [decode.url])
        ems_proxy = Proxy([ems_a.url], [ems_b.url])
        try:
            yield Cluster(model, plain, prefill, decode, ems_a, ems_b, tp2, proxy, ems_proxy)
        finally:
            proxy.close()
            ems_proxy.close()
            for server in servers:
                server.close()


def test_pd_through_the_proxy_matches_the_plain_server(cluster: Cluster) -> None:
    """Prompts of 5 to 417 tokens through the proxy, as one answer and streamed chunk by
    chunk: the decode server's greedy tokens are the plain server's, and vLLM counts the
    prompts' tokens as loaded by KV transfer."""
    before = transferred_tokens(cluster.decode.metrics())
    report = agreement(cluster.proxy.url, cluster.plain.url, cluster.model, prompts())
    assert report["errors"] == [], report
    assert report["match"] == [True] * len(report["prompts"]), report
    assert report["stream_match"] == [True] * len(report["prompts"]), report
    # Relayed as they came: more than one chunk each (vLLM merges the deltas of tokens its
    # server has not sent yet into one chunk, so a loaded machine sends fewer than one per token).
    assert min(report["stream_chunks"]) >= 2 and max(report["stream_chunks"]) <= MAX_TOKENS, report
    assert transferred_tokens(cluster.decode.metrics()) - before >= sum(report["prompts"]), report


#: Leading tokens of each prompt that must agree with the plain server's across tensor
#: parallelism (see _unequal_tp).
CROSS_TP_AGREED = 2


def _unequal_tp(cluster: Cluster, prefill: Server, decode: Server, vocab: int) -> None:
    """Prompts through a proxy from ``prefill`` to ``decode`` (of other tensor
    parallelism): the decode server's tokens, whole and streamed, are the plain server's,
    it loaded every prompt token by KV transfer, and no transfer failed (a failed load
    would be recomputed by the decode server of the module, and would go unseen).

    Tensor parallelism 2 sums in another order than 1, so the KV differs from the plain
    (TP 1) server's in its last bits, and a near-tie among later tokens may go either way:
    on a 2-core AMD EPYC host (AVX-512) the third token of one prompt in three did. So the
    first :data:`CROSS_TP_AGREED` tokens of every prompt, which the transferred KV decides
    (a head joined or split wrongly changes them), must agree, and all tokens of all but
    one prompt."""
    batch = prompts((33, 100, 417), vocab=vocab)
    before = transferred_tokens(decode.metrics())
    failed = connector_metrics(decode.metrics(), "vllm:datadist_").get("vllm:datadist_num_failed_transfers_total", 0.0)
    proxy = Proxy([prefill.url], [decode.url])
    try:
        report = agreement(proxy.url, cluster.plain.url, cluster.model, batch)
    finally:
        proxy.close()
    assert report["errors"] == [], report
    assert min(report["agreed"] + report["stream_agreed"]) >= CROSS_TP_AGREED, report
    assert sum(report["match"]) >= len(batch) - 1 and sum(report["stream_match"]) >= len(batch) - 1, report
    assert transferred_tokens(decode.metrics()) - before >= sum(report["prompts"]), report
    found = connector_metrics(decode.metrics(), "vllm:datadist_")
    assert found.get("vllm:datadist_num_failed_transfers_total", 0.0) == failed, found


def test_tp2_prefill_to_tp1_decode_matches_the_plain_server(cluster: Cluster) -> None:
    """TP 2 -> TP 1: the decode server joins the two prefill ranks' KV heads (see _unequal_tp)."""
    _unequal_tp(cluster, cluster.tp2, cluster.decode, 443)


def test_tp1_prefill_to_tp2_decode_matches_the_plain_server(cluster: Cluster) -> None:
    """TP 1 -> TP 2: each decode rank takes its KV head of the prefill blocks (see _unequal_tp)."""
    _unequal_tp(cluster, cluster.prefill, cluster.tp2, 439)


def test_concurrent_requests_pull_in_parallel(cluster: Cluster) -> None:
    """Eight clients at once through the proxy (pulls overlap on the decode server, up to
    its ``max_concurrent_pulls``): every answer has the plain server's tokens."""
    batch = prompts((40, 90, 130, 170, 210, 250, 290, 330), vocab=503)
    answers: Dict[int, dict] = {}

    def client(i: int) -> None:
        answers[i] = complete(cluster.proxy.url, cluster.model, batch[i], MAX_TOKENS, stream=bool(i % 2))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a client got no answer within 300 s"
    for i, p in enumerate(batch):
        want = complete(cluster.plain.url, cluster.model, p, MAX_TOKENS)["tokens"]
        assert answers[i]["tokens"] == want, (len(p), answers[i], want)


def test_local_prefix_hit_clips_the_pull(cluster: Cluster) -> None:
    """The decode server's own prefix cache holds the first 6 blocks of a prompt it
    served: a longer prompt with that prefix pulls only the blocks after them (vLLM counts
    the prefix as a local hit, the rest as transferred) and its tokens are the plain
    server's."""
    base = prompts((6 * 32,), vocab=499)[0]
    longer = base + prompts((70,), vocab=491)[0]
    assert complete(cluster.proxy.url, cluster.model, base, 4)["status"] == 200
    text = cluster.decode.metrics()
    hits_before = _by_source(text, "local_cache_hit")
    blocks_before = connector_metrics(text, "vllm:datadist_").get("vllm:datadist_num_blocks_sum", 0.0)
    got = complete(cluster.proxy.url, cluster.model, longer, MAX_TOKENS)
    want = complete(cluster.plain.url, cluster.model, longer, MAX_TOKENS)
    assert got["tokens"] == want["tokens"] and got["status"] == 200, (got, want)
    text = cluster.decode.metrics()
    assert _by_source(text, "local_cache_hit") - hits_before == len(base), text[-3000:]
    pulled = connector_metrics(text, "vllm:datadist_")["vllm:datadist_num_blocks_sum"] - blocks_before
    assert pulled == -(-(len(longer)) // 32) - 6, pulled  # the blocks after the prefix, the partial one too


def _by_source(text: str, source: str) -> float:
    samples = metric_values(text, "vllm:prompt_tokens_by_source_total")
    return sum(v for labels, v in samples.items() if f'source="{source}"' in labels)


def test_decode_metrics_show_the_connector(cluster: Cluster) -> None:
    """``/metrics`` of the decode server shows DatadistConnector's transfer metrics
    (NixlConnector's names with ``datadist``) after requests; the EmsConnector servers
    show pool hits, bytes loaded and saved."""
    assert complete(cluster.proxy.url, cluster.model, prompts((150,), vocab=487)[0], 2)["status"] == 200
    found = connector_metrics(cluster.decode.metrics(), "vllm:datadist_")
    assert found["vllm:datadist_xfer_time_seconds_count"] >= 1, found
    assert found["vllm:datadist_xfer_time_seconds_sum"] > 0, found
    assert found["vllm:datadist_bytes_transferred_sum"] > 0, found
    per_block = found["vllm:datadist_bytes_transferred_sum"] / found["vllm:datadist_num_blocks_sum"]
    assert per_block == int(per_block) > 0, found
    assert found["vllm:datadist_num_failed_transfers_total"] == 0, found
    batch = prompts((64, 130), vocab=479)
    for p in batch:
        assert complete(cluster.ems_proxy.url, cluster.model, p, 2)["status"] == 200
    saved = connector_metrics(cluster.ems_a.metrics(), "vllm:ems_")
    loaded = connector_metrics(cluster.ems_b.metrics(), "vllm:ems_")
    assert saved["vllm:ems_bytes_saved_total"] > 0, saved
    assert loaded["vllm:ems_hit_blocks_total"] >= 1 and loaded["vllm:ems_bytes_loaded_total"] > 0, loaded


def test_ems_servers_share_the_pool_through_the_proxy(cluster: Cluster) -> None:
    """Two EmsConnector servers behind the same proxy: the first computes each prompt
    and saves its blocks into the pool, the second loads them from the pool; its tokens,
    whole and streamed, are the plain server's."""
    before = transferred_tokens(cluster.ems_b.metrics())
    report = agreement(cluster.ems_proxy.url, cluster.plain.url, cluster.model, prompts(vocab=509))
    assert report["errors"] == [], report
    assert report["match"] == [True] * len(report["prompts"]), report
    assert report["stream_match"] == [True] * len(report["prompts"]), report
    assert transferred_tokens(cluster.ems_b.metrics()) > before, report


def _prefill(cluster: Cluster, prompt: list) -> dict:
    """Send ``prompt`` to the prefill server as the proxy does; its ``kv_transfer_params``."""
    status, body = request(cluster.prefill.url, "POST", "/v1/completions",
                           {"model": cluster.model, "prompt": prompt, "max_tokens": 1,
                            "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, body[-2000:]
    return dict(json.loads(body)["kv_transfer_params"])


def test_larger_prefill_blocks_are_refused_not_scrambled(cluster: Cluster) -> None:
    """Blocks handed over by a prefill instance of a larger block size (64 tokens, this
    decode server's are 32) are not loaded: the decode server refuses the load, counts a
    failed transfer, recomputes the prompt (its policy) with the plain server's tokens,
    and tells the prefill server, which frees the blocks at once."""
    prompt = prompts((140,), vocab=463)[0]
    params = {**_prefill(cluster, prompt), "remote_block_size": 64}
    failed = connector_metrics(cluster.decode.metrics(), "vllm:datadist_")["vllm:datadist_num_failed_transfers_total"]
    got = complete(cluster.decode.url, cluster.model, prompt, MAX_TOKENS, kv_transfer_params=params)
    want = complete(cluster.plain.url, cluster.model, prompt, MAX_TOKENS)
    assert got["status"] == 200 and got["tokens"] == want["tokens"], (got, want)
    found = connector_metrics(cluster.decode.metrics(), "vllm:datadist_")
    assert found["vllm:datadist_num_failed_transfers_total"] == failed + 1, found
    expired = connector_metrics(cluster.prefill.metrics(), "vllm:datadist_").get(
        "vllm:datadist_num_kv_expired_reqs_total", 0.0)
    until(lambda: sum(metric_values(cluster.prefill.metrics(), "vllm:kv_cache_usage_perc").values()) == 0, LEASE_S,
          "the prefill server freed the pulled blocks", every=_ASK_S)
    assert connector_metrics(cluster.prefill.metrics(), "vllm:datadist_").get(
        "vllm:datadist_num_kv_expired_reqs_total", 0.0) == expired  # freed by the notice, not the lease


def test_lease_frees_blocks_nobody_pulls(cluster: Cluster) -> None:
    """A prefill answered with blocks held for a decode instance that never comes (a
    dead decode): the prefill server frees them when their 6 s lease runs out, within two
    leases, and counts the request as expired."""
    def expired() -> float:
        return connector_metrics(cluster.prefill.metrics(), "vllm:datadist_").get(
            "vllm:datadist_num_kv_expired_reqs_total", 0.0)

    def usage() -> float:
        return sum(metric_values(cluster.prefill.metrics(), "vllm:kv_cache_usage_perc").values())

    until(lambda: usage() == 0, 4 * LEASE_S, "what earlier tests' pulls held is freed", every=_ASK_S)
    start_count = expired()
    _prefill(cluster, prompts((300,), vocab=467)[0])
    assert usage() > 0  # held for the pull
    until(lambda: expired() > start_count, 2 * LEASE_S, "the lease expired the request", every=_ASK_S)
    assert usage() == 0


def test_killed_prefill_fails_over_to_recompute_and_leaves_nothing(cluster: Cluster) -> None:
    """The prefill server is killed (with every process it started) after it answered:
    the decode server, whose policy is ``recompute``, computes the prompt itself, counts
    the failed transfer, and every later request, the same prompt (its blocks would be
    garbage if the failed pull had left them cached) and others sharing its prefix, gets
    the plain server's tokens."""
    victim = prompts((200,), vocab=461)[0]
    params = _prefill(cluster, victim)
    cluster.prefill.kill()
    got = complete(cluster.decode.url, cluster.model, victim, MAX_TOKENS, kv_transfer_params=params)
    want = complete(cluster.plain.url, cluster.model, victim, MAX_TOKENS)
    assert got["status"] == 200 and got["tokens"] == want["tokens"], (got, want)
    found = connector_metrics(cluster.decode.metrics(), "vllm:datadist_")
    assert found["vllm:datadist_num_failed_transfers_total"] >= 1, found
    later = [victim, victim + prompts((40,), vocab=457)[0], victim[:100], prompts((77,), vocab=449)[0]]
    for p in later:
        got = complete(cluster.decode.url, cluster.model, p, MAX_TOKENS)
        want = complete(cluster.plain.url, cluster.model, p, MAX_TOKENS)
        assert got["tokens"] == want["tokens"], (len(p), got, want)
