"""``ems-server``: the node-local context-caching pool daemon, and its command line
(``ems-server serve | stats | stop``, see :mod:`.cli`).

Files: ``cli.py`` (the command line and its ``--config`` file), ``daemon.py`` (listener,
sessions), ``dispatch.py`` (few threads for many connections), ``store.py`` (index,
leases, LRU, two-phase puts; memfd arenas and their allocator come from
``datadist.engine.memory``), ``tenants.py`` (credentials), ``tiers/`` (disk, Redis/Valkey).
"""
from __future__ import annotations

from .cli import EXIT_ALREADY_RUNNING as EXIT_ALREADY_RUNNING  # the exit status of a second daemon
from .cli import main
from .daemon import DEFAULT_DIR, AlreadyRunning, Daemon, ServerConfig

__all__ = ["main", "Daemon", "ServerConfig", "AlreadyRunning", "DEFAULT_DIR"]
