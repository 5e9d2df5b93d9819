"""Executors for :class:`~datadist.engine.layout.Plan`: the C helper, loaded with ctypes.

ctypes drops the GIL for the duration of each call, so a copy on one thread does not stall
the agent thread, and a deadline-bound socket transfer can run while other links work.
Errors come back as ``OSError`` with the errno the kernel gave; callers turn them into the
contract's exceptions (they know which peer and which call it was).
"""
from __future__ import annotations

import ctypes
import errno
import importlib.machinery
import os
from pathlib import Path

import numpy as np

from .layout import Plan

__all__ = ["copy_plan", "cma_plan", "sock_send", "sock_recv", "COPY_THREADS"]

#: Threads a large local copy may use (the C side only splits plans of >= 8 MiB).
COPY_THREADS = max(1, min(4, int(os.environ.get("DATADIST_COPY_THREADS", os.cpu_count() or 1))))

_P = ctypes.c_void_p
_N = ctypes.c_size_t


def _load() -> ctypes.CDLL:
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_native{suffix}"
        if path.exists():
            lib = ctypes.CDLL(str(path))
            break
    else:
        raise ImportError(
            f"datadist's C helper (_native) is not built in {here}; install the package with "
            "`pip install -e .` (or `pip install .`), which compiles it"
        )
    lib.dd_copy_plan.argtypes = [_N, _P, _P, _N, _P, _P, _P, ctypes.c_int]
    lib.dd_copy_plan.restype = ctypes.c_int64
    lib.dd_cma_plan.argtypes = [ctypes.c_int, ctypes.c_int, _N, _P, _P, _N, _P, _P, _P]
    lib.dd_cma_plan.restype = ctypes.c_int64
    lib.dd_sock_plan.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, _N, _P, _N, _P, _P]
    lib.dd_sock_plan.restype = ctypes.c_int64
    return lib


_lib = _load()


def _ptr(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def _check(result: int, what: str) -> int:
    if result < 0:
        code = -result
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def copy_plan(plan: Plan, threads: int = COPY_THREADS) -> int:
    """Copy every run of ``plan`` inside this process; returns the bytes copied."""
    if plan.lens.shape[0] == 0:
        return 0
    return _lib.dd_copy_plan(
        plan.src_bases.shape[0], _ptr(plan.src_bases), _ptr(plan.dst_bases),
        plan.lens.shape[0], _ptr(plan.src_offs), _ptr(plan.dst_offs), _ptr(plan.lens), threads,
    )


def cma_plan(pid: int, plan: Plan, *, write: bool) -> int:
    """One-sided copy with another process by cross-memory attach.

    ``write=True``: plan sources are in this process, destinations in ``pid``.
    ``write=False``: sources are in ``pid``, destinations here.  Raises ``OSError``
    (ESRCH when the peer is gone, EFAULT for an address outside its mappings).
    """
    if plan.lens.shape[0] == 0:
        return 0
    if write:
        lb, rb, lo, ro = plan.src_bases, plan.dst_bases, plan.src_offs, plan.dst_offs
    else:
        lb, rb, lo, ro = plan.dst_bases, plan.src_bases, plan.dst_offs, plan.src_offs
    got = _lib.dd_cma_plan(pid, int(write), lb.shape[0], _ptr(lb), _ptr(rb),
                           plan.lens.shape[0], _ptr(lo), _ptr(ro), _ptr(plan.lens))
    return _check(got, f"cross-memory {'write to' if write else 'read from'} pid {pid}")


def _sock(fd: int, send: bool, timeout_ms: int, bases: np.ndarray, offs: np.ndarray,
          lens: np.ndarray) -> int:
    if lens.shape[0] == 0:
        return 0
    got = _lib.dd_sock_plan(fd, int(send), int(timeout_ms), bases.shape[0], _ptr(bases),
                            lens.shape[0], _ptr(offs), _ptr(lens))
    if got == -errno.ETIMEDOUT:
        raise TimeoutError(errno.ETIMEDOUT, f"socket transfer did not finish in {timeout_ms} ms")
    return _check(got, "socket send" if send else "socket receive")


def sock_send(fd: int, plan: Plan, timeout_ms: int) -> int:
    """Write the plan's source runs, in order, to a non-blocking socket ``fd``."""
    return _sock(fd, True, timeout_ms, plan.src_bases, plan.src_offs, plan.lens)


def sock_recv(fd: int, plan: Plan, timeout_ms: int) -> int:
    """Read the plan's destination runs, in order, from a non-blocking socket ``fd``.
    Raises ``ConnectionResetError`` if the stream ends first, ``TimeoutError`` at the deadline."""
    return _sock(fd, False, timeout_ms, plan.dst_bases, plan.dst_offs, plan.lens)
