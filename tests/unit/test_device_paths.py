"""The parts of the CUDA data path that run without a GPU: the C loop that calls a copy
function per run (driven here by a host memmove with cuMemcpyAsync's shape), plans that
carry memory kinds, host staging, the wire form of IPC regions, and how an engine decides
where its device caches live.  The device copies themselves are tested in tests/gpu."""
from __future__ import annotations

import importlib.util

import ctypes
import socket

import numpy as np
import pytest

from datadist import LLMException, LLMStatusCode, create_tensors
from datadist.engine import _native, cuda, wire
from datadist.engine.notes import NoteBox
from datadist.engine.requests import RequestHandler
from datadist.engine.transports.base import ANY_CACHE
from datadist.engine.core import resolve_device
from datadist.engine.errors import EngineError, Fault
from datadist.engine.layout import Plan, plan_units
from datadist.engine.registry import Registry
from datadist.engine.transports.local import LocalTransport, host_side, staging_plan

pytestmark = pytest.mark.timeout(60)

U64 = np.uint64
_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)


class _Memmove:
    """A copy function with cuMemcpyAsync's signature that records its calls and fails
    with ``fail_code`` on call number ``fail_at``."""

    def __init__(self, fail_at: int = -1, fail_code: int = 0) -> None:
        self.calls: list[tuple[int, int, int, int]] = []
        self.fail_at, self.fail_code = fail_at, fail_code
        self.fn = _FN(self._call)

    def _call(self, dst: int, src: int, n: int, stream) -> int:
        if len(self.calls) == self.fail_at:
            return self.fail_code
        self.calls.append((dst, src, n, stream or 0))
        ctypes.memmove(dst, src, n)
        return 0

    @property
    def address(self) -> int:
        return ctypes.cast(self.fn, ctypes.c_void_p).value


def _call_plan(fn: _Memmove, plan: Plan, stream: int = 0):
    return _native.call_plan(fn.address, stream, plan.src_bases, plan.dst_bases, plan.src_offs, plan.dst_offs,
                             plan.lens)


