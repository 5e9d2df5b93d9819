"""The engine's metrics (docs/operations.md): what ``LLMDataDist.metrics()`` counts for real
transfers between two engine processes, the Prometheus endpoint (``datadist.MetricsPort``)
and what an engine says when ``prometheus_client`` is missing."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.request
from typing import Any, Callable, Dict, List, Tuple

import pytest

from datadist import LLMStatusCode as S
from http_get import http_get
from metrics_doc import documented_families, served_families
from harness import (DECODER_ID, PROMPT_ID, Desc, Peer, Ref, base_config, blocks_key, expect_llm, free_port)

pytestmark = pytest.mark.timeout(120)

#: 4 tensors of 8 blocks x 16 tokens x 64 fp16 elements: 2 KiB per block and tensor.
BLOCKS = Desc(4, (8, 16, 64), "fp16")
BLOCK_BYTES = 16 * 64 * 2


def _pair(make: Callable[..., Any], transport: str, **prompt_config: Any) -> Tuple[Peer, Peer]:
    port = free_port()
    prompt = make("peer", "prompt", "PROMPT", PROMPT_ID, base_config(transport, listen_port=port, **prompt_config))
    decoder = make("peer", "decoder", "DECODER", DECODER_ID, base_config(transport))
    prompt.wait_ready()
    decoder.link(prompt)
    return prompt, decoder


def _rows(snap: Dict[str, Any], **labels: str) -> List[Dict[str, Any]]:
    return [row for row in snap["transfers"] if all(row[k] == v for k, v in labels.items())]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_metrics_count_transfers_bytes_outcomes_and_links(peer_factory: Callable[..., Any], transport: str) -> None:
    """Pulls and pushes that went through are counted with their bytes under their
    operation and transport; a failed one under its status code; every one once in the
    latency histogram; the link as up and dialled once."""
    prompt, decoder = _pair(peer_factory, transport)
    prompt.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 7))
    decoder.alloc("dst", BLOCKS, blocks=True)
    for _ in range(3):
        decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 7), Ref("dst"), [1, 2], [0, 1])
    decoder.cm("push_blocks", blocks_key(PROMPT_ID, 7), Ref("dst"), [0], [5])
    with expect_llm(S.LLM_KV_CACHE_NOT_EXIST):
        decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 9), Ref("dst"), [1], [0])

    snap = decoder.call("engine", "metrics")
    assert snap["cluster_id"] == DECODER_ID
    pulled = _rows(snap, operation="pull_blocks", transport=transport, outcome="LLM_SUCCESS")
    assert [(r["count"], r["bytes"]) for r in pulled] == [(3, 3 * 2 * 4 * BLOCK_BYTES)]
    pushed = _rows(snap, operation="push_blocks", transport=transport, outcome="LLM_SUCCESS")
    assert [(r["count"], r["bytes"]) for r in pushed] == [(1, 4 * BLOCK_BYTES)]
    failed = _rows(snap, operation="pull_blocks", outcome="LLM_KV_CACHE_NOT_EXIST")
    assert [r["count"] for r in failed] == [1]
    latency = {r["operation"]: r for r in snap["latency"] if r["transport"] == transport}
    assert latency["pull_blocks"]["count"] == 4 and latency["push_blocks"]["count"] == 1
    le, count = latency["pull_blocks"]["buckets"][-1]
    assert le == float("inf") and count == 4
    assert 0 < latency["pull_blocks"]["sum_seconds"] < 20
    assert snap["links"]["up"] == 1 and snap["links"]["attempts"] == {"LLM_SUCCESS": 1}
    assert snap["links"]["failures"] == 0 and snap["timeouts"] == {}
    pools = snap["pools"]
    assert sum(pool["used_bytes"] for pool in pools.values()) >= BLOCKS.num_tensors * 8 * BLOCK_BYTES
    assert all(pool["used_bytes"] + pool["free_bytes"] == pool["size_bytes"] for pool in pools.values())
    assert snap["agent"] == {"pending_calls": 0, "pending_handshakes": 0, "handed_off": 0}
    # The prompt engine moved nothing itself: transfers count where they are called.
    assert prompt.call("engine", "metrics")["transfers"] == []


def test_endpoint_serves_the_families_and_health(peer_factory: Callable[..., Any]) -> None:
    """``datadist.MetricsPort`` serves Prometheus' text format at /metrics, and /healthz."""
    pytest.importorskip("prometheus_client")
    port = free_port()
    prompt, decoder = _pair(peer_factory, "tcp")
    prompt.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 7))
    other = peer_factory("peer", "scraped", "DECODER", DECODER_ID + 5,
                         base_config("tcp", metrics_port=f"127.0.0.1:{port}"))
    other.link(prompt)
    other.alloc("dst", BLOCKS, blocks=True)
    other.cm("pull_blocks", blocks_key(PROMPT_ID, 7), Ref("dst"), [1], [0])

    status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    cluster = DECODER_ID + 5
    assert (f'datadist_transfers_total{{cluster="{cluster}",operation="pull_blocks",outcome="LLM_SUCCESS",'
            f'transport="tcp"}} 1.0') in text
    assert (f'datadist_transfer_bytes_total{{cluster="{cluster}",operation="pull_blocks",transport="tcp"}} '
            f'{float(4 * BLOCK_BYTES)}') in text
    assert served_families(text) == documented_families("datadist_")  # docs/operations.md's table
    assert http_get(f"http://127.0.0.1:{port}/healthz") == (200, "1 engine(s) initialized\n")
    assert http_get(f"http://127.0.0.1:{port}/nothing")[0] == 404
    other.call("finalize")
    with pytest.raises(OSError):  # the endpoint went with the engine
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


_WITHOUT_CLIENT = textwrap.dedent("""
    import os, sys
    sys.modules["prometheus_client"] = None  # import prometheus_client now raises ImportError
    import datadist as dd
    engine = dd.LLMDataDist(dd.LLMRole.PROMPT, 5)
    options = {"llm.SyncKvCacheWaitTime": "1000"}
    asked = dict(options, **{"datadist.MetricsPort": "127.0.0.1:0"}) if sys.argv[1] == "option" else options
    try:
        engine.init(asked)
    except dd.LLMException as exc:
        print("refused", exc.status_code.name, exc)
    os.environ.pop("DATADIST_METRICS_PORT", None)
    engine.init(options)
    print("counts", sorted(engine.metrics()))
    engine.finalize()
""")


@pytest.mark.parametrize("way", ["option", "environment"])
def test_without_prometheus_client_the_dict_works_and_the_endpoint_is_refused(way: str) -> None:
    """An engine does not need prometheus_client; asking for the endpoint without it (by
    the option or ``DATADIST_METRICS_PORT``) is ``LLM_FEATURE_NOT_ENABLED`` naming the package."""
    env = dict(os.environ, DATADIST_METRICS_PORT="0") if way == "environment" else dict(os.environ)
    done = subprocess.run([sys.executable, "-c", _WITHOUT_CLIENT, way], capture_output=True, text=True,
                          timeout=90, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused LLM_FEATURE_NOT_ENABLED") and "prometheus_client" in lines[0], lines
    assert lines[1] == "counts ['agent', 'cluster_id', 'latency', 'links', 'pools', 'timeouts', 'transfers']"
