"""The ``kv_transfer_params`` of a decode request, checked before the scheduler uses them.

They come from a client or a proxy, so nothing in them is trusted: :func:`parse_remote`
either returns them normalized (:class:`RemoteParams`) or raises ``ValueError`` saying
what is wrong, and the scheduler half then computes the prompt locally.  An exception in
vLLM's scheduler would end the engine (every request), a peer silently dropped would
leave blocks unwritten, so every list is checked whole: block and cluster ids are lists
of integers >= 0 (never booleans), ports are integers 0..65535, and the per-rank host,
port and cluster lists have one entry per prefill rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .worker import Endpoint

__all__ = ["REMOTE_KEYS", "RemoteParams", "parse_remote", "lease_of"]

#: kv_transfer_params keys a decode request must carry for a remote prefill.
REMOTE_KEYS = ("remote_block_ids", "remote_request_id", "remote_host", "remote_port", "remote_cluster_ids")

_MAX_ID = (1 << 64) - 1    # block and cluster ids: unsigned 64-bit on the wire
_MAX_PORT = 65535


@dataclass(frozen=True)
class RemoteParams:
    """A decode request's remote prefill, as :func:`parse_remote` checked it."""

    block_ids: list[int]     # the prefill instance's blocks of the prompt, in order
    request_id: str          # the prefill instance's request id (what its notices name)
    peers: list[Endpoint]    # one per prefill tensor-parallel rank
    lease_s: float           # the prefill side's lease on the blocks (0: none, not renewed)
    block_size: Any          # ``remote_block_size`` as given (the scheduler judges it)


def _int_list(params: Mapping[str, Any], key: str, high: int) -> list[int]:
    value = params.get(key)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} must be a list of integers, not {type(value).__name__}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= high:
            raise ValueError(f"{key} must hold integers 0..{high}; it holds {item!r}")
    return list(value)


def _port(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_PORT:
        raise ValueError(f"{key} must be an integer 0..{_MAX_PORT}, not {value!r}")
    return value


def _host(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, not {value!r}")
    return value


def _per_rank(params: Mapping[str, Any], key: str, single: str, count: int) -> list[Any]:
    """``params[key]`` (one entry per prefill rank) or ``params[single]`` for every rank."""
    values = params.get(key)
    if not values:
        return [params.get(single)] * count
    if not isinstance(values, (list, tuple)) or len(values) != count:
        raise ValueError(f"{key} must be a list of one entry per remote_cluster_ids entry ({count}), "
                         f"not {values!r}")
    return list(values)


def lease_of(params: Mapping[str, Any]) -> float:
    """The prefill side's lease from ``kv_transfer_params`` (0: none, nothing to renew);
    it came through the proxy, so it is bounded before the renewal thread paces on it."""
    try:
        lease = float(params.get("kv_lease_duration") or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return min(lease, 3600.0) if lease >= 0.1 else 0.0


def parse_remote(params: Optional[Mapping[str, Any]]) -> RemoteParams:
    """``params``'s remote prefill, checked; ``ValueError`` saying what is wrong with them."""
    if not isinstance(params, Mapping):
        raise ValueError(f"kv_transfer_params must be an object, not {type(params).__name__}")
    missing = [k for k in REMOTE_KEYS if params.get(k) is None]
    if missing:
        raise ValueError(f"kv_transfer_params lack {missing}")
    blocks = _int_list(params, "remote_block_ids", _MAX_ID)
    clusters = _int_list(params, "remote_cluster_ids", _MAX_ID)
    if not clusters:
        raise ValueError("remote_cluster_ids is empty: no prefill rank to pull from")
    hosts = [_host(h, "remote_host(s)") for h in _per_rank(params, "remote_hosts", "remote_host", len(clusters))]
    ports = [_port(p, "remote_port(s)") for p in _per_rank(params, "remote_ports", "remote_port", len(clusters))]
    request_id = params["remote_request_id"]
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"remote_request_id must be a non-empty string, not {request_id!r}")
    return RemoteParams(block_ids=blocks, request_id=request_id,
                        peers=[Endpoint(h, p, c) for h, p, c in zip(hosts, ports, clusters)],
                        lease_s=lease_of(params), block_size=params.get("remote_block_size"))
