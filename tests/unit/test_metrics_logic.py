"""What the engine counts (datadist.engine.metrics), on links over the in-memory fakes, and
how the metrics endpoint is configured (datadist.MetricsPort, DATADIST_METRICS_PORT)."""
from __future__ import annotations

import threading
import time
from array import array
from bisect import bisect_left

import numpy as np
import pytest

import datadist as dd
from datadist._options import parse_options
from datadist.engine.errors import EngineError, Fault
from datadist.engine.layout import Plan, plan_units
from datadist.engine.link import Link
from datadist.engine import _native
from datadist.engine.metrics import LATENCY_BOUNDS, EngineMetrics, LinkMeter, OpCounts
from datadist.engine.transports.base import RemoteCache
from fakes import FakeTransport

pytestmark = pytest.mark.timeout(30)

BLOCK = 64


def _remote(buf: np.ndarray) -> RemoteCache:
    return RemoteCache(cache_id=-1, row=0, num_tensors=1, tensor_size=buf.nbytes, batch_size=4, is_blocks=True,
                       dtype="", addrs=np.array([buf.ctypes.data], np.uint64), epoch=0)


def _planner(src: np.ndarray, blocks: list[int]):
    def plan(remote: RemoteCache) -> Plan:
        offs = [b * BLOCK for b in blocks]
        return plan_units([src.ctypes.data], offs, [int(remote.addrs[0])], offs, BLOCK)
    return plan


def _link(transport: FakeTransport, metrics: EngineMetrics) -> Link:
    return Link(remote_cluster_id=2, remote_role=0, peer_pid=0, timeout_ms=1000, is_client=True,
                local_cluster_id=1, transport=transport, metrics=metrics)


def _rows(metrics: EngineMetrics) -> dict:
    return {(r["operation"], r["transport"], r["outcome"]): (r["count"], r["bytes"])
            for r in metrics.snapshot()["transfers"]}


