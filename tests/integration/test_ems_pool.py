"""Pool behaviour under pressure and across tenants: eviction with concurrent processes,
credentials, and the ``auto`` address (a detached daemon started on demand)."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from ems_helpers import check, daemon_factory, init_cc, run_client  # noqa: F401
from waiting import until

from ems import CcKvOption, Ems, EmsException, KvBufferWrapper
from ems.common.exception import EmsErrorCode

pytestmark = pytest.mark.timeout(180)

# Run with ems_helpers.ENV: its PYTHONPATH makes ems_helpers importable.
WORKER = """
import numpy as np, torch
from ems_helpers import init_cc
from ems import CcKvOption, KvBufferWrapper
cc = init_cc({server!r})
me = {me}
rng = np.random.default_rng(me)
n = 1 << 16  # 256 KiB values: the 2 MiB pool holds 8 of the 4 x 40 written
hits = torn = 0
def value(key):  # every key's bytes are derived from the key: a load can be checked
    return torch.full((n,), float(key), dtype=torch.float32) + torch.arange(n, dtype=torch.float32)
for step in range(40):
    key = me * 1000 + step
    buf = value(key)
    res = cc.save(CcKvOption(timeout=20000), [str(key)], [[KvBufferWrapper(buf.data_ptr, n * 4)]])
    for other in rng.integers(0, 4, 3):
        k = int(other) * 1000 + int(rng.integers(0, step + 1))
        out = torch.empty(n, dtype=torch.float32)
        r = cc.load(CcKvOption(timeout=20000), [str(k)], [[KvBufferWrapper(out.data_ptr, n * 4)]])
        if r.success:
            hits += 1
            if not torch.equal(out, value(k)):
                torn += 1
print(hits, torn)
"""


def test_eviction_with_four_processes_never_tears(daemon_factory):
    import subprocess
    from ems_helpers import ENV

    d = daemon_factory(capacity="2M")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER.format(server=d.dir, me=i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for i in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err
        results.append([int(x) for x in out.split()])
    assert all(torn == 0 for _hits, torn in results)
    assert sum(h for h, _ in results) > 0
    import json
    stats = json.loads(check(subprocess.run([sys.executable, "-m", "ems.server", "stats", "--dir", d.dir,
                                             "--json"], capture_output=True, text=True, env=ENV)))
    assert stats["evictions"] > 0 and stats["used"] <= stats["capacity"]


KEY_A = "A" * 40
KEY_B = "b" * 32 + "+/=="


def test_tenants_authenticated_and_isolated(daemon_factory, tmp_path):
    creds = tmp_path / "creds"
    creds.write_text(f"# tenants\nalice: {KEY_A}\nbob: {KEY_B}\n")
    d = daemon_factory(credentials=creds)
    with pytest.raises(EmsException) as ei:
        init_cc(d.dir, access_id="alice", access_key=KEY_B)
    assert ei.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    with pytest.raises(EmsException):
        init_cc(d.dir, access_id="mallory", access_key=KEY_A)
    with pytest.raises(EmsException):
        init_cc(d.dir)  # no credentials at all
    import torch
    try:
        cc = init_cc(d.dir, access_id="alice", access_key=KEY_A)
        a = torch.arange(256, dtype=torch.float32)
        assert cc.save(CcKvOption(), ["shared-name"], [[KvBufferWrapper(a.data_ptr, 1024)]]).success == 1
        assert cc.exists(key_list=["shared-name"]).success == 1
        cc = init_cc(d.dir, access_id="bob", access_key=KEY_B)
        assert cc.exists(key_list=["shared-name"]).success == 0
        out = torch.zeros(256)
        assert cc.load(CcKvOption(), ["shared-name"], [[KvBufferWrapper(out.data_ptr, 1024)]]).success == 0
        assert not out.any()
        # each tenant has its own arena: bob's mapping does not contain alice's bytes
        assert not Ems._pool._arena.array[:4096].any()
    finally:
        Ems._shutdown()


AUTO_CLIENT = """
import sys, torch
from ems import Ems, EmsConfig, CcConfig, CcKvOption, KvBufferWrapper
Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="auto-m")))
cc = Ems.get_cc()
a = torch.arange(64, dtype=torch.float32)
if sys.argv[1] == "save":
    print(cc.save(CcKvOption(), ["k"], [[KvBufferWrapper(a.data_ptr, 256)]]).success)
else:
    out = torch.zeros(64)
    r = cc.load(CcKvOption(), ["k"], [[KvBufferWrapper(out.data_ptr, 256)]])
    print(r.success, torch.equal(out, a))
import ems.client.conn as c
print(c.probe(Ems._pool.address.text, "stats")["pid"])
"""


def test_auto_starts_a_shared_detached_daemon_that_idles_out(tmp_path):
    import subprocess
    from ems_helpers import ENV

    directory = tmp_path / "auto"
    env = {**ENV, "EMS_SERVER": f"auto:{directory}", "EMS_AUTO_CAPACITY": "32M", "EMS_AUTO_IDLE_EXIT": "2"}
    first = subprocess.run([sys.executable, "-c", AUTO_CLIENT, "save"], capture_output=True, text=True,
                           env=env, timeout=60)
    lines = check(first).split()
    assert lines[0] == "1"
    pid = int(lines[1])
    import socket
    holder = socket.socket(socket.AF_UNIX)  # a connected client keeps the daemon from idling out
    holder.connect(str(directory / "ems.sock"))
    second = subprocess.run([sys.executable, "-c", AUTO_CLIENT, "load"], capture_output=True, text=True,
                            env=env, timeout=60)
    lines = check(second).split()
    assert lines[:2] == ["1", "True"] and int(lines[2]) == pid  # the same daemon served both
    holder.close()
    try:  # another process's exit: no handle to wait on
        until(lambda: not _alive(pid), 30, "the auto-started daemon exits when idle", every=0.1)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert not (directory / "ems.sock").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
