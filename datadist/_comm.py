"""Comm domains: ``LLMDataDist.link(comm_name, cluster_rank_info, rank_table)``.

Every member calls ``link`` with the same arguments.  The rank table (HCCL's JSON layout:
``server_list[].server_id`` or ``host_ip`` and ``device[].rank_id``) gives each rank a host;
the port is ``device[].port``, else the table's top-level ``port`` (default 16666, HCCL's
base) plus the device's ``device_id`` (plus the rank where a device has no numeric id).  Each member listens on its own address, connects to every member of a
lower rank and waits for those of a higher rank, all in the background; the pairwise links
are ordinary links (any transport), so transfers work exactly as after ``link_clusters``.
``query_register_mem_status`` reports ``PREPARING`` until every pairwise link is up,
``OK`` then, ``FAILED`` if the link deadline (``link_total_time``) passed first.
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Optional

from ._cluster import ip_to_str
from ._status import LLMStatusCode, ParamInvalidError, raise_error
from ._types import RegisterMemStatus
from .engine.errors import Fault

if TYPE_CHECKING:  # pragma: no cover
    from .engine.core import Engine

__all__ = ["CommDomain", "parse_comm_args", "MAX_COMM_NAME", "HCCL_BASE_PORT"]

log = logging.getLogger("datadist")

MAX_COMM_NAME = 127      # HCCL group names are at most 128 bytes with the terminator
HCCL_BASE_PORT = 16666
_RETRY_S = 0.05          # between connection attempts to a member not listening yet
_ids = itertools.count(1)


def parse_comm_args(comm_name: object, cluster_rank_info: object, rank_table: object, own_cluster: int
                    ) -> tuple[str, Dict[int, int], Dict[int, tuple[str, int]]]:
    """Validate ``link`` arguments the way CANN does; returns (name, {cluster: rank},
    {rank: (ip, port)}).  ``TypeError`` for wrong types, ``LLM_PARAM_INVALID`` otherwise."""
    if not isinstance(comm_name, str):
        raise TypeError(f"comm_name must be a str, got {type(comm_name).__name__}")
    if not 0 < len(comm_name) <= MAX_COMM_NAME:
        raise ParamInvalidError(f"comm_name {comm_name!r} must have 1 to {MAX_COMM_NAME} characters")
    if not isinstance(cluster_rank_info, dict):
        raise TypeError(f"cluster_rank_info must be a dict of cluster_id -> rank_id, "
                        f"got {type(cluster_rank_info).__name__}")
    for k, v in cluster_rank_info.items():
        if isinstance(k, bool) or isinstance(v, bool) or not isinstance(k, int) or not isinstance(v, int):
            raise TypeError(f"cluster_rank_info entries must be int -> int, got {k!r}: {v!r}")
    if not 2 <= len(cluster_rank_info) <= 4:
        raise ParamInvalidError(f"a comm domain has 2 to 4 members, cluster_rank_info has {len(cluster_rank_info)}")
    ranks = list(cluster_rank_info.values())
    if ranks != list(range(len(ranks))):
        raise ParamInvalidError(f"cluster_rank_info ranks must ascend from 0 by 1, got {ranks}")
    if own_cluster not in cluster_rank_info:
        raise ParamInvalidError(f"cluster_rank_info {cluster_rank_info} does not contain this engine's "
                                f"cluster {own_cluster}")
    if not isinstance(rank_table, str):
        raise TypeError(f"rank_table must be a JSON str, got {type(rank_table).__name__}")
    return comm_name, dict(cluster_rank_info), _rank_addresses(rank_table, len(ranks))


def _rank_addresses(rank_table: str, n: int) -> Dict[int, tuple[str, int]]:
    try:
        table = json.loads(rank_table)
        base = int(table.get("port", HCCL_BASE_PORT))
        out: Dict[int, tuple[str, int]] = {}
        for server in table["server_list"]:
            host = server.get("host_ip") or server["server_id"]
            for dev in server.get("device", []):
                rank = int(dev["rank_id"])
                # One process drives one device, so (host, device_id) names a process on every
                # domain it joins; a rank does not (serving adapters make every prefill rank 0
                # of its own pair domain), so ports derive from the device id where given.
                slot = int(dev["device_id"]) if str(dev.get("device_id", "")).isdigit() else rank
                out[rank] = (ip_to_str(host), int(dev.get("port", base + slot)))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ParamInvalidError(f"rank_table is not a valid rank table ({exc}): {rank_table[:200]!r}") from None
    missing = [r for r in range(n) if r not in out]
    if missing:
        raise ParamInvalidError(f"rank_table has no device for rank(s) {missing}")
    return out


@dataclass
class CommDomain:
    """One ``link`` call's domain; the linking runs on its own thread."""

    name: str
    members: Dict[int, int]
    addresses: Dict[int, tuple[str, int]]
    comm_id: int = field(default_factory=lambda: next(_ids))
    status: RegisterMemStatus = RegisterMemStatus.PREPARING
    error: str = ""
    listener: Optional[tuple[str, int]] = None
    thread: Optional[threading.Thread] = None
    cancel: threading.Event = field(default_factory=threading.Event)

    def start(self, engine: "Engine", deadline: float) -> None:
        me = self.members[engine.cluster_id]
        addr = self.addresses[me]
        agent = engine.live_agent()
        if addr not in agent.listeners:
            try:
                self.listener = agent.add_listener(addr)
            except OSError as exc:
                raise_error(LLMStatusCode.LLM_LINK_FAILED, f"comm {self.name}: cannot listen on {addr}: {exc}")
        self.thread = threading.Thread(target=self._run, args=(engine, me, deadline),
                                       name=f"datadist-comm-{self.comm_id}", daemon=True)
        self.thread.start()

    def _run(self, engine: "Engine", me: int, deadline: float) -> None:
        try:
            for cluster, rank in self.members.items():
                if rank < me:
                    self._connect(engine, cluster, self.addresses[rank], deadline)
            for cluster, rank in self.members.items():
                if rank > me and not engine.wait_link(cluster, deadline, self.cancel):
                    raise TimeoutError(f"cluster {cluster} (rank {rank}) did not link within the deadline")
        except Exception as exc:  # reported through query_register_mem_status
            self.error = str(exc)
            self.status = RegisterMemStatus.FAILED
            log.warning("comm %s (id %d) failed: %s", self.name, self.comm_id, exc)
            return
        self.status = RegisterMemStatus.OK

    def _connect(self, engine: "Engine", cluster: int, addr: tuple[str, int], deadline: float) -> None:
        while not self.cancel.is_set():
            code = engine.link(cluster, addr[0], addr[1], deadline)
            if code in (Fault.OK, Fault.ALREADY_LINKED):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"could not link to cluster {cluster} at {addr[0]}:{addr[1]}: {code.name}")
            self.cancel.wait(_RETRY_S)  # the member may not listen yet
        raise TimeoutError("comm domain unlinked while linking")

    def stop(self, engine: "Engine", deadline: float) -> None:
        """Unlink every member link of the domain and stop listening for it."""
        self.cancel.set()
        if self.thread is not None:
            self.thread.join(max(0.0, deadline - time.monotonic()))
        for cluster in self.members:
            if cluster != engine.cluster_id:
                engine.unlink(cluster, deadline, force=False)
        if self.listener is not None:
            engine.live_agent().remove_listener(self.listener)
