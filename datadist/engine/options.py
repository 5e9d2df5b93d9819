"""What an :class:`~datadist.engine.core.Engine` reads from its configuration.

The API layer parses and validates the user's options (``datadist._config.EngineOptions``);
the engine sees them only through this protocol, so it depends on no type of the layer
above it.
"""
from __future__ import annotations

from typing import Optional, Protocol

from .auth import Secret
from .tls import TlsConfig

__all__ = ["PoolSettings", "EngineSettings"]


class PoolSettings(Protocol):
    """A memory pool: its bytes, and allocations are rounded up to ``2**page_shift`` bytes."""

    @property
    def memory_size(self) -> int: ...

    @property
    def page_shift(self) -> int: ...


class EngineSettings(Protocol):
    """The validated settings of one engine (see ``datadist._config.EngineOptions`` for
    each field's meaning and domain)."""

    @property
    def device_id(self) -> int: ...

    @property
    def device_type(self) -> str: ...

    @property
    def sync_kv_timeout_ms(self) -> int: ...

    @property
    def transfer_backend(self) -> str: ...

    @property
    def listen_ip(self) -> Optional[str]: ...

    @property
    def listen_address(self) -> Optional[tuple[str, int]]: ...

    @property
    def mem_pool(self) -> Optional[PoolSettings]: ...

    @property
    def host_mem_pool(self) -> Optional[PoolSettings]: ...

    @property
    def link_total_time_s(self) -> float: ...

    @property
    def link_retry_count(self) -> int: ...

    @property
    def link_secret(self) -> Optional[Secret]: ...

    @property
    def tls(self) -> Optional[TlsConfig]: ...

    @property
    def metrics_address(self) -> Optional[tuple[str, int]]: ...

    @property
    def transfer_checksum(self) -> bool: ...
