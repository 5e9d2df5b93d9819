"""``DatadistConnector``'s ``kv_connector_extra_config`` as the connector reads it, in a
child interpreter with stand-ins for vLLM's modules (vLLM itself is not needed)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

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
