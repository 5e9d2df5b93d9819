"""What ``ems-server serve`` is asked for: :class:`ServerConfig`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["ServerConfig", "DEFAULT_DIR"]

DEFAULT_DIR = "/dev/shm/ems"


@dataclass
class ServerConfig:
    """What ``ems-server serve`` was asked for (parsed from the command line in one place)."""

    directory: str = DEFAULT_DIR
    capacity: int = 1 << 30
    disk_dir: Optional[str] = None
    disk_capacity: int = 10 << 30
    remote: Optional[str] = None
    credentials: Optional[str] = None
    tcp: Optional[str] = None
    idle_exit: float = 0.0
    spill_on_exit: bool = True
    #: Permissions of the unix socket: who may connect at all.  Owner only by default, so
    #: an open-tenancy pool is not readable by every user of the node; a shared node pool
    #: opens it to a group (0o660) or to all (0o666), with credentials.
    socket_mode: int = 0o600
    #: Open client connections at most; more are refused with a clear error.  Each client
    #: process opens a few (its pool of connections), so this admits hundreds of processes.
    max_connections: int = 1024
    #: Seconds a connection may stay idle before the daemon closes it (0: never).
    idle_timeout: float = 600.0
    #: Seconds within which a request, once started, must arrive whole.
    read_timeout: float = 30.0
    #: Worker threads serving requests (idle connections need none).
    workers: int = 16
    #: Seconds a stopping daemon lets requests in flight finish before it cuts them.
    drain_timeout: float = 10.0
    #: Seconds after which a reservation not yet committed is taken back when memory is short.
    reserve_timeout: float = 120.0
    #: File holding the pool secret: clients must prove they hold it (and the daemon that
    #: it does) before anything else, credentials included (None: no secret).
    secret_file: Optional[str] = None
    #: TLS on the TCP port: certificate, key and CA files (all or none; none given: the
    #: ``EMS_TLS_*_FILE`` environment variables, all or none).
    tls_files: Tuple[Optional[str], Optional[str], Optional[str]] = (None, None, None)
    #: Where Prometheus scrapes ``/metrics`` and ``/healthz``: "[HOST:]PORT" (None: nowhere).
    metrics: Optional[str] = None
