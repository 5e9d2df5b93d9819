"""Prefill/decode disaggregation as operators run it: two ``vllm serve`` and a proxy.

Three OpenAI API servers of one tiny random Llama (dummy weights, no download), started
together, and the proxy of :mod:`vllm_serve` in this process:

- a plain server, the reference: it computes every prompt;
- ``--connector datadist`` (default): a prefill server (``DatadistConnector``,
  ``kv_producer``) and a decode server (``kv_consumer``).  The proxy sends each prompt to
  the prefill server with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode":
  true}``, then to the decode server with the answer's ``kv_transfer_params``; the decode
  server pulls the prompt's blocks over datadist and generates;
- ``--connector ems``: two servers with ``EmsConnector`` sharing one ``ems-server`` pool of
  this run's own; the first computes each prompt and saves its blocks, the second finds
  them in the pool, loads them and computes only the prompt's last block.  The same proxy
  drives them (``EmsConnector`` needs no ``kv_transfer_params``).

Every prompt goes through the proxy twice, as one answer and streamed, and its tokens are
compared with the plain server's.  Prints the agreement, the decode server's count of
prompt tokens that came by KV transfer (``vllm:prompt_tokens_by_source``) and its
connector metrics from ``/metrics``; exits 0 when every token matches and the decode server
loaded prompts by transfer.

    bash .ci/vllm-env && .venv-vllm/bin/python samples/vllm_serve_pd.py [--connector ems]
        [--prefill-tp 2 --decode-tp 1]

With ``--prefill-tp`` / ``--decode-tp`` the prefill and decode servers run with that
tensor parallelism (DatadistConnector joins or splits the KV heads per rank, see
docs/vllm.md); the plain server stays at 1, and every server loads the same random
weights from files.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Optional, Sequence

from vllm_serve import Proxy, Server, complete, start_all

#: Prompt lengths: shorter than a block, one block +- 1, many blocks.
LENGTHS = (5, 31, 32, 33, 100, 417)
MAX_TOKENS = 8
MODULES = {"datadist": ("DatadistConnector", "datadist.integrations.vllm"),
           "ems": ("EmsConnector", "ems.integrations.vllm")}


def prompts(lengths: Sequence[int] = LENGTHS, vocab: int = 512) -> List[List[int]]:
    """Deterministic token prompts of the given lengths (different contents each)."""
    return [[(7 * i + 13 * n + 1) % (vocab - 1) + 1 for i in range(n)] for n in lengths]


def kv_config(connector: str, role: str, extra: Optional[dict] = None, policy: str = "fail") -> Dict[str, Any]:
    """``--kv-transfer-config`` of a server with one of our connectors."""
    name, module = MODULES[connector]
    return {"kv_connector": name, "kv_connector_module_path": module, "kv_role": role,
            "kv_connector_extra_config": dict(extra or {}), "kv_load_failure_policy": policy}


def pd_servers(model: str, work: str, python: str, connector: str, pool: Optional[str] = None, *,
               policy: str = "fail", prefill_extra: Optional[dict] = None, decode_extra: Optional[dict] = None,
               decode_prefix_caching: bool = False, prefill_tp: int = 1, decode_tp: int = 1,
               **server_args: Any) -> tuple[Server, Server]:
    """A prefill and a decode server with ``connector`` (started, not yet ready), of
    tensor parallelism ``prefill_tp`` and ``decode_tp``; logs in ``work`` as
    ``<connector>-prefill.log`` and ``<connector>-decode.log``; ``server_args`` go to both
    :class:`Server`."""
    logs = f"{work}/{connector}-prefill.log", f"{work}/{connector}-decode.log"
    if connector == "ems":
        both = kv_config("ems", "kv_both", {"server": pool}, policy)
        return (Server(model, logs[0], python=python, kv=both, prefix_caching=True, **server_args),
                Server(model, logs[1], python=python, kv=both, prefix_caching=True, **server_args))
    producer = kv_config("datadist", "kv_producer", {"host": "127.0.0.1", **(prefill_extra or {})}, policy)
    consumer = kv_config("datadist", "kv_consumer", decode_extra, policy)
    return (Server(model, logs[0], python=python, kv=producer, tensor_parallel=prefill_tp, **server_args),
            Server(model, logs[1], python=python, kv=consumer, prefix_caching=decode_prefix_caching,
                   tensor_parallel=decode_tp, **server_args))


def agreement(proxy_url: str, plain_url: str, model: str, batch: Sequence[List[int]]) -> Dict[str, Any]:
    """Each prompt through the proxy, whole and streamed, against the plain server."""
    reference = [complete(plain_url, model, p, MAX_TOKENS)["tokens"] for p in batch]
    whole = [complete(proxy_url, model, p, MAX_TOKENS) for p in batch]
    streamed = [complete(proxy_url, model, p, MAX_TOKENS, stream=True) for p in batch]
    return {"prompts": [len(p) for p in batch],
            "match": [w["tokens"] == ref for w, ref in zip(whole, reference)],
            "stream_match": [s["tokens"] == ref for s, ref in zip(streamed, reference)],
            "agreed": [_agreed(w["tokens"], ref) for w, ref in zip(whole, reference)],
            "stream_agreed": [_agreed(s["tokens"], ref) for s, ref in zip(streamed, reference)],
            "stream_chunks": [s["chunks"] for s in streamed],
            "errors": [r.get("error") for r in whole + streamed if r["status"] != 200]}


def _agreed(tokens: List[int], reference: List[int]) -> int:
    """How many leading tokens agree with the reference's."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def metric_values(text: str, name: str) -> Dict[str, float]:
    """Samples of one metric in Prometheus text: labels (as written) -> value."""
    found = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        found[m.group(1) or ""] = float(m.group(2))
    return found