def test_transfers_are_counted_by_operation_outcome_and_bytes_and_survive_the_links_release() -> None:
    src = np.arange(4 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    metrics = EngineMetrics(1)
    link = _link(FakeTransport(failures=(None, None, EngineError(Fault.LINK_FAILED, "peer gone"))), metrics)
    link.transfer(_remote(dst), _planner(src, [1, 3]), push=True)
    link.transfer(_remote(dst), _planner(src, [0]), push=False, op="pull_cache")
    with pytest.raises(EngineError):
        link.transfer(_remote(dst), _planner(src, [2]), push=True)
    name = FakeTransport.name
    want = {("push_blocks", name, "LLM_SUCCESS"): (1, 2 * BLOCK), ("pull_cache", name, "LLM_SUCCESS"): (1, BLOCK),
            ("push_blocks", name, "LINK_FAILED"): (1, 0)}  # the engine's own labels: fault names
    assert _rows(metrics) == want
    latency = {(r["operation"], r["transport"]): r for r in metrics.snapshot()["latency"]}
    assert latency[("push_blocks", name)]["count"] == 2
    assert [le for le, _ in latency[("push_blocks", name)]["buckets"]] == [*LATENCY_BOUNDS, float("inf")]
    link.close()  # the counts move into the engine's totals: nothing lost, nothing twice
    assert _rows(metrics) == want


def test_a_transfer_that_never_gets_the_busy_link_is_counted_as_a_timeout() -> None:
    metrics = EngineMetrics(1)
    metrics.outcome_of = lambda exc: "LLM_TIMEOUT" if getattr(exc, "fault", None) == Fault.TIMEOUT else "LLM_FAILED"
    link = _link(FakeTransport(), metrics)
    link.timeout_ms = 50
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        link.turns.acquire()
        held.set()
        release.wait(10)
        link.turns.release()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        dst = np.zeros(4 * BLOCK, np.uint8)
        with pytest.raises(EngineError) as caught:
            link.transfer(_remote(dst), _planner(dst, [0]), push=False)
        assert caught.value.fault == Fault.TIMEOUT
    finally:
        release.set()
        holder.join(10)
    snap = metrics.snapshot()
    assert _rows(metrics) == {("pull_blocks", FakeTransport.name, "LLM_TIMEOUT"): (1, 0)}
    assert snap["timeouts"] == {"pull_blocks": 1}


@pytest.mark.parametrize("latency", [7e-4, 0.3, 20.0, 3.5])
def test_a_counted_transfer_lands_in_the_bucket_python_would_choose(latency: float) -> None:
    """meter_moved (C) counts bytes, nanoseconds and one bucket as OpCounts.observe would;
    the latencies sit far from every bound (a call takes microseconds)."""
    meter = LinkMeter(lambda: "tcp")
    start = time.monotonic() - latency
    meter.moved("pull_blocks", 4096, start)
    meter.moved("pull_blocks", 1, start)
    after = time.monotonic() - start
    counts = meter.ops["pull_blocks"]
    expected = [0] * (len(LATENCY_BOUNDS) + 1)
    expected[bisect_left(LATENCY_BOUNDS, latency)] = 2
    assert counts.buckets == expected and counts.bytes == 4097 and counts.ok == 2
    assert 2 * latency <= counts.seconds <= 2 * after
    assert all(c.bytes == 0 and not any(c.buckets) for op, c in meter.ops.items() if op != "pull_blocks")
    total = OpCounts()
    total.add(counts)
    total.add(counts)
    assert (total.bytes, total.buckets) == (2 * 4097, [2 * n for n in expected])


def test_counting_refuses_cells_of_another_shape() -> None:
    for cells in (array("q", [0] * len(LATENCY_BOUNDS)), bytearray(7), array("q", [0] * 40)):
        with pytest.raises(ValueError, match="cells"):
            _native.meter_moved(cells, 1, time.monotonic())
    with pytest.raises(ValueError, match="ascending"):
        _native.meter_bounds(array("q", [5, 3]))


def test_link_attempts_failures_and_relinks() -> None:
    metrics = EngineMetrics(1)
    metrics.link_attempt(0)
    metrics.link_attempt(int(Fault.LINK_FAILED))
    metrics.installed(2, dialled=True)
    metrics.installed(2, dialled=False)  # the peer linked back: another link, not a relink
    metrics.installed(2, dialled=True)
    link = _link(FakeTransport(), metrics)
    link.mark_broken("peer process exited")
    closing = _link(FakeTransport(), metrics)
    closing.mark_closing()
    closing.mark_broken("unlinked")  # an unlink is not a failure
    links = metrics.snapshot()["links"]
    assert links == {"failures": 1, "relinks": 1, "attempts": {"OK": 1, "LINK_FAILED": 1}}


@pytest.mark.parametrize("raw,address", [("9400", ("0.0.0.0", 9400)), (9400, ("0.0.0.0", 9400)),
                                         ("127.0.0.1:0", ("127.0.0.1", 0))])
def test_metrics_port_option(raw: object, address: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATADIST_METRICS_PORT", raising=False)
    assert parse_options({"datadist.MetricsPort": raw}).metrics_address == address
    assert parse_options({}).metrics_address is None


def test_metrics_port_from_the_environment_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATADIST_METRICS_PORT", "10.0.0.5:9400")
    assert parse_options({}).metrics_address == ("10.0.0.5", 9400)
    assert parse_options({"datadist.MetricsPort": "9500"}).metrics_address == ("0.0.0.0", 9500)  # the option wins
    monkeypatch.setenv("DATADIST_METRICS_PORT", "nine")
    with pytest.raises(dd.LLMException, match="DATADIST_METRICS_PORT = 'nine'"):
        parse_options({})
    monkeypatch.delenv("DATADIST_METRICS_PORT")
    with pytest.raises(dd.LLMException, match="datadist.MetricsPort.*70000"):
        parse_options({"datadist.MetricsPort": "70000"})
    config = dd.LLMConfig()
    config.metrics_port = 9400
    assert config.generate_options()["datadist.MetricsPort"] == "9400"
