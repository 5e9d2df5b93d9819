"""Placing a peer's plan half in this engine's memory (pure logic over real registry
records): runs must lie inside the named cache, raw addresses inside the caches of one
device, and halves whose bases are not tensor addresses are checked run by run in
bounded pieces, up to a bounded count."""
from __future__ import annotations

import numpy as np
import pytest

from datadist.engine import peer_plans
from datadist.engine.peer_plans import SPAN_RUNS_MAX, device_holding, runs_inside
from datadist.engine.registry import Registry

pytestmark = pytest.mark.timeout(60)

SIZE = 1 << 16


def _u(*v: int) -> np.ndarray:
    return np.array(v, np.uint64)


@pytest.fixture
def caches():
    """Two host tensors back to back at 1 MiB, one "device" tensor far above."""
    reg = Registry(5, 1)
    host = reg.add(dict(num_tensors=2, tensor_size=SIZE, batch_size=16, is_blocks=True, dtype="INT8",
                        addrs=_u(1 << 20, (1 << 20) + SIZE)))
    dev = reg.add(dict(num_tensors=1, tensor_size=SIZE, batch_size=16, is_blocks=True, dtype="INT8",
                       addrs=_u(1 << 40), device="cuda:0"))
    return reg, host, dev


def test_tensor_bases_and_flat_runs_inside_the_cache(caches) -> None:
    _, host, _ = caches
    assert runs_inside(host, host.addrs, _u(0, 4096), _u(4096, 4096), 8192)
    assert not runs_inside(host, host.addrs, _u(SIZE - 8), _u(16), SIZE + 8)
    # one flat run across the two back-to-back tensors is inside; one past them is not
    assert runs_inside(host, _u(0), _u(1 << 20), _u(2 * SIZE), (1 << 20) + 2 * SIZE)
    assert not runs_inside(host, _u(0), _u(1 << 20), _u(2 * SIZE + 1), (1 << 20) + 2 * SIZE + 1)


def test_raw_addresses_must_lie_in_the_caches_of_one_device(caches) -> None:
    reg, _, _ = caches
    recs = reg.all()
    assert device_holding(recs, _u(0), _u(1 << 20), _u(64)) == "cpu"
    assert device_holding(recs, _u(0), _u(1 << 40), _u(64)) == "cuda:0"
    # a host run first and a device run after: before, the host path summed device addresses
    assert device_holding(recs, _u(0), _u(1 << 20, 1 << 40), _u(64, 64)) is None
    assert device_holding(recs, _u(0), _u(1 << 30), _u(64)) is None


def test_many_runs_are_checked_in_pieces_to_the_last(caches, monkeypatch: pytest.MonkeyPatch) -> None:
    _, host, _ = caches
    monkeypatch.setattr(peer_plans, "_PIECE", 1000)  # pieces of 1000 runs: many of them here
    offs = ((1 << 20) + np.arange(5000, dtype=np.uint64) * 8).astype(np.uint64)
    lens = np.full(5000, 8, np.uint64)
    bases = _u(0, 0, 0)
    assert runs_inside(host, bases, offs, lens, 0)
    offs[-1] = (1 << 20) + 2 * SIZE - 4  # the very last run of the last piece reaches past the span
    assert not runs_inside(host, bases, offs, lens, 0)


def test_a_half_of_too_many_runs_is_refused_unchecked(caches) -> None:
    _, host, _ = caches
    n = int(SPAN_RUNS_MAX ** 0.5) + 1  # n bases x n runs: just over the bound, a 2 x n x 8 byte frame
    bases = np.zeros(n, np.uint64)
    offs = np.full(n, 1 << 20, np.uint64)
    lens = np.full(n, 1, np.uint64)
    assert not runs_inside(host, bases, offs, lens, 0)
