"""Loopback ports for test servers.

A port the kernel picks for a bind to port 0 comes from the ephemeral range, the one it
also gives every outgoing connection: between the moment a test learns such a port and
the moment its server binds it, any connection another test opens may take it ("Address
already in use").  Ports here are drawn at random below that range, where only another
test's draw could collide, and checked bindable when drawn.
"""
from __future__ import annotations

import random
import socket
from typing import List

__all__ = ["free_port", "free_ports"]

_LOWEST = 10000


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_FLOOR = _ephemeral_floor()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(bus_offset: int = 0) -> int:
    """A loopback port nobody listens on now, outside the ephemeral range; with
    ``bus_offset``, one whose ``port + bus_offset`` is free too (a Redis Cluster node also
    listens on its port + 10000)."""
    top = min(_FLOOR, 65536 - bus_offset) - 1
    for _ in range(200):
        port = random.randint(_LOWEST, top) if top > _LOWEST + 1000 else _kernel_port()
        if _bindable(port) and (not bus_offset or _bindable(port + bus_offset)):
            return port
    raise AssertionError("no free loopback port")


def free_ports(n: int) -> List[int]:
    """``n`` distinct free loopback ports (:func:`free_port`)."""
    ports: List[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
