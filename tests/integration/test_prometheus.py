"""A real Prometheus server scrapes an engine pair and an ``ems-server``; after a workload
the test reads the series back through Prometheus' HTTP API (``/api/v1/query``), as a
dashboard or an alert rule would (docs/operations.md)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

from ems_helpers import check, daemon_factory, run_client  # noqa: F401
from metrics_doc import documented_families
from harness import PROMPT_ID, DECODER_ID, Desc, Ref, base_config, blocks_key, free_port
from waiting import PACED, until

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("prometheus") is None,
                                 reason="the prometheus server is not installed (Debian: apt-get install prometheus)")]
pytest.importorskip("prometheus_client")

BLOCKS = Desc(4, (8, 16, 64), "fp16")
PULLS = 5
#: Deadline for Prometheus to start, and for a series to show what the workload did.
PROMETHEUS_S = 60.0

SAVE_AND_LOAD = """
from ems_helpers import init_cc, kvcache
cc = init_cc({server!r})
kv = kvcache(seed=5)
cc.register_kvcache(kv)
print(cc.save(slot_mapping=list(range(8)), hashes=[11, 22], offsets=[4, 4]).success,
      cc.load(slot_mapping=list(range(16, 24)), hashes=[11, 22], offsets=[4, 4]).success)
"""


class Prometheus:
    """A ``prometheus`` process of the test's own: its config, storage and port."""

    def __init__(self, directory: Path, targets: Dict[str, List[int]]) -> None:
        self.port = free_port()
        jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: "
                       f"[{', '.join(repr(f'127.0.0.1:{p}') for p in ports)}]\n"
                       for job, ports in targets.items())
        config = directory / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n" + jobs)
        self.log = directory / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def query(self, expr: str) -> List[Dict[str, Any]]:
        """The instant vector of ``expr`` (``/api/v1/query``)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        result: List[Dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str) -> Optional[float]:
        """The one value of ``expr`` (None while it has no sample)."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def wait_value(self, expr: str, want: Callable[[float], bool], what: str) -> float:
        """Query ``expr`` until its value satisfies ``want`` (the scrapes catch up); that value."""
        seen: List[Optional[float]] = []

        def good() -> bool:
            seen.append(self.value(expr))
            return seen[-1] is not None and want(seen[-1])

        until(good, PROMETHEUS_S, f"{what}: {expr}", every=PACED)
        return float(seen[-1])  # type: ignore[arg-type]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[[Dict[str, List[int]]], Prometheus]]:
    made: List[Prometheus] = []

    def make(targets: Dict[str, List[int]]) -> Prometheus:
        server = Prometheus(tmp_path, targets)
        made.append(server)
        until(server.ready, PROMETHEUS_S, "prometheus ready", every=PACED)
        return server

    yield make
    for server in made:
        server.close()


def test_prometheus_scrapes_engines_and_ems_server(peer_factory: Callable[..., Any], daemon_factory,  # noqa: F811
                                                   prometheus_factory: Callable[..., Prometheus],
                                                   tmp_path: Path) -> None:
    ports = {"prompt": free_port(), "decoder": free_port(), "ems": free_port()}
    link_port = free_port()
    prompt = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID,
                          base_config("tcp", listen_port=link_port, metrics_port=f"127.0.0.1:{ports['prompt']}"))
    decoder = peer_factory("peer", "decoder", "DECODER", DECODER_ID,
                           base_config("tcp", metrics_port=f"127.0.0.1:{ports['decoder']}"))
    daemon = daemon_factory(extra=["--metrics-port", f"127.0.0.1:{ports['ems']}"])
    prompt.wait_ready()
    decoder.link(prompt)
    server = prometheus_factory({"datadist": [ports["prompt"], ports["decoder"]], "ems": [ports["ems"]]})

    prompt.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 7))
    decoder.alloc("dst", BLOCKS, blocks=True)
    for _ in range(PULLS):
        decoder.cm("pull_blocks", blocks_key(PROMPT_ID, 7), Ref("dst"), [1, 2], [0, 1])
    assert check(run_client(SAVE_AND_LOAD.format(server=daemon.dir))).split() == ["2", "2"]

    server.wait_value('count(up{job="datadist"} == 1)', lambda v: v == 2, "both engines scraped")
    server.wait_value('up{job="ems"}', lambda v: v == 1, "ems-server scraped")
    pulled = (f'datadist_transfers_total{{cluster="{DECODER_ID}",operation="pull_blocks",transport="tcp",'
              'outcome="LLM_SUCCESS"}')
    server.wait_value(pulled, lambda v: v == PULLS, "the decoder's pulls")
    server.wait_value(f'datadist_transfer_seconds_count{{cluster="{DECODER_ID}",operation="pull_blocks"}}',
                      lambda v: v == PULLS, "the pulls' latencies")
    nbytes = PULLS * 2 * BLOCKS.num_tensors * 16 * 64 * 2
    server.wait_value(f'datadist_transfer_bytes_total{{cluster="{DECODER_ID}"}}', lambda v: v == nbytes,
                      "the bytes pulled")
    server.wait_value(f'datadist_links_up{{cluster="{PROMPT_ID}"}}', lambda v: v == 1, "the prompt's link")
    server.wait_value('ems_tier_hits_total{tier="memory"}', lambda v: v == 2, "the pool's hits")
    server.wait_value('ems_puts_committed_total', lambda v: v == 2, "the pool's puts")
    server.wait_value('sum(ems_requests_total{operation="get",outcome="ok"})', lambda v: v >= 1, "the pool's gets")
    mean = server.wait_value(f'sum(datadist_transfer_seconds_sum{{cluster="{DECODER_ID}"}}) / '
                             f'sum(datadist_transfer_seconds_count{{cluster="{DECODER_ID}"}})',
                             lambda v: v > 0, "the pulls' mean latency")
    assert mean < 20


DOCS = Path(__file__).resolve().parents[2] / "docs"
#: Grafana's variables in the dashboard's queries, as Prometheus sees them once filled in.
_GRAFANA_VARS = {"$__rate_interval": "1m", "$datadist_job": "datadist", "$ems_job": "ems"}


def _promtool_rules(path: Path) -> None:
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_alert_rules_of_the_docs_pass_promtool() -> None:
    _promtool_rules(DOCS / "prometheus-alerts.yml")


def test_dashboard_queries_are_valid_and_name_documented_families(tmp_path: Path) -> None:
    """Every query of docs/grafana-dashboard.json parses as PromQL (promtool) and uses
    only families docs/operations.md documents."""
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs
    documented = documented_families()
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(exprs):
        for var, value in _GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        used = {re.sub("_bucket$", "", m) for m in re.findall(r"\b(?:datadist|ems)_[a-z_]+\b", expr)}
        assert used <= documented, (expr, used - documented)
        rules += [f"      - record: dashboard:query{i}", f"        expr: {json.dumps(expr)}"]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text("\n".join(rules) + "\n")
    _promtool_rules(path)
