"""Fixtures of the cluster tests: hosts as network namespaces (datadist/bench/netns.py), skipped
with the reason where this machine cannot make them; every cluster is removed at teardown
and nothing of this session's runs may be left at its end."""
from typing import Callable, Iterator, List

import pytest

from datadist.bench.netns import Cluster, leftovers, sweep_stale, unavailable


@pytest.fixture(scope="session")
def netns_ok() -> Iterator[None]:
    """Skips the test where namespaces cannot be made; clears what killed runs left."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    sweep_stale()
    yield


@pytest.fixture(scope="module")
def cluster_factory(netns_ok: None) -> Iterator[Callable[[int], Cluster]]:
    """``make(n)``: a cluster of ``n`` hosts for the module, removed at its end."""
    made: List[Cluster] = []

    def make(n: int) -> Cluster:
        cluster = Cluster(n)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()
    left = [name for cluster in made for name in leftovers(cluster.run_id)]
    assert not left, f"cluster teardown left namespaces or interfaces behind: {left}"
