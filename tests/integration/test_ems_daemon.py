"""The pool daemon with real processes: round trips, failures, restarts, disk tier."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from ems_helpers import (ENV, check, daemon_factory, ems_cc, ems_daemon, init_cc, kvcache,  # noqa: F401
                         run_client)

from ems import CcKvOption, Ems, EmsException, KvBufferWrapper, PrimaryKey
from ems.common.exception import EmsErrorCode
from ems.pool import wire
from ems.pool.keyset import KeySet

pytestmark = pytest.mark.timeout(120)

# Client scripts, run by run_client with ems_helpers.ENV (PYTHONPATH: the tree and tests/).
SAVER = """
import torch
from ems_helpers import init_cc, kvcache
cc = init_cc({server!r})
kv = kvcache(seed=5)
cc.register_kvcache(kv)
r = cc.save(slot_mapping=list(range(8)), hashes=[11, 22], offsets=[4, 4])
print(r.success, r.total)
"""

LOADER = """
import torch
from ems_helpers import init_cc, kvcache
cc = init_cc({server!r})
kv = kvcache(seed=9)
cc.register_kvcache(kv)
ref = kvcache(seed=5)
r = cc.load(slot_mapping=list(range(16, 24)), hashes=[11, 22], offsets=[4, 4])
ok = all(torch.equal(kv[l][k][4:6], ref[l][k][0:2]) for l in range(2) for k in range(2))
print(r.success, r.total, ok)
"""


def test_two_processes_round_trip(ems_daemon):
    out = check(run_client(SAVER.format(server=ems_daemon.dir)))
    assert out.split() == ["2", "2"]
    out = check(run_client(LOADER.format(server=ems_daemon.dir)))
    assert out.split() == ["2", "2", "True"]


def test_stats_command(ems_daemon, ems_cc):
    ems_cc.register_kvcache(kvcache())
    ems_cc.save(slot_mapping=[0, 1, 2, 3], hashes=[1], offsets=[4])
    out = subprocess.run([sys.executable, "-m", "ems.server", "stats", "--dir", ems_daemon.dir, "--json"],
                         capture_output=True, text=True, env=ENV, timeout=30)
    stats = json.loads(check(out))
    assert stats["committed"] == 1 and stats["values"] == 1 and stats["pid"] == ems_daemon.pid
    table = check(subprocess.run([sys.executable, "-m", "ems.server", "stats", "--dir", ems_daemon.dir],
                                 capture_output=True, text=True, env=ENV, timeout=30))
    assert "committed" in table


_AS_NOBODY = """
import os, sys, json
from ems.client.conn import probe
os.setgid(65534); os.setuid(65534)
out = {{}}
for what in ("stats", "shutdown"):
    try:
        probe({path!r}, what, timeout_s=10)
        out[what] = "ok"
    except Exception as exc:
        out[what] = type(exc).__name__ + ": " + str(exc)
