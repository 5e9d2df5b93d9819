"""Scenarios of the vLLM tests that the samples do not cover, run with a Python that has
vLLM (see test_vllm.py): ``python vllm_scenarios.py NAME`` prints one JSON line.

- ``prefill_dies``: a prefill instance answers two requests, then it is killed with
  every process it started; the decode instance gets one of them with those
  ``kv_transfer_params`` and one ordinary request in the same batch.  Reports each one's
  finish reason and tokens, the tokens the ordinary request got before the kill, how
  long the batch took, and a request served afterwards.  Then the decode instance (its
  own prefix cache on) serves the failed prompt, a longer one that opens with it and two
  others as ordinary requests; ``later_match`` says whether each got the tokens the
  prefill instance computed for it before the kill (blocks of the failed load left in the
  prefix cache would show here).
- ``block_sizes``: a decode instance of block size 64 computes prompts of 5 to 417 tokens
  itself, then gets them from a prefill instance of block size 32 (two prefill blocks fill
  one of its blocks); reports whether the tokens agree, the prompt tokens it counted as
  loaded by KV transfer, and the prefill instance's own tokens for the prompts.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time

from vllm_instance import Instance, connector_config, write_tiny_model
from vllm_pd import MODULE, decode_params, prefill_params, prompts


def prefill_dies(work: str) -> dict:
    model = write_tiny_model(f"{work}/model", 512)
    pulled, ordinary, other = prompts((96, 70, 150))
    later = [pulled, pulled + ordinary, other, pulled[:64]]
    with Instance(model, prefix_caching=True,
                  kv=connector_config("DatadistConnector", MODULE, "kv_consumer", {"sync_kv_timeout_ms": 5000})) as decode:
        before = decode.generate([ordinary], [{"max_tokens": 8}])[0].tokens
        prefill = Instance(model, kv=connector_config("DatadistConnector", MODULE, "kv_producer", {"host": "127.0.0.1"}))
        try:
            reference = [r.tokens for r in prefill.generate(later, [{"max_tokens": 8}] * len(later))]
            handed = prefill.generate([pulled], [prefill_params()])[0]
        finally:
            prefill.kill()
        start = time.monotonic()
        failed, other = decode.generate([pulled, ordinary], [decode_params(handed.kv_transfer_params), {"max_tokens": 8}],
                                        timeout_s=120)
        took = time.monotonic() - start
        after = decode.generate([ordinary], [{"max_tokens": 8}])[0].tokens
        later_tokens = [r.tokens for r in decode.generate(later, [{"max_tokens": 8}] * len(later))]
    return {"later_match": [a == b for a, b in zip(later_tokens, reference)],"failed_finish_reason": failed.finish_reason, "failed_tokens": failed.tokens,
            "other_finish_reason": other.finish_reason, "other_tokens": other.tokens, "before": before,
            "after": after, "seconds": took}


def block_sizes(work: str) -> dict:
    model = write_tiny_model(f"{work}/model", 512)
    batch = prompts((5, 31, 33, 64, 96, 150, 417))
    plain = [{"max_tokens": 8}] * len(batch)
    with Instance(model, block_size=64,
                  kv=connector_config("DatadistConnector", MODULE, "kv_consumer", {"sync_kv_timeout_ms": 5000})) as decode:
        computed = [r.tokens for r in decode.generate(batch, plain)]
        before = decode.metrics().get("external_kv_transfer", 0.0)
        with Instance(model, block_size=32,
                      kv=connector_config("DatadistConnector", MODULE, "kv_producer", {"host": "127.0.0.1"})) as prefill:
            own = [r.tokens for r in prefill.generate(batch, plain)]
            handed = prefill.generate(batch, [prefill_params()] * len(batch))
            pulled = decode.generate(batch, [decode_params(h.kv_transfer_params) for h in handed], timeout_s=120)
        transferred = decode.metrics().get("external_kv_transfer", 0.0) - before
    return {"prompts": [len(p) for p in batch], "match": [r.tokens == c for r, c in zip(pulled, computed)],
            "prefill_match": [r.tokens == o for r, o in zip(pulled, own)],
            "finish_reasons": [r.finish_reason for r in pulled], "transferred_tokens": transferred}


SCENARIOS = {"prefill_dies": prefill_dies, "block_sizes": block_sizes}

if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="vllm-scenario-") as tmp:
        print(json.dumps(SCENARIOS[sys.argv[1]](tmp)))
