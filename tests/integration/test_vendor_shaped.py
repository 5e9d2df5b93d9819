"""CANN's published llm_datadist samples, in their own shape, run unchanged against
``import llm_datadist`` (tests/integration/vendor_shaped.py): pushes from the decoder,
both ends linking to each other, a role switch handing one ip:port over, two prompts and a
decoder, layer-wise async without block indices, a rank-table comm domain with swaps, and
the pair domains a serving adapter (vllm-ascend) builds between prefills and a decoder,
rows pulled by cache key, a cache row pulled into blocks, and a push by cache id and index.

Each scenario runs as real processes joined by a gloo process group (the samples' own
barriers); the test passes when every process exits 0, and shows each one's output if not.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import pytest

from harness import free_port, run_ranks

SCRIPT = Path(__file__).with_name("vendor_shaped.py")
DEADLINE_S = 100


def run_scenario(name: str, world: int, ports: int, env: Optional[dict] = None) -> None:
    """Run scenario ``name`` as ``world`` processes (``env``: their environment, default
    this process's) and assert that every one exits 0."""
    env = dict(env or os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    port_list = ",".join(str(free_port()) for _ in range(ports))
    done = run_ranks([[sys.executable, str(SCRIPT), name, str(rank), str(world), port_list] for rank in range(world)],
                     env, DEADLINE_S)
    failed = [(rank, d) for rank, d in enumerate(done) if d.returncode != 0]
    assert not failed, "\n".join(f"--- rank {rank} exited {d.returncode} ---\n{d.stdout}\n{d.stderr}"
                                 for rank, d in failed)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name, world, ports", [
    ("push_from_decoder", 2, 1),
    ("link_both_ways", 2, 2),
    ("switch_roles", 2, 1),
    ("two_prompts_two_decoders", 4, 4),
    ("async_whole_cache", 2, 2),
    ("rank_table_pull_and_swap", 2, 1),
    ("adapter_pair_domains", 3, 1),
    ("pull_cache_by_keys", 2, 1),
    ("cache_rows_to_blocks", 2, 1),
    ("push_cache_by_index", 2, 1),
])
def test_vendor_shaped_sample(name: str, world: int, ports: int) -> None:
    run_scenario(name, world, ports)
