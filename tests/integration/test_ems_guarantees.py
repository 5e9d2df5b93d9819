"""Guarantees of the client API against a real pool daemon: buffers bounded by their
tensors, keys that never alias, failed overwrites that leave no stale value, and waits
that end."""
from __future__ import annotations

import pytest
import torch

from ems_helpers import daemon_factory, ems_cc, ems_daemon, init_cc, kvcache  # noqa: F401

from ems import CcKvOption, Ems, EmsException, KvBufferWrapper
from ems.common.exception import EmsErrorCode

pytestmark = pytest.mark.timeout(120)


def _refused(fn, name: str) -> str:
    with pytest.raises(EmsException) as ei:
        fn()
    assert ei.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT, ei.value
    assert f"'{name}'" in ei.value.message(), ei.value.message()
    return ei.value.message()


def test_a_tensor_buffer_is_bounded_by_its_tensor(ems_cc):
    """A bound ``data_ptr`` of a CPU tensor: a length over the tensor's bytes is refused
    (a load would write past the tensor), and so is a tensor that is not contiguous."""
    opt = CcKvOption(timeout=5000)
    src = torch.arange(16, dtype=torch.float32) + 100
    assert ems_cc.save(opt, ["k64"], [[KvBufferWrapper(src.data_ptr, 64)]]).success == 1
    big = torch.zeros(16)
    head = big[:2]  # 8 bytes, contiguous, with 56 more bytes of `big` after them
    text = _refused(lambda: ems_cc.load(opt, ["k64"], [[KvBufferWrapper(head.data_ptr, 64)]]), "length")
    assert "64" in text and "8 bytes" in text
    assert torch.equal(big, torch.zeros(16))  # nothing written, inside or beyond
    _refused(lambda: ems_cc.save(opt, ["k64b"], [[KvBufferWrapper(head.data_ptr, 64)]]), "length")
    assert ems_cc.exists(key_list=["k64b"]).success == 0

    strided = torch.arange(8, dtype=torch.float32)[::2]
    _refused(lambda: ems_cc.save(opt, ["nc"], [[KvBufferWrapper(strided.data_ptr, 16)]]), "data_ptr")
    assert ems_cc.exists(key_list=["nc"]).success == 0
    out = torch.zeros(8)[::2]
    _refused(lambda: ems_cc.load(opt, ["k64"], [[KvBufferWrapper(out.data_ptr, 16)]]), "data_ptr")
    # Within bounds still works: the whole tensor, or its first bytes.
    whole = torch.zeros(16)
    assert ems_cc.load(opt, ["k64"], [[KvBufferWrapper(whole.data_ptr, 64)]]).success == 1
    assert torch.equal(whole, src)


def test_a_data_ptr_that_raises_is_an_invalid_argument(ems_cc):
    def gone() -> int:
        raise RuntimeError("freed")

    text = _refused(lambda: ems_cc.save(CcKvOption(), ["a"], [[KvBufferWrapper(gone, 16)]]), "data_ptr")
    assert "RuntimeError: freed" in text
    _refused(lambda: ems_cc.load(CcKvOption(), ["a"], [[KvBufferWrapper(gone, 16)]]), "data_ptr")
    assert ems_cc.exists(key_list=["a"]).success == 0


def test_v0_option_none_is_refused_naming_option(ems_cc):
    t = torch.ones(4)
    text = _refused(lambda: ems_cc.save(None, ["a"], [[KvBufferWrapper(t.data_ptr, 16)]]), "option")
    assert "None" in text
    _refused(lambda: ems_cc.async_load(None, ["a"], [[KvBufferWrapper(t.data_ptr, 16)]]), "option")
    assert ems_cc.exists(key_list=["a"]).success == 0


def test_refused_calls_are_profiled_too(ems_daemon, tmp_path, monkeypatch):  # noqa: F811
    """SPEC section 1: one profiling record per call; a refused one carries its error."""
    monkeypatch.setenv("ENABLE_CC_PROFILING", "1")
    monkeypatch.setenv("EMS_SDK_LOG", str(tmp_path / "log"))
    cc = init_cc(ems_daemon.dir)
    try:
        t = torch.ones(4)
        assert cc.save(CcKvOption(), ["ok"], [[KvBufferWrapper(t.data_ptr, 16)]]).success == 1
        _refused(lambda: cc.save(None, ["a"], [[KvBufferWrapper(t.data_ptr, 16)]]), "option")
        _refused(lambda: cc.async_load(slot_mapping=[0], hashes=[1], offsets=[1]), "kvcache")
        _refused(lambda: cc.exists(None), "hashes")
    finally:
        Ems._shutdown()
    import json

    (log,) = (tmp_path / "log").glob("*.jsonl")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["op"], r["mode"], r["error"]) for r in records] == [
        ("save", "sync", None), ("save", "sync", "EMS_INVALID_ARGUMENT"),
        ("load", "async", "EMS_INVALID_ARGUMENT"), ("exists", "sync", "EMS_INVALID_ARGUMENT")]
    assert all(r["keys"] == 0 and r["form"] == "unknown" for r in records[1:])


