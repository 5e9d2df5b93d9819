"""A fake HCCL process group: ``torch_npu._C._distributed_c10d.ProcessGroupHCCL``.

Mirrors the binding of ``torch_npu/csrc/distributed/Init.cpp``: the constructor
``ProcessGroupHCCL(store, rank, size, timeout)`` and the methods datadist calls, ``send``,
``recv`` (lists of NPU tensors, a peer rank and a tag; each returns a work item with
``is_completed`` and ``wait``) and ``abort_hccl_comm(reason)`` (``abortAndClearHcclComm``:
pending and later operations fail).

Underneath, bytes go between processes through the group's store (the store is what both
ends share; a real HCCL link is RDMA between devices): a send copies its tensor off the
device in stream order when it is posted (a blocking device copy on the caller's current
stream, as HCCL's stream waits for the current one), a receive copies into its tensor on
the device.  Operations run in order on one thread per group.

As HCCL does, the communicator forms on the first operation, which waits for the peer's
and takes ``FAKE_HCCL_INIT_DELAY_S`` seconds (default 2) more.  ``FAKE_HCCL_NEVER_POST``
makes this process's operations never post (never complete, never move a byte), for tests
of deadlines and aborts on the other end: ``1`` always, or a file's path: while that file
exists and is empty or holds this process's pid.
"""
from __future__ import annotations

import atexit
import collections
import datetime
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch

_PAUSE_MIN, _PAUSE_MAX = 50e-6, 2e-3
_EXIT_JOIN_S = 5.0

_GROUPS: "weakref.WeakSet[ProcessGroupHCCL]" = weakref.WeakSet()


class HcclError(RuntimeError):
    pass


def _never_post() -> bool:
    """Whether this process's operations are switched to never post (module docstring)."""
    switch = os.environ.get("FAKE_HCCL_NEVER_POST", "")
    if switch in ("", "0", "1"):
        return switch == "1"
    try:
        with open(switch) as f:
            pids = f.read().split()
    except FileNotFoundError:
        return False
    return not pids or str(os.getpid()) in pids


class Work:
    """One operation's progress (``c10d::Work``): ``is_completed``, ``wait``."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def _finish(self, error: Optional[BaseException] = None) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        seconds = None if not timeout else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise HcclError(f"fake hccl: operation timed out after {seconds} s")
        if self._error is not None:
            raise self._error
        return True


class ProcessGroupHCCL:
    """A two-or-more member group over ``store`` (see the module docstring)."""

    def __init__(self, store: Any, rank: int, size: int,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> None:
        self.store, self._rank, self._size = store, int(rank), int(size)
        self.timeout_s = timeout.total_seconds()
        self.init_delay_s = float(os.environ.get("FAKE_HCCL_INIT_DELAY_S", "2"))
        self.formed_at: Optional[float] = None  # monotonic time the communicator formed
        self._aborted: Optional[str] = None
        self._seq: collections.Counter = collections.Counter()
        self._ops: "queue.Queue[Optional[tuple[Work, Callable[[], None]]]]" = queue.Queue()
        self._pending: list[Work] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"fake-hccl-{rank}", daemon=True)
        self._thread.start()
        _GROUPS.add(self)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # -- operations ----------------------------------------------------------------------
    def send(self, tensors: list, dst_rank: int, tag: int = 0) -> Work:
        (tensor,) = tensors
        self._check(tensor)
        if _never_post():
            return Work()
        payload = tensor.detach().contiguous().cpu()  # in stream order, when posted
        key = self._key(self._rank, int(dst_rank), int(tag))
        return self._post(lambda: self.store.set(key, payload.view(torch.uint8).reshape(-1).numpy().tobytes()))

    def recv(self, tensors: list, src_rank: int, tag: int = 0) -> Work:
        (tensor,) = tensors
        self._check(tensor)
        if _never_post():
            return Work()
        key = self._key(int(src_rank), self._rank, int(tag))

        def receive() -> None:
            self._wait_key(key)
            data = self.store.get(key)
            self.store.delete_key(key)
            nbytes = tensor.numel() * tensor.element_size()
            if len(data) != nbytes:
                raise HcclError(f"fake hccl: received {len(data)} bytes for a {nbytes}-byte tensor")
            host = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(tensor.dtype).reshape(tensor.shape)
            tensor.copy_(host)

        return self._post(receive)

    def abort_hccl_comm(self, reason: Optional[str] = None) -> None:
        """``abortAndClearHcclComm``: fail pending and later operations."""
        with self._lock:
            self._aborted = reason or "aborted"
            pending, self._pending = self._pending, []
        for work in pending:
            work._finish(HcclError(f"fake hccl: communicator aborted ({self._aborted})"))
        self._ops.put(None)

    # -- internals -----------------------------------------------------------------------
    @staticmethod
    def _check(tensor: torch.Tensor) -> None:
        if tensor.device.type != "npu":
            raise HcclError(f"fake hccl: tensors must be on an NPU, got {tensor.device}")

    def _key(self, src: int, dst: int, tag: int) -> str:
        with self._lock:
            n = self._seq[(src, dst, tag)]
            self._seq[(src, dst, tag)] += 1
        return f"fake-hccl/{src}-{dst}/{tag}/{n}"

    def _post(self, op: Callable[[], None]) -> Work:
        work = Work()
        with self._lock:
            if self._aborted is not None:
                work._finish(HcclError(f"fake hccl: communicator aborted ({self._aborted})"))
                return work
            self._pending.append(work)
        self._ops.put((work, op))
        return work

    def _wait_key(self, key: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause = _PAUSE_MIN
        while not self.store.check([key]):
            if self._aborted is not None:
                raise HcclError(f"fake hccl: communicator aborted ({self._aborted})")
            if time.monotonic() > deadline:
                raise HcclError(f"fake hccl: peer did not answer within {self.timeout_s} s")
            time.sleep(pause)
            pause = min(2 * pause, _PAUSE_MAX)

    def _form(self) -> None:
        """The communicator: every member announces itself and waits for the others."""
        self.store.set(f"fake-hccl/ready/{self._rank}", "1")
        for r in range(self._size):
            self._wait_key(f"fake-hccl/ready/{r}")
        time.sleep(self.init_delay_s)
        self.formed_at = time.monotonic()

    def _run(self) -> None:
        while True:
            item = self._ops.get()
            if item is None:
                return
            work, op = item
            if self._aborted is not None:
                continue  # finished with the abort's error already
            try:
                if self.formed_at is None:
                    self._form()
                op()
                error: Optional[BaseException] = None
            except Exception as exc:  # reported through the work item, as HCCL's watchdog does
                error = exc if isinstance(exc, HcclError) else HcclError(f"fake hccl: {exc}")
            with self._lock:
                if work in self._pending:
                    self._pending.remove(work)
            work._finish(error)


@atexit.register
def _stop_at_exit() -> None:
    """Abort every live group and join its thread before the interpreter finalizes: a
    daemon thread still inside a store call (C++) while finalization tears the store down
    ends the process in ``std::terminate``."""
    groups = list(_GROUPS)
    for group in groups:
        group.abort_hccl_comm("process exit")
    for group in groups:
        group._thread.join(_EXIT_JOIN_S)
