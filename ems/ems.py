"""``Ems``: process-wide initialisation, the ContextCaching handle and health checks."""
from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook first: ours must run before it)
import copy
import logging
import threading
from typing import Optional

from ._errors import PoolUnreachable, invalid, to_ems
from .client.pool import PoolClient
from .config import EmsConfig
from .context_caching import ContextCaching
from .keys import Namespace
from .profiling import Profiler

__all__ = ["Ems"]

log = logging.getLogger("ems")


class Ems:
    """The EMS client of this process (all methods are static, as in the vendor SDK)."""

    _lock = threading.Lock()
    _config: Optional[EmsConfig] = None
    _pool: Optional[PoolClient] = None
    _cc: Optional[ContextCaching] = None

    @staticmethod
    def init(config: EmsConfig) -> None:
        """Connect to the pool (starting a node daemon for the ``auto`` address).

        Once per process: again with an equal config is a no-op, with another one
        ``EMS_INVALID_ARGUMENT``.
        Raises:
            EmsException: EMS_INVALID_ARGUMENT (bad config, rejected credentials),
                EMS_IO_ERROR (no pool answers at the address, which the message names).
        """
        try:
            if not isinstance(config, EmsConfig):
                raise invalid("config", f"must be an EmsConfig, got {type(config).__name__}")
            config = copy.deepcopy(config.validate())  # fields may have been set since construction
            cc_cfg = config.cc()
            if cc_cfg is None:
                raise invalid("cc_config", "EmsConfig needs cc_config or cc_config_v1")
            with Ems._lock:
                if Ems._config is not None:
                    if Ems._config == config:
                        return
                    raise invalid("config", "Ems is already initialized with another config")
                pool = PoolClient(config.server_address(), config.access_id or None, config.access_key,
                                  config.connect_timeout, max_idle=config.max_inflight + 4,
                                  secret=config.pool_secret(), tls=config.pool_tls())
                try:
                    pool.open()
                except PoolUnreachable as exc:
                    raise PoolUnreachable(f"EMS init failed: {exc}") from None
                except BaseException:
                    pool.close()
                    raise
                layout = cc_cfg.layout()
                Ems._cc = ContextCaching(pool, Namespace(config.access_id, layout), layout.kvcache_type,
                                         config.verify_reads, config.max_inflight, Profiler())
                Ems._pool = pool
                Ems._config = config
        except Exception as exc:
            err = to_ems(exc)
            text = err.message()  # the SDK's line, for its log scrapers
            log.error("%s", text if text.startswith("EMS init failed") else f"EMS init failed: {text}")
            raise err from None

    @staticmethod
    def get_cc() -> Optional[ContextCaching]:
        """The ContextCaching object, or None before a successful :meth:`init`."""
        return Ems._cc

    @staticmethod
    def check_health() -> bool:
        """Whether the pool answers (never raises)."""
        pool, config = Ems._pool, Ems._config
        if pool is None or config is None:
            return False
        return pool.ping(min(config.connect_timeout / 1000.0, 2.0))

    @staticmethod
    def _shutdown() -> None:
        """Release connections, threads and the arena mapping; ``init`` may be called again.

        Not part of the vendor API: used at process exit and by tests.
        """
        with Ems._lock:
            cc, pool = Ems._cc, Ems._pool
            Ems._cc = Ems._pool = Ems._config = None
        stopped = True
        if cc is not None:
            stopped = cc._close()
            cc._profiler.close()
        if pool is not None:
            pool.close(unmap=stopped)  # a call still running may copy through the arena


atexit.register(Ems._shutdown)
# Interpreter exit joins the async calls' threads (concurrent.futures' own hook, run after
# ours) before atexit handlers run: shutting down here first bounds that join.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(Ems._shutdown)
