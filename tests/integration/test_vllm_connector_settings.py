"""``DatadistConnector``'s and ``EmsConnector``'s ``kv_connector_extra_config`` as the
connectors read it, in a child interpreter with stand-ins for vLLM's modules (vLLM itself
is not needed)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict

import pytest

from ems_helpers import ENV
from vllm_standins import write_vllm_standins

pytestmark = pytest.mark.timeout(60)

_SCRIPT = """
    import json, types
    from datadist.integrations.vllm.connector import _settings

    def settings(extra):
        cfg = types.SimpleNamespace(kv_connector_extra_config=extra, is_kv_producer=False, is_kv_consumer=True,
                                    engine_id="e")
        return _settings(types.SimpleNamespace(kv_transfer_config=cfg))

    out = {"default": settings({}).transfer_checksum, "on": settings({"transfer_checksum": True}).transfer_checksum}
    try:
        settings({"transfer_checksum": "yes"})
    except ValueError as exc:
        out["bad"] = str(exc)
    print(json.dumps(out))
"""


def test_transfer_checksum_is_a_key_off_by_default(tmp_path: Path) -> None:
    write_vllm_standins(tmp_path)
    env = {**ENV, "PYTHONPATH": f"{ENV['PYTHONPATH']}:{tmp_path}"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["default"] is False and got["on"] is True, got
    assert "transfer_checksum='yes' must be true or false" in got["bad"], got


#: Values each connector refuses at startup, and ones it takes (key -> values).
_BOUNDS_SCRIPT = """
    import json, sys, types
    from datadist.integrations.vllm.connector import _settings as datadist_settings
    from ems.integrations.vllm.connector import _settings as ems_settings

    def kv(extra):
        return types.SimpleNamespace(kv_connector_extra_config=extra, is_kv_producer=True, is_kv_consumer=False,
                                     engine_id="e")

    def judge(read, key, value):
        try:
            return ["ok", getattr(read(types.SimpleNamespace(kv_transfer_config=kv({key: value}))), FIELDS[key])]
        except ValueError as exc:
            return ["refused", str(exc)]

    FIELDS = {"idle_wait_ms": "idle_wait_ms", "sync_kv_timeout_ms": "timeout_ms", "port": "port",
              "timeout_ms": "timeout_ms", "lookup_timeout_ms": "lookup_timeout_ms"}
    cases = json.loads(sys.argv[1])
    out = {}
    for who, read in (("datadist", datadist_settings), ("ems", ems_settings)):
        for key, values in cases[who].items():
            out[f"{who}:{key}"] = [judge(read, key, v) for v in values]
    print(json.dumps(out))
"""

_CASES: Dict[str, Dict[str, Any]] = {
    "datadist": {"idle_wait_ms": [-1, 5_000_000, 1001, "10", True, 0, 1000],
                 "sync_kv_timeout_ms": [0, -5, 3_600_001, 2.5, 1, 3_600_000],
                 "port": [-1, 65536, "5000", 0, 65535]},
    "ems": {"timeout_ms": [-5, 0, "5000", 1.5, 1, 5000], "lookup_timeout_ms": [-1, 0, True, 3_600_001, 1, 1000]},
}
#: how many leading values of each list above are refused (the rest are taken as given)
_REFUSED = {"datadist:idle_wait_ms": 5, "datadist:sync_kv_timeout_ms": 4, "datadist:port": 3, "ems:timeout_ms": 4,
            "ems:lookup_timeout_ms": 4}


def test_timeouts_waits_and_ports_are_bounded_at_startup(tmp_path: Path) -> None:
    """A value that the engine or the pool client would refuse mid-serving (raising in
    vLLM's scheduler or in ``get_finished``), or one meaning 'no deadline' (a hung pool
    holding the engine loop), is refused when the connector is made, naming the key."""
    write_vllm_standins(tmp_path)
    env = {**ENV, "PYTHONPATH": f"{ENV['PYTHONPATH']}:{tmp_path}"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_BOUNDS_SCRIPT), json.dumps(_CASES)], env=env,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name, refused in _REFUSED.items():
        who, key = name.split(":")
        values = _CASES[who][key]
        for value, (verdict, detail) in zip(values[:refused], got[name][:refused]):
            assert verdict == "refused" and f"{key}={value!r}" in detail, (name, value, detail)
        assert got[name][refused:] == [["ok", v] for v in values[refused:]], (name, got[name])
