"""Start a node's pool daemon on demand (the ``auto`` server address).

The daemon is started detached (double fork, new session), shared by every later process
on the node, and exits after an idle period.  Two processes racing to start one is fine:
the directory lock lets one win, and the loser reports RUNNING.
"""
from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time
from typing import Optional

from .._errors import PoolUnreachable

__all__ = ["start_daemon", "auto_capacity", "read_ready"]

log = logging.getLogger("ems")

#: Environment knobs of an auto-started daemon.
ENV_CAPACITY = "EMS_AUTO_CAPACITY"
ENV_IDLE_EXIT = "EMS_AUTO_IDLE_EXIT"
ENV_DISK_DIR = "EMS_AUTO_DISK_DIR"


def auto_capacity() -> str:
    """Env ``EMS_AUTO_CAPACITY``, else a quarter of RAM capped at 4 GiB."""
    if os.environ.get(ENV_CAPACITY):
        return os.environ[ENV_CAPACITY]
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 4 << 30
    return str(max(64 << 20, min(4 << 30, ram // 4)))


def read_ready(fd: int, deadline: float) -> Optional[str]:
    """The line a starting daemon writes to its ``--ready-fd`` (``READY <pid> <tcp>`` once it
    serves, ``RUNNING ...`` when another daemon holds the directory, or an error), read from
    ``fd`` up to its newline or EOF; None if ``deadline`` passes first.  ``fd`` stays open."""
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 256)
        if not chunk:
            break
        line += chunk
    return line.decode(errors="replace").strip()


def start_daemon(directory: str, deadline: float) -> None:
    """Start ``ems-server`` for ``directory`` and wait until it serves (or another does)."""
    os.makedirs(directory, exist_ok=True)
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "ems.server", "serve", "--dir", directory,
           "--capacity", auto_capacity(), "--idle-exit", os.environ.get(ENV_IDLE_EXIT, "600"),
           "--detach", "--ready-fd", str(w)]
    if os.environ.get(ENV_DISK_DIR):
        cmd += ["--disk-dir", os.environ[ENV_DISK_DIR]]
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.Popen(cmd, pass_fds=(w,), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    except OSError as exc:
        os.close(r)
        os.close(w)
        raise PoolUnreachable(f"cannot start ems-server for {directory}: {exc}") from None
    os.close(w)
    try:
        text = read_ready(r, deadline)
    finally:
        os.close(r)
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))  # the middle process exits at once
        except subprocess.TimeoutExpired:
            pass
    if text is None:
        raise PoolUnreachable(f"ems-server for {directory} did not start in time")
    if not (text.startswith("READY") or text.startswith("RUNNING")):
        raise PoolUnreachable(f"ems-server for {directory} failed to start: {text or 'no output'} "
                              f"(see {os.path.join(directory, 'ems-server.log')})")
    log.info("ems-server for %s: %s", directory, "started" if text.startswith("READY") else "already running")
