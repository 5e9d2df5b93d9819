"""Fixtures of the real-process harness (see harness.py), for every module in this folder."""
from harness import pair, pair_holder, peer_factory

__all__ = ["pair", "pair_holder", "peer_factory"]