print(json.dumps(out))
"""


def _probe_as_nobody(path: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _AS_NOBODY.format(path=path)],
                          capture_output=True, text=True, env=ENV, timeout=60)
    return json.loads(check(proc))


def test_socket_mode_and_operator_requests(daemon_factory, tmp_path, request):
    d = daemon_factory(directory=tmp_path / "private")
    assert os.stat(os.path.join(d.dir, "ems.sock")).st_mode & 0o777 == 0o600  # owner only by default
    if os.geteuid() != 0:
        pytest.skip("connecting as another user needs root to switch users")
    # pytest's temporary directories are private to root: another user could not reach a
    # socket inside them whatever its mode, so these daemons live in /dev/shm.
    base = Path(tempfile.mkdtemp(prefix="ems-perm-", dir="/dev/shm"))
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    base.chmod(0o755)
    shared = daemon_factory(directory=base / "shared", extra=["--socket-mode", "0666"])
    os.chmod(shared.dir, 0o755)
    sock = os.path.join(shared.dir, "ems.sock")
    assert os.stat(sock).st_mode & 0o777 == 0o666
    got = _probe_as_nobody(sock)
    assert got["stats"] == "ok"  # open tenancy: statistics for whoever may connect
    assert got["shutdown"].startswith("PoolRejected") and "own user" in got["shutdown"]
    assert shared.alive()  # refused: still serving
    creds = tmp_path / "creds"
    creds.write_text("alice: " + "A" * 40 + "\n")
    tenants = daemon_factory(directory=base / "tenants", credentials=creds, extra=["--socket-mode", "0666"])
    os.chmod(tenants.dir, 0o755)
    got = _probe_as_nobody(os.path.join(tenants.dir, "ems.sock"))
    assert got["stats"].startswith("PoolRejected") and got["shutdown"].startswith("PoolRejected")
    # the daemon's own user still may do both
    stats = json.loads(check(subprocess.run([sys.executable, "-m", "ems.server", "stats", "--dir", tenants.dir,
                                             "--json"], capture_output=True, text=True, env=ENV, timeout=30)))
    assert stats["tenancy"] == "credentials"
    assert tenants.stop() == 0 and not tenants.alive()


def test_sigkill_health_false_and_io_error(ems_daemon, ems_cc):
    ems_cc.register_kvcache(kvcache())
    assert Ems.check_health() is True
    assert ems_cc.save(slot_mapping=[0, 1, 2, 3], hashes=[1], offsets=[4]).success == 1
    ems_daemon.kill()
    assert Ems.check_health() is False
    with pytest.raises(EmsException) as ei:
        ems_cc.load(slot_mapping=[0, 1, 2, 3], hashes=[1], offsets=[4])
    assert ei.value.status_code() == EmsErrorCode.EMS_IO_ERROR
    with pytest.raises(EmsException) as ei:
        ems_cc.save(slot_mapping=[0, 1, 2, 3], hashes=[2], offsets=[4])
    assert ei.value.status_code() == EmsErrorCode.EMS_IO_ERROR
    fut = ems_cc.async_save(slot_mapping=[0, 1, 2, 3], hashes=[3], offsets=[4])
    with pytest.raises(EmsException) as ei:
        fut.result(30)
    assert ei.value.status_code() == EmsErrorCode.EMS_IO_ERROR
    # exists never raises for a pool fault: it reports no hits
    assert ems_cc.exists([1]).success == 0


def test_unreachable_address_fails_init_with_address(tmp_path):
    Ems._shutdown()
    missing = str(tmp_path / "nobody")
    with pytest.raises(EmsException) as ei:
        init_cc(missing)
    assert ei.value.status_code() == EmsErrorCode.EMS_IO_ERROR
    assert missing in ei.value.message()
    assert Ems.get_cc() is None and Ems.check_health() is False


def test_restart_reconnects(daemon_factory, tmp_path, caplog):
    d = daemon_factory(directory=tmp_path / "pool", disk_dir=tmp_path / "disk")
    cc = init_cc(d.dir)
    try:
        kv = kvcache(seed=1)
        cc.register_kvcache(kv)
        assert cc.save(slot_mapping=list(range(8)), hashes=[7, 8], offsets=[4, 4]).success == 2
        assert d.stop() == 0  # graceful: memory spills to the disk tier
        d.start()
        with caplog.at_level(logging.WARNING, logger="ems"):
            assert Ems.check_health() is True
        assert any(r.name == "ems" and "restarted" in r.getMessage() for r in caplog.records)
        ref = [[t.clone() for t in layer] for layer in kv]
        for layer in kv:
            for t in layer:
                t.zero_()
        assert cc.load(slot_mapping=list(range(8)), hashes=[7, 8], offsets=[4, 4]).success == 2
        assert all(torch.equal(kv[i][k][0:2], ref[i][k][0:2]) for i in range(2) for k in range(2))
    finally:
        Ems._shutdown()


def test_disk_tier_survives_kill_for_spilled_values(daemon_factory, tmp_path):
    # 1 MiB values in a 3 MiB arena: older values spill to disk as new ones arrive.
    d = daemon_factory(directory=tmp_path / "pool", capacity="3M", disk_dir=tmp_path / "disk")
    cc = init_cc(d.dir)
    try:
        bufs = [torch.full((1 << 18,), float(i)) for i in range(6)]
        keys = [f"k{i}" for i in range(6)]
        res = cc.save(CcKvOption(), keys, [[KvBufferWrapper(b.data_ptr, 1 << 20)] for b in bufs])
        assert res.success == 6
        d.kill()  # no graceful spill: only what was evicted is on disk
        d.start()
        out = torch.zeros(1 << 18)
        res = cc.load(CcKvOption(), [keys[0]], [[KvBufferWrapper(out.data_ptr, 1 << 20)]])
        assert res.success == 1 and torch.equal(out, bufs[0])
    finally:
        Ems._shutdown()


def test_exists_reads_the_published_key_set_without_the_daemon(daemon_factory, tmp_path):
    """Memory's keys are answered from the key set the daemon publishes: a stopped (SIGSTOP)
    daemon still gets exists right, evictions withdraw keys, and lower tiers are asked."""
    d = daemon_factory(directory=tmp_path / "pool", capacity="3M", disk_dir=tmp_path / "disk")
    cc = init_cc(d.dir)
    try:
        bufs = [torch.full((1 << 18,), float(i)) for i in range(5)]
        keys = [f"k{i}" for i in range(5)]
        wrap = [[KvBufferWrapper(b.data_ptr, 1 << 20)] for b in bufs]
        assert cc.save(CcKvOption(), keys[:2], wrap[:2]).success == 2
        # a missing middle key stops the count (memory says 1, the disk tier adds nothing)
        assert cc.exists(key_list=[keys[0], "absent", keys[1]]).success == 1
        with d.stopped():
            opt = CcKvOption(timeout=300)  # a round trip would time out (and read as 0)
            assert cc.exists(key_list=keys[:2], option=opt).success == 2
        # 1 MiB values in a 3 MiB pool: k0 and k1 are spilled to disk by the next saves.
        assert cc.save(CcKvOption(), keys[2:], wrap[2:]).success == 3
        stats = json.loads(check(subprocess.run([sys.executable, "-m", "ems.server", "stats", "--dir", d.dir,
                                                 "--json"], capture_output=True, text=True, env=ENV)))
        assert stats["spills"] >= 1
        published = stats["tenants"]["(open)"]["published_keys"]
        assert published == stats["values"] < 5  # spilled keys left the published set
        assert cc.exists(key_list=keys).success == 5  # ... and the daemon's disk tier has them
        with d.stopped():
            assert cc.exists(key_list=keys, option=CcKvOption(timeout=300)).success == 0
    finally:
        Ems._shutdown()


def test_corrupted_value_on_disk_is_a_miss(daemon_factory, tmp_path):
    disk = tmp_path / "disk"
    d = daemon_factory(directory=tmp_path / "pool", disk_dir=disk)
    cc = init_cc(d.dir)
    try:
        a, b = torch.arange(1024, dtype=torch.float32), torch.arange(1024, dtype=torch.float32) * 2
        cc.save(CcKvOption(), ["a", "b"], [[KvBufferWrapper(a.data_ptr, 4096)], [KvBufferWrapper(b.data_ptr, 4096)]])
        assert d.stop() == 0
        files = sorted(disk.glob("*.val"))
        assert len(files) == 2
        for f in files:  # flip one byte of each value's payload
            raw = bytearray(f.read_bytes())
            raw[-100] ^= 0xFF
            f.write_bytes(bytes(raw))
        d.start()
        out = torch.zeros(1024)
        res = cc.load(CcKvOption(), ["a"], [[KvBufferWrapper(out.data_ptr, 4096)]])
        assert res.success == 0
        assert cc.exists(key_list=["a"]).success == 0  # dropped, not just skipped
        assert len(list(disk.glob("*.val"))) == 1
    finally:
        Ems._shutdown()


def test_corrupted_value_in_memory_is_a_miss_and_dropped(ems_daemon, ems_cc):
    from ems.client.conn import MappedArena  # noqa: F401 - the arena is what a stray write hits

    a = torch.arange(2048, dtype=torch.float32)
    ems_cc.save(CcKvOption(), ["x"], [[KvBufferWrapper(a.data_ptr, a.numel() * 4)]])
    arena = Ems._pool._arena
    used = arena.array[:8192].copy()
    assert used.any()
    arena.array[100] ^= 0xFF  # a stray write into the shared arena
    out = torch.zeros(2048)
    assert ems_cc.load(CcKvOption(), ["x"], [[KvBufferWrapper(out.data_ptr, 8192)]]).success == 0
    assert ems_cc.exists(key_list=["x"]).success == 0


class _StallingServer:
    """Answers HELLO (with an arena and a key set that tells clients to ask the daemon),
    then never answers anything: deadlines must fire."""

    def __init__(self, path: str, sealed: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.fd = os.memfd_create("stall", os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, 1 << 20)
        if sealed:  # clients map only sealed arenas
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        self.keys = KeySet("stall", 64)
        self.keys.invalidate()
        self.conns = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(c)
            msg, _ = wire.recv_msg(c)
            wire.send_msg(c, wire.HelloReply("stall", "", 1 << 20, 1 << 20, True, self.keys.size),
                          fds=[self.fd, self.keys.fd])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()
        os.close(self.fd)
        self.keys.close()


def test_deadline_gives_io_timeout(tmp_path):
    path = str(tmp_path / "ems.sock")
    server = _StallingServer(path)
    try:
        cc = init_cc(str(tmp_path))
        cc.register_kvcache(kvcache())
        with pytest.raises(EmsException) as ei:
            cc.save(slot_mapping=[0, 1, 2, 3], hashes=[1], offsets=[4], option=CcKvOption(timeout=200))
        assert ei.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
        with pytest.raises(EmsException) as ei:
            cc.load(slot_mapping=[0, 1, 2, 3], hashes=[1], offsets=[4], option=CcKvOption(timeout=200))
        assert ei.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
        fut = cc.async_load(slot_mapping=[0, 1, 2, 3], hashes=[1], offsets=[4], option=CcKvOption(timeout=200))
        assert cc.get_result.__self__ is cc
        with pytest.raises(EmsException) as ei:
            cc.get_result(fut)
        assert ei.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
        assert cc.exists([1], CcKvOption(timeout=200)).success == 0  # never raises
    finally:
        Ems._shutdown()
        server.close()


def test_an_arena_that_could_shrink_is_not_mapped(tmp_path):
    """A daemon (of a release before sealed arenas, or a hostile one) passes an arena whose
    size is not sealed: the client refuses to map it (anyone holding it could shrink it
    under the mapping, and a copy into it would fault) and reports the pool unusable."""
    path = str(tmp_path / "ems.sock")
    server = _StallingServer(path, sealed=False)
    try:
        with pytest.raises(EmsException) as ei:
            init_cc(str(tmp_path))  # Ems.init connects once: the arena is refused there
        assert ei.value.status_code() == EmsErrorCode.EMS_IO_ERROR, ei.value
        assert "unusable arena" in str(ei.value) and "F_SEAL_SHRINK" in str(ei.value)
    finally:
        Ems._shutdown()
        server.close()


def test_async_futures_and_profiling(ems_daemon, tmp_path, monkeypatch):
    log_dir = tmp_path / "log" / "nested"
    monkeypatch.setenv("ENABLE_CC_PROFILING", "1")
    monkeypatch.setenv("EMS_SDK_LOG", str(log_dir))
    cc = init_cc(ems_daemon.dir)
    try:
        cc.register_kvcache(kvcache())
        futs = [cc.async_save(slot_mapping=[4 * i + j for j in range(4)], hashes=[100 + i], offsets=[4])
                for i in range(4)]
        assert all(cc.get_result(f).success == 1 for f in futs)
        assert all(cc.is_ready(f) for f in futs)
        f = cc.async_load(slot_mapping=list(range(16)), hashes=[100, 101, 102, 103], offsets=[4] * 4)
        assert f.result(30).success == 4
        assert cc.exists([100, 101, 999, 102]).success == 2
        with pytest.raises(EmsException) as ei:
            cc.is_ready("not a future")
        assert ei.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    finally:
        Ems._shutdown()
    files = list(log_dir.glob("*.jsonl"))
    assert len(files) == 1
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert {r["op"] for r in records} == {"save", "load", "exists"}
    load = next(r for r in records if r["op"] == "load")
    assert load["keys"] == 4 and load["hits"] == 4 and load["bytes"] > 0 and load["mode"] == "async"
    assert all({"latency_us", "form", "bytes", "keys", "hits"} <= set(r) for r in records)


def test_profiling_unwritable_dir_warns_once(ems_daemon, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("ENABLE_CC_PROFILING", "1")
    monkeypatch.setenv("EMS_SDK_LOG", str(blocker / "sub"))
    cc = init_cc(ems_daemon.dir)
    try:
        with caplog.at_level(logging.WARNING, logger="ems"):
            assert cc.exists([1]).success == 0
            assert cc.exists([1]).success == 0  # no second warning, no failure
        warned = [r for r in caplog.records if r.name == "ems" and "profiling" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    finally:
        Ems._shutdown()


def test_v0_overwrite_does_not_tear_a_pinned_reader(ems_daemon, ems_cc):
    from ems.client.pool import PoolClient

    a = torch.full((1024,), 1.0)
    b = torch.full((1024,), 2.0)
    ems_cc.save(CcKvOption(), [PrimaryKey("d", "a")], [[KvBufferWrapper(a.data_ptr, 4096)]])
    # A raw reader pins the value, then the key is saved again with other bytes.
    pool = Ems._pool
    with pool.connection(None) as conn:
        key = ems_cc._ns.primary_key("d", "a")
        got = conn.call(wire.Get([key]), None)
        off = got.offsets[0]
        ems_cc.save(CcKvOption(), [PrimaryKey("d", "a")], [[KvBufferWrapper(b.data_ptr, 4096)]])
        pinned = conn.arena.array[off:off + 4096].view("float32")
        assert (pinned == 1.0).all()  # the old value is untouched while leased
        conn.send(wire.Release(got.lease), None)
    out = torch.zeros(1024)
    assert ems_cc.load(CcKvOption(), [PrimaryKey("d", "a")], [[KvBufferWrapper(out.data_ptr, 4096)]]).success == 1
    assert torch.equal(out, b)
    assert isinstance(pool, PoolClient)


def test_tcp_address_round_trip(daemon_factory):
    d = daemon_factory(tcp=True)
    cc = init_cc(d.tcp)
    try:
        kv = kvcache(seed=3)
        cc.register_kvcache(kv)
        assert cc.save(slot_mapping=list(range(8)), hashes=[5, 6], offsets=[4, 4]).success == 2
        ref = [[t.clone() for t in layer] for layer in kv]
        assert cc.load(slot_mapping=list(range(8, 16)), hashes=[5, 6], offsets=[4, 4]).success == 2
        assert all(torch.equal(kv[i][k][2:4], ref[i][k][0:2]) for i in range(2) for k in range(2))
        a = torch.arange(100, dtype=torch.float32)
        out = torch.zeros(100)
        assert cc.save(CcKvOption(), ["t"], [[KvBufferWrapper(a.data_ptr, 400)]]).success == 1
        assert cc.load(CcKvOption(), ["t"], [[KvBufferWrapper(out.data_ptr, 400)]]).success == 1
        assert torch.equal(a, out)
    finally:
        Ems._shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kvcache_round_trip(ems_daemon):
    try:
        cc = init_cc(ems_daemon.dir)
        kv = [[t.cuda() for t in layer] for layer in kvcache(seed=6)]
        cc.register_kvcache(kv)
        ref = [[t.clone() for t in layer] for layer in kv]
        assert cc.save(slot_mapping=list(range(8)), hashes=[61, 62], offsets=[4, 4]).success == 2
        assert cc.load(slot_mapping=list(range(8, 16)), hashes=[61, 62], offsets=[4, 4]).success == 2
        assert all(torch.equal(kv[i][k][2:4], ref[i][k][0:2]) for i in range(2) for k in range(2))
    finally:
        Ems._shutdown()


@pytest.mark.parametrize("tcp", [False, True])
def test_key_lists_longer_than_a_frame_holds_go_in_batches(daemon_factory, monkeypatch, tcp):
    """A frame lists at most wire.MAX_KEYS keys (the daemon refuses more); calls with more
    go in batches, each answered by the daemon, and still count leading hits across them.
    The bound is made 3 here, in this client only, so 8 keys take three frames; every
    frame the client sends is recorded on its way to the daemon."""
    from ems.client.conn import Connection

    monkeypatch.setattr(wire, "MAX_KEYS", 3)
    sent: list = []
    call = Connection.call
    monkeypatch.setattr(Connection, "call", lambda self, msg, *a: sent.append(msg) or call(self, msg, *a))
    d = daemon_factory(tcp=tcp)
    cc = init_cc(d.tcp if tcp else d.dir)
    try:
        src = torch.arange(8 * 256, dtype=torch.float32)
        keys = [f"k{i}" for i in range(8)]
        wrap = lambda t, i: [KvBufferWrapper(t.data_ptr() + i * 1024, 1024)]  # noqa: E731
        assert cc.save(CcKvOption(), keys, [wrap(src, i) for i in range(8)]).success == 8
        assert cc.exists(key_list=keys).success == 8
        assert cc.exists(key_list=keys[:4] + ["absent"] + keys[4:]).success == 4
        out = torch.zeros_like(src)
        assert cc.load(CcKvOption(), keys, [wrap(out, i) for i in range(8)]).success == 8
        assert torch.equal(out, src)
        out.zero_()
        gap = keys[:4] + ["absent"] + keys[5:]
        assert cc.load(CcKvOption(), gap, [wrap(out, i) for i in range(8)]).success == 4
        assert torch.equal(out[:4 * 256], src[:4 * 256]) and not out[4 * 256:].any()
        listed = [len(m.keys) for m in sent if hasattr(m, "keys")]
        assert max(listed) == 3 and [type(m) for m in sent].count(wire.Reserve) == 3, listed
        assert [type(m) for m in sent].count(wire.Get) == 3 + 2  # 8 keys; 4 then the miss in the second
    finally:
        Ems._shutdown()
