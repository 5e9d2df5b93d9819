"""``ems-server --metrics-port``: Prometheus families and ``/healthz`` of a real daemon, after
real clients saved and loaded (docs/operations.md)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Dict, Tuple

import pytest

from http_get import http_get
from metrics_doc import documented_families, served_families
from ems_helpers import ENV, check, daemon_factory, free_port, run_client  # noqa: F401

pytestmark = pytest.mark.timeout(120)
prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

SAVE_AND_LOAD = """
from ems_helpers import init_cc, kvcache
cc = init_cc({server!r})
kv = kvcache(seed=5)
cc.register_kvcache(kv)
saved = cc.save(slot_mapping=list(range(8)), hashes=[11, 22], offsets=[4, 4])
loaded = cc.load(slot_mapping=list(range(16, 24)), hashes=[11, 22], offsets=[4, 4])
missed = cc.load(slot_mapping=list(range(16, 20)), hashes=[99], offsets=[4])
print(saved.success, loaded.success, missed.success)
"""


def _samples(port: int) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """Every sample of the daemon's /metrics: (name, sorted labels) -> value."""
    status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_families_count_requests_tiers_puts_and_refusals(daemon_factory, tmp_path) -> None:  # noqa: F811
    port = free_port()
    daemon = daemon_factory(disk_dir=tmp_path / "disk", extra=["--metrics-port", f"127.0.0.1:{port}"])
    assert http_get(f"http://127.0.0.1:{port}/healthz") == (200, "ready: memory, disk\n")
    assert check(run_client(SAVE_AND_LOAD.format(server=daemon.dir))).split() == ["2", "2", "0"]
    with socket.socket(socket.AF_UNIX) as bad:
        bad.settimeout(20)
        bad.connect(os.path.join(daemon.dir, "ems.sock"))
        bad.sendall(b"\xff" * 64)  # no frame header: answered with an error, then closed
        try:
            while bad.recv(4096):  # until the daemon closes it (it has counted the refusal by then)
                pass
        except ConnectionResetError:  # closed with some of our bytes unread: the end too
            pass

    assert served_families(http_get(f"http://127.0.0.1:{port}/metrics")[1]) == documented_families("ems_")
    got = _samples(port)
    assert got[("ems_requests_total", (("operation", "commit"), ("outcome", "ok")))] >= 1
    assert got[("ems_requests_total", (("operation", "hello"), ("outcome", "ok")))] >= 1
    assert got[("ems_request_seconds_count", (("operation", "get"),))] >= 2
    assert got[("ems_tier_hits_total", (("tier", "memory"),))] == 2
    assert got[("ems_tier_hit_bytes_total", (("tier", "memory"),))] > 0
    assert got[("ems_tier_misses_total", (("tier", "memory"),))] == 1
    assert got[("ems_tier_misses_total", (("tier", "disk"),))] == 1  # the miss looked there too
    assert ("ems_tier_hits_total", (("tier", "remote"),)) not in got  # no remote tier
    assert got[("ems_puts_committed_total", ())] == 2
    assert got[("ems_puts_pending", ())] == 0
    assert got[("ems_refusals_total", (("reason", "bad_frame"),))] == 1
    assert got[("ems_memory_bytes", (("state", "capacity"),))] == 64 << 20
    for name in ("ems_connections", "ems_evictions_total", "ems_spills_total", "ems_values",
                 "ems_puts_no_space_total", "ems_corrupt_values_total"):
        assert (name, ()) in got, name


def test_health_names_an_unreachable_remote_tier(daemon_factory, tmp_path) -> None:  # noqa: F811
    """With a Redis tier nobody serves, /healthz is 503 naming it, and the tier's failed
    calls are counted."""
    port = free_port()
    daemon = daemon_factory(remote=f"redis://127.0.0.1:{free_port()}",
                            extra=["--metrics-port", f"127.0.0.1:{port}"])
    status, text = http_get(f"http://127.0.0.1:{port}/healthz")
    assert status == 503 and text.startswith("not ready: remote: redis://127.0.0.1:"), text
    check(run_client(SAVE_AND_LOAD.format(server=daemon.dir)))
    assert _samples(port)[("ems_tier_errors_total", (("tier", "remote"),))] >= 1


def test_metrics_port_without_prometheus_client_is_a_clear_error(tmp_path) -> None:
    script = ("import sys; sys.modules['prometheus_client'] = None\n"
              "from ems.server.cli import main\n"
              f"sys.exit(main(['serve', '--dir', {str(tmp_path)!r}, '--capacity', '16M', "
              f"'--metrics-port', '127.0.0.1:{free_port()}']))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 2, done.stderr
    assert "prometheus_client" in done.stderr and "--metrics-port" not in done.stdout