def _tensors(n: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def test_call_plan_calls_once_per_run_in_plan_order_and_matches_copy_plan() -> None:
    src, dst, ref = _tensors(3, 4096, 1), np.zeros((3, 4096), np.uint8), np.zeros((3, 4096), np.uint8)
    base = lambda a: [a[i].ctypes.data for i in range(a.shape[0])]  # noqa: E731
    blocks_src, blocks_dst = np.array([5, 0, 7, 2]) * 256, np.array([1, 6, 3, 4]) * 256
    plan = plan_units(base(src), blocks_src, base(dst), blocks_dst, 256)
    fn = _Memmove()
    assert _call_plan(fn, plan, stream=0x1234) == (3 * 4 * 256, 0)
    LocalTransport.copy(plan.rebase(dst_delta=ref.ctypes.data - dst.ctypes.data))
    np.testing.assert_array_equal(dst, ref)
    want = [(int(d), int(s), 256, 0x1234) for t in range(3) for s, d in
            zip(src[t].ctypes.data + blocks_src, dst[t].ctypes.data + blocks_dst)]
    assert fn.calls == want


def test_call_plan_skips_empty_runs_and_stops_at_the_first_failure() -> None:
    src, dst = _tensors(1, 1024, 2)[0], np.zeros(1024, np.uint8)
    plan = Plan(np.array([src.ctypes.data], U64), np.array([dst.ctypes.data], U64), np.array([0, 10, 20, 30], U64),
                np.array([0, 10, 20, 30], U64), np.array([4, 0, 4, 4], U64))
    fn = _Memmove(fail_at=1, fail_code=700)
    assert _call_plan(fn, plan) == (4, 700)  # the empty run is no call; the second call fails
    assert [c[2] for c in fn.calls] == [4]
    assert dst[20:24].tolist() == [0, 0, 0, 0] and dst[:4].tolist() == src[:4].tolist()


def test_call_plan_refuses_a_null_function_and_mismatched_arrays() -> None:
    e = np.zeros(1, U64)
    with pytest.raises(ValueError, match="NULL"):
        _native.call_plan(0, 0, e, e, e, e, e)
    with pytest.raises(ValueError, match="disagree"):
        _native.call_plan(_Memmove().address, 0, e, e, np.zeros(2, U64), e, e)


def test_plans_carry_memory_kinds_through_swap_and_rebase() -> None:
    plan = plan_units([0x1000], [0, 64], [0x9000], [128, 0], 32).on("cuda:1", "cpu")
    assert (plan.src_dev, plan.dst_dev, plan.on_host) == ("cuda:1", "cpu", False)
    back = plan.swapped()
    assert (back.src_dev, back.dst_dev) == ("cpu", "cuda:1")
    moved = plan.rebase(src_delta=16, dst_delta=-16)
    assert (moved.src_dev, moved.dst_dev) == ("cuda:1", "cpu")
    assert int(moved.src_bases[0]) == 0x1010 and int(moved.dst_bases[0]) == 0x8FF0
    assert plan_units([1], [0], [2], [0], 8).on_host


def test_host_side_passes_host_plans_through_unchanged() -> None:
    plan = plan_units([0x1000], [0], [0x2000], [0], 64)
    for local_is_src in (True, False):
        with host_side(plan, local_is_src) as p:
            assert p is plan


def test_staging_plans_pack_runs_in_transfer_order_and_round_trip() -> None:
    src, back = _tensors(2, 2048, 3), np.zeros((2, 2048), np.uint8)
    bases = np.array([src[0].ctypes.data, src[1].ctypes.data], U64)
    offs, lens = np.array([1024, 0, 300], U64), np.array([100, 200, 50], U64)
    staging = np.zeros(2 * 350, np.uint8)
    gather = staging_plan(bases, offs, lens, staging.ctypes.data, gather=True, half_dev="cuda:0")
    assert (gather.src_dev, gather.dst_dev) == ("cuda:0", "cpu")
    LocalTransport.copy(gather.on("cpu", "cpu"))
    want = np.concatenate([np.concatenate([src[t, 1024:1124], src[t, 0:200], src[t, 300:350]]) for t in range(2)])
    np.testing.assert_array_equal(staging, want)
    out_bases = np.array([back[0].ctypes.data, back[1].ctypes.data], U64)
    scatter = staging_plan(out_bases, offs, lens, staging.ctypes.data, gather=False)
    LocalTransport.copy(scatter)
    for t in range(2):
        for o, n in zip(offs.tolist(), lens.tolist()):
            np.testing.assert_array_equal(back[t, o:o + n], src[t, o:o + n])
    assert not back[:, 1124:].any()


def test_ipc_regions_and_device_fields_survive_the_wire() -> None:
    region = cuda.IpcRegion(bytes(range(64)), 0x7F00_0000_0000, 1 << 30)
    assert cuda.IpcRegion.from_wire(region.to_wire()) == region
    msg = wire.Resolved(cache_id=3, device="cuda:1", ipc=[region.to_wire()], arrays=[np.array([5, 6], U64)])
    frame = wire.encode(msg)

    a, b = socket.socketpair()
    try:
        a.sendall(frame)
        b.settimeout(1.0)
        got = wire.read_message(b)
    finally:
        a.close()
        b.close()
    assert isinstance(got, wire.Resolved) and got.device == "cuda:1" and got.cache_id == 3
    assert [cuda.IpcRegion.from_wire(r) for r in got.ipc] == [region]
    hello = wire.Hello(device_regions=[region.to_wire()])
    assert hello.device_regions[0]["handle"] == bytes(range(64)).hex()


def test_ipc_handles_keep_every_byte_including_nuls() -> None:
    raw = bytes([0, 7, 0, 0, 255] * 12 + [1, 0, 0, 2])
    assert cuda._IpcHandle.of(raw).raw() == raw
    with pytest.raises(ValueError, match="64 bytes"):
        cuda._IpcHandle.of(raw[:63])


def test_requests_are_served_on_the_memory_of_the_cache_they_reach() -> None:
    reg = Registry(77, 1)
    try:
        host = np.zeros((2, 256), np.uint8)
        host_rec = reg.add(dict(num_tensors=2, tensor_size=256, batch_size=4, is_blocks=True, dtype="DT_UINT8",
                                addrs=np.array([host[0].ctypes.data, host[1].ctypes.data], U64)))
        dev_rec = reg.add(dict(num_tensors=1, tensor_size=4096, batch_size=1, is_blocks=False, dtype="DT_UINT8",
                               addrs=np.array([0x7000_0000_0000], U64), device="cuda:0"))
        one = lambda x: np.array([x], U64)  # noqa: E731
        handler = RequestHandler(reg, NoteBox(), 5000)

        def device_of(rec, arrays) -> str:  # where the checked request's runs live
            msg = wire.Pull(cache_id=rec.cache_id if rec else ANY_CACHE, epoch=reg.epoch,
                            nbytes=int(arrays[2].sum()) * arrays[0].shape[0], arrays=arrays)
            status, why, device = handler._check(rec, msg)
            assert status == 0, why
            return device
        assert device_of(dev_rec, [dev_rec.addrs, one(0), one(8)]) == "cuda:0"
        assert device_of(host_rec, [host_rec.addrs, one(0), one(8)]) == "cpu"
        # Raw addresses (no cache id): the caches holding every run decide.
        assert device_of(None, [one(0x7000_0000_0000), one(100), one(8)]) == "cuda:0"
        assert device_of(None, [one(host[1].ctypes.data), one(8), one(8)]) == "cpu"
        assert device_of(None, [np.zeros(0, U64)] * 3) == "cpu"
    finally:
        reg.close()


@pytest.mark.skipif(cuda.available(), reason="checks the machine without CUDA")
def test_without_cuda_device_caches_are_host_memory_and_cuda_requests_are_refused() -> None:
    assert resolve_device("auto", 0) == "cpu"
    assert resolve_device("cpu", 3) == "cpu"
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(EngineError) as caught:
            resolve_device("npu", 0)  # never host memory in disguise
        assert caught.value.fault == Fault.FEATURE_NOT_ENABLED
        assert "torch_npu" in str(caught.value) and "device_type 'cpu'" in str(caught.value)
    with pytest.raises(EngineError) as caught:
        resolve_device("cuda", 0)
    assert caught.value.fault == Fault.FEATURE_NOT_ENABLED
    assert "device_type = 'cuda'" in str(caught.value)
    owner = np.zeros(16, np.int32)
    with pytest.raises(LLMException) as caught:
        create_tensors([16], __import__("torch").int32, [owner.ctypes.data], "cuda:0")
    assert caught.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    with pytest.raises(LLMException) as caught:
        create_tensors([16], __import__("torch").int32, [owner.ctypes.data], "npu:0")
    assert caught.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    with pytest.raises(EngineError) as caught:
        cuda.copy_plan(plan_units([1], [0], [2], [0], 8).on("cuda:0", "cpu"))
    assert caught.value.fault == Fault.FEATURE_NOT_ENABLED


# -- the driver-facing code, against a stand-in driver whose copy function is a host
#    memmove with cuMemcpyAsync's signature (pure logic: dispatch, staging, error paths)

class _FakeDriver:
    def __init__(self, copy_fn: _Memmove) -> None:
        self.copy_fn = copy_fn
        self.memcpy_async = copy_fn.address
        self.syncs = 0
        self.depth = 0
        self.opened: list[bytes] = []

    def cuCtxPushCurrent(self, ctx) -> int:
        self.depth += 1
        return 0

    def cuCtxPopCurrent(self, out) -> int:
        self.depth -= 1
        return 0

    def cuStreamSynchronize(self, stream) -> int:
        self.syncs += 1
        return 0

    def cuIpcOpenMemHandle(self, out, handle, flags) -> int:
        raw = handle.raw()
        self.opened.append(raw)
        out._obj.value = 0x5000_0000 + 0x100_0000 * len(self.opened)  # a fresh local mapping per open
        return 0

    #: What the stand-in driver says each opened allocation's size is.
    mapped_size = 1 << 20

    def cuMemGetAddressRange(self, base, size, ptr) -> int:
        base._obj.value, size._obj.value = ptr, self.mapped_size  # opened mappings start at the allocation
        return 0

    def cuIpcCloseMemHandle(self, ptr) -> int:
        return 0

    def check(self, call: str, code: int) -> None:
        if code:
            raise cuda.CudaError(call, code, "stand-in")


@pytest.fixture
def fake_gpu(monkeypatch):
    fn = _Memmove()
    drv = _FakeDriver(fn)
    dev = object.__new__(cuda.CudaDevice)
    dev.index, dev.name, dev._ctx = 0, "cuda:0", ctypes.c_void_p(1)
    monkeypatch.setattr(cuda, "_driver", drv)
    monkeypatch.setattr(cuda, "_active", dev)
    return drv


def test_device_plans_run_through_the_driver_with_the_context_pushed(fake_gpu) -> None:
    src, dst = _tensors(2, 512, 4), np.zeros((2, 512), np.uint8)
    plan = plan_units([src[0].ctypes.data, src[1].ctypes.data], [0, 256], [dst[0].ctypes.data, dst[1].ctypes.data],
                      [256, 0], 128).on("cuda:0", "cpu")
    assert LocalTransport.copy(plan) == 512
    np.testing.assert_array_equal(dst[:, 256:384], src[:, 0:128])
    np.testing.assert_array_equal(dst[:, 0:128], src[:, 256:384])
    assert fake_gpu.syncs == 1 and fake_gpu.depth == 0 and len(fake_gpu.copy_fn.calls) == 4


def test_a_failed_device_copy_raises_after_waiting_for_the_runs_in_flight(fake_gpu) -> None:
    fake_gpu.copy_fn.fail_at, fake_gpu.copy_fn.fail_code = 1, 700
    src, dst = _tensors(1, 64, 5)[0], np.zeros(64, np.uint8)
    plan = Plan(np.array([src.ctypes.data], U64), np.array([dst.ctypes.data], U64), np.array([0, 32], U64),
                np.array([0, 32], U64), np.array([8, 8], U64), "cpu", "cuda:0")
    with pytest.raises(cuda.CudaError, match="cuMemcpyAsync failed: CUDA error 700") as caught:
        cuda.copy_plan(plan)
    assert caught.value.code == 700 and fake_gpu.syncs == 1 and fake_gpu.depth == 0


def test_host_side_stages_a_device_side_through_one_host_buffer(fake_gpu) -> None:
    src, peer = _tensors(2, 1024, 6), np.zeros((2, 1024), np.uint8)
    bases = np.array([src[0].ctypes.data, src[1].ctypes.data], U64)
    peer_bases = np.array([peer[0].ctypes.data, peer[1].ctypes.data], U64)
    offs, lens = np.array([512, 0], U64), np.array([100, 50], U64)
    push = Plan(bases, peer_bases, offs, offs, lens, "cuda:0", "cpu")
    with host_side(push, local_is_src=True) as host_plan:
        assert host_plan.on_host and host_plan.dst_bases is peer_bases
        assert int(host_plan.src_bases[1] - host_plan.src_bases[0]) == 150  # tensors packed back to back
        LocalTransport.copy(host_plan)  # what a socket send would read
    np.testing.assert_array_equal(peer[:, 512:612], src[:, 512:612])
    np.testing.assert_array_equal(peer[:, 0:50], src[:, 0:50])

    back = np.zeros((2, 1024), np.uint8)
    back_bases = np.array([back[0].ctypes.data, back[1].ctypes.data], U64)
    pull = Plan(peer_bases, back_bases, offs, offs, lens, "cpu", "cuda:0")
    with pytest.raises(RuntimeError):
        with host_side(pull, local_is_src=False) as host_plan:
            LocalTransport.copy(host_plan)
            raise RuntimeError("the receive failed")
    assert not back.any()  # nothing scattered after a failed receive
    with host_side(pull, local_is_src=False) as host_plan:
        assert host_plan.on_host and host_plan.src_bases is peer_bases
        LocalTransport.copy(host_plan)
        assert not back.any()  # scattered only when the block ends
    np.testing.assert_array_equal(back[:, 512:612], src[:, 512:612])


def test_a_peer_region_is_bounded_by_what_the_driver_mapped_not_by_its_announcement(fake_gpu) -> None:
    """A same-host peer announces its IPC allocation's size; a larger announcement than the
    allocation the driver opened must not let a copy reach past the mapping."""
    fake_gpu.mapped_size = 1 << 16
    region = cuda.PeerDeviceRegion.open(cuda.IpcRegion(b"\x04" * 64, 0x7000_0000, 1 << 30))
    assert region.size == 1 << 16
    assert region.translate(0x7000_0000, 1 << 16) == region.local_base
    assert region.translate(0x7000_0000, (1 << 16) + 1) is None
    assert region.translate(0x7000_0000 + (1 << 20), 8) is None
    small = cuda.PeerDeviceRegion.open(cuda.IpcRegion(b"\x05" * 64, 0x7100_0000, 4096))
    assert small.size == 4096  # an announcement below the mapping stands


def test_shm_prefers_the_regions_a_lookup_names_over_older_mappings(fake_gpu) -> None:
    from datadist.engine.transports.base import RemoteCache
    from datadist.engine.transports.shm import ShmTransport

    pool = cuda.IpcRegion(b"\x01" * 64, 0x7000_0000, 1 << 20)
    old = cuda.IpcRegion(b"\x02" * 64, 0x9000_0000, 1 << 20)
    shm = ShmTransport(pid=1, arenas=[], cma_ok=False, fallback=None, device_pool=[pool], cuda_here=True)
    try:
        remote = lambda addr, regions: RemoteCache(cache_id=5, row=0, num_tensors=1, tensor_size=4096,  # noqa: E731
                                                   batch_size=1, is_blocks=True, dtype="DT_UINT8",
                                                   addrs=np.array([addr], U64), epoch=1, device="cuda:0",
                                                   ipc=tuple(regions))
        delta, on_device = shm._delta(remote(0x7000_1000, []))
        assert on_device and 0x7000_1000 + delta == 0x5100_0000 + 0x1000  # the pool, opened at link time
        first, _ = shm._delta(remote(0x9000_0000, [old]))
        assert 0x9000_0000 + first == 0x5200_0000
        renewed = cuda.IpcRegion(b"\x03" * 64, 0x9000_0000, 1 << 20)  # freed and allocated again
        second, _ = shm._delta(remote(0x9000_0000, [renewed]))
        assert 0x9000_0000 + second == 0x5300_0000
        assert fake_gpu.opened == [pool.handle, old.handle, renewed.handle]
        assert shm._delta(remote(0x1234_0000, [])) == (None, False)
    finally:
        shm._device = {}  # stand-in mappings: nothing to close
        shm.close()
