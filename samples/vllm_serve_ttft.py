"""Time to first token on a ``vllm serve`` decode server with DatadistConnector against
computing the prompt, for prompts of 512 to 8192 tokens, and the connector's share of it.

Three servers of the tiny random Llama (see ``vllm_serve_pd``): plain, prefill, decode.
Per prompt length, after one warm-up round: the plain server's TTFT (it computes the
prompt), and the decode server's TTFT for the same prompt sent with the prefill server's
``kv_transfer_params`` (the pull included; the prefill itself is not), each the median of
``--repeats`` streamed requests; and the pull's time from the decode server's
``vllm:datadist_xfer_time_seconds`` (its share of the decode server's TTFT, the way
Mooncake reports "transfer = x % of TTFT").  Prints one JSON line; ``--plot FILE`` draws
the figure (matplotlib).

    .venv-vllm/bin/python samples/vllm_serve_ttft.py --plot docs/vllm_ttft.png
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from typing import Any, Dict, List, Sequence

from vllm_serve import Server, complete, request, start_all
from vllm_serve_pd import connector_metrics, pd_servers, prompts

LENGTHS = (512, 1024, 2048, 4096, 8192)


def _pulled_ttft(prefill: Server, decode: Server, model: str, prompt: List[int]) -> tuple[float, float]:
    """(decode TTFT, pull seconds) of one prompt handed over by the prefill server."""
    status, body = request(prefill.url, "POST", "/v1/completions",
                           {"model": model, "prompt": prompt, "max_tokens": 1,
                            "kv_transfer_params": {"do_remote_decode": True}}, timeout_s=300)
    if status != 200:
        raise RuntimeError(f"prefill server: HTTP {status}: {body[-2000:]!r}")
    before = connector_metrics(decode.metrics(), "vllm:datadist_").get("vllm:datadist_xfer_time_seconds_sum", 0.0)
    got = complete(decode.url, model, prompt, 1, stream=True, timeout_s=300,
                   kv_transfer_params=json.loads(body)["kv_transfer_params"])
    if got["status"] != 200:
        raise RuntimeError(f"decode server: {got}")
    after = connector_metrics(decode.metrics(), "vllm:datadist_")["vllm:datadist_xfer_time_seconds_sum"]
    return got["ttft_s"], after - before


def measure(lengths: Sequence[int], repeats: int) -> Dict[str, Any]:
    from vllm_instance import write_tiny_model

    max_len = max(lengths) + 128
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-serve-ttft-") as work:
        model = write_tiny_model(f"{work}/model", max_len)
        plain = Server(model, f"{work}/plain.log", max_model_len=max_len, kvcache_gib=2)
        prefill, decode = pd_servers(model, work, sys.executable, "datadist", max_model_len=max_len, kvcache_gib=2)
        servers = [plain, prefill, decode]
        start_all(servers)
        try:
            for n in lengths:
                batch = prompts((n,) * (repeats + 1), vocab=509)
                # Different prompts of one length (no prefix cache on any server here).
                batch = [[(t + i) % 500 + 1 for t in p] for i, p in enumerate(batch)]
                complete(plain.url, model, batch[0], 1, stream=True, timeout_s=300)  # warm
                _pulled_ttft(prefill, decode, model, batch[0])
                computed = [complete(plain.url, model, p, 1, stream=True, timeout_s=300)["ttft_s"]
                            for p in batch[1:]]
                pulled = [_pulled_ttft(prefill, decode, model, p) for p in batch[1:]]
                ttft = statistics.median(t for t, _ in pulled)
                pull = statistics.median(x for _, x in pulled)
                rows.append({"tokens": n, "ttft_computed_s": statistics.median(computed), "ttft_pulled_s": ttft,
                             "pull_s": pull, "pull_share": pull / ttft if ttft else 0.0})
        finally:
            for server in servers:
                server.close()
    return {"repeats": repeats, "rows": rows}


def plot(report: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    xs = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(xs, [r["ttft_computed_s"] * 1e3 for r in rows], "o-", label="plain server: computes the prompt")
    ax.plot(xs, [r["ttft_pulled_s"] * 1e3 for r in rows], "s-", label="decode server: DatadistConnector pull")
    ax.plot(xs, [r["pull_s"] * 1e3 for r in rows], "^--", label="of which the pull")
    for r in rows:
        ax.annotate(f"{r['pull_share']:.1%}", (r["tokens"], r["pull_s"] * 1e3), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("vllm serve, tiny Llama, CPU (median of %d)" % report["repeats"], fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", help="write the figure to this PNG file")
    args = parser.parse_args()
    report = measure(args.lengths, args.repeats)
    if args.plot:
        plot(report, args.plot)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