def test_int_and_bytes_hashes_never_read_each_others_values(ems_cc):
    """0xb01 and b"\\x01" (and 0x1 and b"\\x01\\x00"...) are distinct keys: one's value is
    never found or loaded under the other."""
    kv = kvcache(blocks=4)
    ems_cc.register_kvcache(kv)
    pairs = [(0xB01, b"\x01"), (0xB, b""), (0xBAB, b"\xab")]
    saved_ints = [i for i, _ in pairs]
    assert ems_cc.save(slot_mapping=list(range(12)), hashes=saved_ints, offsets=[4] * 3).success == 3
    for i, b in pairs:
        if b:
            assert ems_cc.exists([b]).success == 0, b
            assert ems_cc.load(slot_mapping=[12, 13, 14, 15], hashes=[b], offsets=[4]).success == 0, b
    assert ems_cc.save(slot_mapping=[12, 13, 14, 15], hashes=[b"\x02"], offsets=[4]).success == 1
    assert ems_cc.exists([0xB02]).success == 0
    assert ems_cc.exists(saved_ints + [b"\x02"]).success == 4


def _v0_save(cc, key: str, t: torch.Tensor) -> int:
    return cc.save(CcKvOption(timeout=20000), [key], [[KvBufferWrapper(t.data_ptr, t.numel() * t.element_size())]]).success


@pytest.mark.parametrize("tiers", ["memory", "disk"])
def test_a_failed_overwrite_leaves_a_miss_not_the_old_value(daemon_factory, tmp_path, tiers):  # noqa: F811
    """Vendor (seeds/003 section 8.2): a key that fails to save is not read later.  An 8 B
    value, then one larger than the pool under the same key (refused: no room): the key
    is a miss, in memory and (spilled at a restart) on disk."""
    disk = dict(disk_dir=tmp_path / "disk") if tiers == "disk" else {}
    d = daemon_factory(capacity="8M", **disk)
    cc = init_cc(d.dir)
    try:
        old = torch.full((2,), 1.0)
        assert _v0_save(cc, "ov", old) == 1
        assert _v0_save(cc, "keep", old) == 1
        if tiers == "disk":  # the old value only on disk now
            Ems._shutdown()
            d.stop()
            d.start()
            cc = init_cc(d.dir)
            assert cc.exists(key_list=["ov"]).success == 1
        huge = torch.full((4 << 20,), 2.0)  # 16 MiB > the 8 MiB pool
        assert _v0_save(cc, "ov", huge) == 0
        assert cc.exists(key_list=["ov"]).success == 0
        out = torch.zeros(2)
        assert cc.load(CcKvOption(), ["ov"], [[KvBufferWrapper(out.data_ptr, 8)]]).success == 0
        assert torch.equal(out, torch.zeros(2))
        assert cc.load(CcKvOption(), ["keep"], [[KvBufferWrapper(out.data_ptr, 8)]]).success == 1  # others stay
        assert torch.equal(out, old)
        new = torch.full((2,), 3.0)  # a later save that succeeds is read
        assert _v0_save(cc, "ov", new) == 1
        assert cc.load(CcKvOption(), ["ov"], [[KvBufferWrapper(out.data_ptr, 8)]]).success == 1
        assert torch.equal(out, new)
    finally:
        Ems._shutdown()



STALLED_EXIT = """
import sys, time
import ems.types
from ems import CcKvOption
from ems_helpers import init_cc, kvcache
from waiting import until
bound = ems.types.NO_TIMEOUT_BOUND_MS
ems.types.NO_TIMEOUT_BOUND_MS = 1500  # shortened for the sync call
cc = init_cc({server!r})
cc.register_kvcache(kvcache())
t0 = time.monotonic()
try:
    cc.save(slot_mapping=[0, 1, 2, 3], hashes=[1], offsets=[4], option=CcKvOption(timeout=0))
except Exception as exc:
    print("sync", exc.status_code().name, round(time.monotonic() - t0, 1), flush=True)
ems.types.NO_TIMEOUT_BOUND_MS = bound  # the async calls wait the SDK's own (10 minutes)
fut = cc.async_save(slot_mapping=[0, 1, 2, 3], hashes=[2], offsets=[4], option=CcKvOption(timeout=0))
queued = [cc.async_load(slot_mapping=[0, 1, 2, 3], hashes=[3], offsets=[4], option=CcKvOption(timeout=0))
          for _ in range(40)]
until(lambda: cc._pool._busy, 20, "an async call holds a pool connection")
print("exiting", fut.done(), flush=True)
"""


def test_timeout_0_is_bounded_and_exit_does_not_wait_on_a_stalled_daemon(tmp_path):
    """``timeout=0`` (the vendor's "no timeout") on a daemon that never answers: a call
    ends at the SDK's bound (shortened here), and a process leaving with async calls of
    ``timeout=0`` waiting on it (more than the worker threads) exits within a bound: the
    queued ones are cancelled, the running ones' connections shut after a grace period."""
    import subprocess
    import sys
    import time

    from test_ems_daemon import _StallingServer

    from ems_helpers import ENV

    server = _StallingServer(str(tmp_path / "ems.sock"))
    proc = subprocess.Popen([sys.executable, "-c", STALLED_EXIT.format(server=str(tmp_path))], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    leaving = None
    try:
        out = []
        for line in proc.stdout:  # ends when the process closes its output (at exit)
            out.append(line)
            if line.startswith("exiting"):
                leaving = time.monotonic()
        proc.wait(60)
        took = time.monotonic() - (leaving or 0.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.close()
    text = "".join(out)
    assert proc.returncode == 0, text
    assert "sync EMS_IO_TIMEOUT" in text and "exiting False" in text, text
    assert 1.0 <= float(text.split("sync EMS_IO_TIMEOUT")[1].split()[0]) < 10, text
    assert "connections are shut" in text, text
    assert took < 30, f"the process took {took:.1f} s to exit:\n{text}"
