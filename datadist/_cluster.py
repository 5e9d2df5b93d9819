"""Cluster info of the public API (``LLMClusterInfo``, SPEC-datadist section 3) and the IP
address helpers the configuration shares."""
from __future__ import annotations

import ipaddress
import socket
from typing import List, NamedTuple, Optional, Union

from ._objects import _UINT16_MAX, _UINT32_MAX, _UINT64_MAX, _as_int, _int_in
from ._status import ParamInvalidError
from ._types import LLMRole

__all__ = ["LLMClusterInfo", "IpInfo", "ip_to_str", "ip_to_int"]


# ------------------------------------------------------------------------------- IPs


def ip_to_str(ip: Union[str, int]) -> str:
    """An IPv4 address as a dotted quad.

    ``ip`` is a dotted quad, or an int in CANN's form: the address bytes in network order
    read as a *little-endian* uint32 (``"1.2.3.4"`` <-> ``0x04030201``), as
    ``llm_datadist`` builds it with ``int.from_bytes(socket.inet_aton(ip), "little")``.
    ``TypeError`` for other types, :class:`ParamInvalidError` for a malformed address.
    """
    if isinstance(ip, str):
        try:
            return str(ipaddress.IPv4Address(ip.strip()))
        except ValueError:
            raise ParamInvalidError(
                f"ip {ip!r} is not an IPv4 address (expected a dotted quad like '10.0.0.1')") from None
    value = _int_in("ip", ip, 0, _UINT32_MAX)
    return socket.inet_ntoa(value.to_bytes(4, "little"))


def ip_to_int(ip: Union[str, int]) -> int:
    """CANN's int form of an IPv4 address (see :func:`ip_to_str`)."""
    return int.from_bytes(socket.inet_aton(ip_to_str(ip)), "little")


class IpInfo(NamedTuple):
    """One ``(ip, port)`` entry of :class:`LLMClusterInfo`, as ``llm_datadist`` stores it:
    ``ip`` in CANN's int form (the address bytes read as a little-endian uint32, see
    :func:`ip_to_str`); :attr:`ip_str` gives the dotted quad.  Equal to the plain tuple."""

    ip: int
    port: int

    @property
    def ip_str(self) -> str:
        """The address as a dotted quad."""
        return ip_to_str(self.ip)

    @property
    def ip_int(self) -> int:
        """Alias of :attr:`ip` (CANN's int form)."""
        return self.ip


# --------------------------------------------------------------------- cluster info


class LLMClusterInfo:
    """The peer of a ``link_clusters``/``unlink_clusters`` call: its cluster id, role, and
    addresses (the server's ``listen_ip_info`` goes in ``remote_ip_info``).

    A mutable builder, as in ``llm_datadist``; ``remote_cluster_id`` and
    ``remote_role_type`` may also be given to the constructor.  The ip lists hold
    ``(ip, port)`` entries with ``ip`` in CANN's int form, as ``llm_datadist`` stores them
    (:class:`IpInfo`, whose ``ip_str`` is the dotted quad).
    """

    def __init__(self, remote_cluster_id: Optional[int] = None,
                 remote_role_type: Optional[Union[LLMRole, int]] = None):
        self._remote_cluster_id: Optional[int] = None
        self._remote_role_type: Optional[Union[LLMRole, int]] = None
        self._local_ip_info_list: List[IpInfo] = []
        self._remote_ip_info_list: List[IpInfo] = []
        if remote_cluster_id is not None:
            self.remote_cluster_id = remote_cluster_id
        if remote_role_type is not None:
            self.remote_role_type = remote_role_type

    @property
    def remote_cluster_id(self) -> Optional[int]:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = _int_in("remote_cluster_id", value, 0, _UINT64_MAX)

    @property
    def remote_role_type(self) -> Optional[Union[LLMRole, int]]:
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: Union[LLMRole, int]) -> None:
        self._remote_role_type = value if isinstance(value, LLMRole) else _as_int("remote_role_type", value)

    @property
    def local_ip_info_list(self) -> List[IpInfo]:
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> List[IpInfo]:
        return self._remote_ip_info_list

    def append_local_ip_info(self, ip: Union[str, int], port: int) -> None:
        """Add a local address. ``ip``: dotted quad or CANN's int form (:func:`ip_to_str`);
        ``port``: uint16."""
        self._local_ip_info_list.append(_ip_info(ip, port))

    def append_remote_ip_info(self, ip: Union[str, int], port: int) -> None:
        """Add an address of the peer (for a server peer: its ``listen_ip_info``)."""
        self._remote_ip_info_list.append(_ip_info(ip, port))

    def __repr__(self) -> str:
        return (f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id!r}, "
                f"remote_role_type={self._remote_role_type!r}, "
                f"local_ip_info_list={self._local_ip_info_list!r}, "
                f"remote_ip_info_list={self._remote_ip_info_list!r})")


def _ip_info(ip: Union[str, int], port: int) -> IpInfo:
    if not isinstance(ip, (str, int)) or isinstance(ip, bool):
        raise TypeError(f"ip must be str or int, got {type(ip).__name__}")
    port = _int_in("port", port, 0, _UINT16_MAX)
    return IpInfo(ip_to_int(ip), port)
