"""Whether a process is the one at the other end of a local TCP connection.

A same-host peer says which process it is (pid, the descriptor and address of its epoch
page, the nonce in that page), and this engine then maps that process's memory and copies
into and out of it one-sidedly at the addresses the peer names.  Everything a peer says
can be copied from what another process said: a hostile peer that repeats this engine's
own HELLO (or another local process's) would have it copy between its own memory, or
that process's, as the peer directs.  What a peer cannot copy is the connection itself:
the socket at the other end of this engine's connection is in the file table of the
process that holds it, and the kernel says which socket that is.

So before trusting a same-host identity, the engine finds the peer's end of the
connection in the claimed process's view of TCP (``/proc/PID/net/tcp`` and ``tcp6``:
the socket whose local address is this connection's remote one and whose remote address
is this connection's local one) and checks that the claimed process holds that socket
(``/proc/PID/fd``).  Reading another process's ``/proc/PID/fd`` needs the same access as
the cross-memory attach that would follow, so nothing is refused here that could have
worked.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
from typing import List, Optional, Tuple

__all__ = ["holds_other_end", "process_alive"]


def _proc_forms(addr: Tuple[str, int]) -> List[Tuple[str, str]]:
    """``(table, address)`` as ``/proc/net/tcp{,6}`` may write ``addr``: hex, each 32-bit
    word in host order, then the port; an IPv4 address also as IPv4-mapped IPv6 (a
    dual-stack socket's view of it)."""
    ip = ipaddress.ip_address(addr[0].split("%")[0])
    v4 = ip if isinstance(ip, ipaddress.IPv4Address) else ip.ipv4_mapped
    packed = [("tcp6", ip.packed)] if v4 is None else [("tcp", v4.packed), ("tcp6", b"\0" * 10 + b"\xff\xff" + v4.packed)]
    return [(table, "".join(f"{int.from_bytes(raw[i:i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4))
             + f":{int(addr[1]):04X}") for table, raw in packed]


def _inode_of_other_end(pid: int, sock: socket.socket) -> Optional[str]:
    """The inode of the socket, in ``pid``'s network namespace, whose local address is
    ``sock``'s remote one and whose remote address is ``sock``'s local one."""
    try:
        mine, theirs = _proc_forms(sock.getsockname()[:2]), _proc_forms(sock.getpeername()[:2])
    except (OSError, ValueError):
        return None
    for (table, local), (_, remote) in zip(theirs, mine):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[1] == local and fields[2] == remote and fields[9] != "0":
                        return fields[9]
        except OSError:
            continue
    return None


def holds_other_end(pid: int, sock: socket.socket) -> bool:
    """Whether process ``pid`` holds the socket at the other end of the local TCP
    connection ``sock`` (False where that cannot be read: another user's process, another
    pid namespace, a connection that is not local)."""
    inode = _inode_of_other_end(pid, sock)
    if inode is None:
        return False
    want = f"socket:[{inode}]"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                return True
        except OSError:
            continue
    return False


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
