"""The command lines a new user meets: bad flags and files give one line naming the flag
and exit code 2, never a traceback; --version everywhere; the doctor; a reliable stop."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ems_helpers import ENV, EmsDaemon

pytestmark = pytest.mark.timeout(120)


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.mark.parametrize("flags, named", [
    (["--capacity", "1X"], "--capacity"),
    (["--disk-capacity", "lots"], "--disk-capacity"),
    (["--remote", "bogus://host"], "--remote"),
    (["--credentials", "/nonexistent/creds"], "--credentials"),
    (["--secret-file", "/nonexistent/secret"], "--secret-file"),
    (["--log-level", "LOUD"], "--log-level"),
    (["--tcp", "127.0.0.1:notaport"], "--tcp"),
    (["--max-connections", "0"], "--max-connections"),
    (["--socket-mode", "999"], "--socket-mode"),
])
def test_bad_serve_flags_are_one_line(tmp_path, flags, named) -> None:
    proc = _run("-m", "ems.server", "serve", "--dir", str(tmp_path / "d"), *flags)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert named in last, proc.stderr


def test_malformed_credentials_file_names_the_flag(tmp_path) -> None:
    creds = tmp_path / "creds"
    creds.write_text("no colon here\n")
    proc = _run("-m", "ems.server", "serve", "--dir", str(tmp_path / "d"), "--credentials", str(creds))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--credentials" in proc.stderr and ":1:" in proc.stderr


@pytest.mark.parametrize("module", ["ems.server", "ems.bench", "datadist.bench", "datadist", "ems"])
def test_version_everywhere(module: str) -> None:
    import datadist

    proc = _run("-m", module, "--version")
    assert proc.returncode == 0 and datadist.__version__ in proc.stdout, proc.stderr


def test_doctor_reports_this_machine() -> None:
    proc = _run("-m", "datadist", "--json")
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["native_extension"] == "ok" and "cpu" in facts["devices"]
    assert {"shm", "tcp"} <= set(facts["transports"]) and facts["executor"] in ("host", "torch")


def test_python_m_ems_says_whether_a_pool_answers(tmp_path) -> None:
    proc = _run("-m", "ems", "--server", str(tmp_path / "nobody"))
    assert proc.returncode == 1 and "not answering" in proc.stdout
    daemon = EmsDaemon(tmp_path / "pool").start()
    try:
        proc = _run("-m", "ems", "--server", daemon.dir)
        assert proc.returncode == 0 and "answering" in proc.stdout, proc.stdout + proc.stderr
    finally:
        daemon.stop()


def test_stop_is_reliable(tmp_path) -> None:
    for i in range(20):
        daemon = EmsDaemon(tmp_path / f"p{i}").start()
        proc = _run("-m", "ems.server", "stop", "--dir", daemon.dir)
        assert proc.returncode == 0, f"attempt {i}: {proc.stderr}"
        assert daemon.proc.wait(30) == 0
        assert not os.path.exists(os.path.join(daemon.dir, "ems.sock"))


def test_datadist_log_level_from_the_environment() -> None:
    code = "import datadist, logging; print(logging.getLogger('datadist').level)"
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        env={**ENV, "DATADIST_LOG_LEVEL": "debug"})
    assert ok.returncode == 0 and ok.stdout.strip() == "10"
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**ENV, "DATADIST_LOG_LEVEL": "LOUD"})
    assert bad.returncode == 0 and bad.stdout.strip() == "0"
    assert bad.stderr.count("DATADIST_LOG_LEVEL") == 1 and "Traceback" not in bad.stderr


def _stats(directory: str) -> dict:
    proc = _run("-m", "ems.server", "stats", "--dir", directory, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_serve_reads_a_toml_config_and_flags_override_it(tmp_path) -> None:
    config = tmp_path / "ems.toml"
    config.write_text('capacity = "48M"\nmax-connections = 8\nlog_level = "WARNING"\nno_spill_on_exit = true\n')
    daemon = EmsDaemon(tmp_path / "a", capacity="64M", extra=["--config", str(config)]).start()
    try:  # EmsDaemon passes --capacity 64M on the command line: it wins over the file's 48M
        assert _stats(daemon.dir)["capacity"] == 64 << 20
    finally:
        daemon.stop()
    daemon = EmsDaemon(tmp_path / "b")
    daemon.args = ["--dir", daemon.dir, "--config", str(config)]  # the file alone
    daemon.start()
    try:
        assert _stats(daemon.dir)["capacity"] == 48 << 20
    finally:
        daemon.stop()


@pytest.mark.parametrize("text, named", [('capcity = "1G"\n', "capcity"), ("capacity = [1]\n", "capacity"),
                                         ("x = \n", "TOML")])
def test_bad_config_files_are_one_line(tmp_path, text: str, named: str) -> None:
    config = tmp_path / "ems.toml"
    config.write_text(text)
    proc = _run("-m", "ems.server", "serve", "--dir", str(tmp_path / "d"), "--config", str(config))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--config" in proc.stderr and named in proc.stderr


@pytest.mark.parametrize("executor", ["host", "torch"])
def test_datadist_bench_rows_have_the_one_record_schema(executor: str) -> None:
    from datadist.bench.record import FIELDS

    proc = _run("-m", "datadist.bench", "--workload", "inorder-256k", "--transport", "shm", "--json",
                "--executor", executor, timeout=240)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout.splitlines()[-1])
    assert list(row)[:len(FIELDS)] == list(FIELDS)
    assert row["verified"] is True and row["executor"] == executor and row["gbps"] > 0
    assert abs(row["ratio"] - row["gbps"] / row["raw_copy_gbps"]) < 0.002


def test_bench_plot_draws_what_ran(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "fig"
    proc = _run("-m", "datadist.bench", "--workload", "inorder-256k", "--workload", "small-4k", "--transport", "shm",
                "--plot", str(out), timeout=240)
    assert proc.returncode == 0, proc.stderr
    png, svg = out.with_suffix(".png"), out.with_suffix(".svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and b"<svg" in svg.read_bytes()[:2000]
    assert "inorder-256k" in svg.read_text() and "small-4k" in svg.read_text()
