"""Tiers below the memory arena: disk, then remote (Redis / Valkey).

A tier is chosen by URL scheme and imported only when chosen (the redis package is an
optional dependency)::

    make_tier("disk:///var/cache/ems?capacity=10G")
    make_tier("redis://127.0.0.1:6379/0")
    make_tier("redis+cluster://127.0.0.1:7000")
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Tuple

from .base import Sink, Tier, tier_key

__all__ = ["Tier", "Sink", "make_tier", "register_tier", "tier_key"]

_REGISTRY: Dict[str, Tuple[str, str]] = {}


def register_tier(scheme: str, module: str, cls: str) -> None:
    """Name a tier class for a URL scheme (lazy: imported by :func:`make_tier`)."""
    if scheme in _REGISTRY:
        raise ValueError(f"tier scheme {scheme!r} is already registered")
    _REGISTRY[scheme] = (module, cls)


register_tier("disk", "ems.server.tiers.disk", "DiskTier")
register_tier("redis", "ems.server.tiers.remote", "RedisTier")
register_tier("rediss", "ems.server.tiers.remote", "RedisTier")
register_tier("valkey", "ems.server.tiers.remote", "RedisTier")
register_tier("redis+cluster", "ems.server.tiers.remote", "RedisTier")
register_tier("valkey+cluster", "ems.server.tiers.remote", "RedisTier")


def make_tier(url: str) -> Tier:
    """The tier for ``url``; raises ``ValueError`` for an unknown scheme."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in _REGISTRY:
        raise ValueError(f"unknown tier URL {url!r} (schemes: {', '.join(sorted(_REGISTRY))})")
    module, cls = _REGISTRY[scheme]
    factory: Callable[[str], Tier] = getattr(importlib.import_module(module), cls).from_url
    return factory(url)