def transferred_tokens(metrics_text: str) -> float:
    """vLLM's count of prompt tokens loaded by KV transfer, from ``/metrics``."""
    samples = metric_values(metrics_text, "vllm:prompt_tokens_by_source_total")
    return sum(v for labels, v in samples.items() if 'source="external_kv_transfer"' in labels)


def connector_metrics(metrics_text: str, prefix: str) -> Dict[str, float]:
    """Our connector's metrics in ``/metrics`` (names starting with ``prefix``), summed over
    labels; a histogram shows as its ``_count`` and ``_sum``."""
    found: Dict[str, float] = {}
    for m in re.finditer(rf"^({re.escape(prefix)}\w*)(\{{[^}}]*\}})? (\S+)$", metrics_text, re.M):
        if not m.group(1).endswith(("_created", "_bucket")):
            found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(3))
    return found


@contextlib.contextmanager
def _pool(connector: str) -> Iterator[Optional[str]]:
    if connector != "ems":
        yield None
        return
    from _launch import private_pool

    with private_pool(256 << 20) as pool:
        yield pool


def run(connector: str, as_json: bool, prefill_tp: int = 1, decode_tp: int = 1) -> int:
    from vllm_instance import write_tiny_model

    # Instances of another tensor parallelism than the plain one load the same weights
    # from files (vLLM's dummy weights differ per tensor-parallel size).
    weights = prefill_tp != 1 or decode_tp != 1
    load = "safetensors" if weights else "dummy"
    with tempfile.TemporaryDirectory(prefix="vllm-serve-pd-") as work, _pool(connector) as pool:
        model = write_tiny_model(f"{work}/model", 4096, weights=weights)
        plain = Server(model, f"{work}/plain.log", load_format=load)
        prefill, decode = pd_servers(model, work, sys.executable, connector, pool, prefill_tp=prefill_tp,
                                     decode_tp=decode_tp, load_format=load)
        servers = [plain, prefill, decode]
        start_all(servers)
        proxy = Proxy([prefill.url], [decode.url])
        try:
            report = agreement(proxy.url, plain.url, model, prompts())
            text = decode.metrics()
        finally:
            proxy.close()
            for server in servers:
                server.close()
    report["external_kv_transfer_tokens"] = transferred_tokens(text)
    report["connector_metrics"] = connector_metrics(text, "vllm:datadist_" if connector == "datadist" else "vllm:ems_")
    ok = all(report["match"]) and all(report["stream_match"]) and report["external_kv_transfer_tokens"] > 0
    if as_json:
        print(json.dumps(report))
    else:
        for n, a, b in zip(report["prompts"], report["match"], report["stream_match"]):
            print(f"prompt of {n:4d} tokens: {'tokens match' if a else 'MISMATCH'}, streamed "
                  f"{'tokens match' if b else 'MISMATCH'}")
        print(f"prompt tokens the decode server loaded by KV transfer: {report['external_kv_transfer_tokens']:.0f}")
        for name, value in sorted(report["connector_metrics"].items()):
            print(f"  {name} {value:g}")
        print("serve PD tokens match" if ok else f"serve PD FAILED {report['errors']}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connector", choices=sorted(MODULES), default="datadist")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor parallelism of the prefill server")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor parallelism of the decode server")
    args = parser.parse_args()
    return run(args.connector, args.json, args.prefill_tp, args.decode_tp)


if __name__ == "__main__":
    sys.exit(main())
