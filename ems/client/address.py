"""Pool addresses: ``auto``, ``auto:DIR``, a socket directory, ``unix://PATH``, ``tcp://H:P``."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from .._errors import invalid

__all__ = ["Address", "parse_address", "DEFAULT_DIR", "SOCKET_NAME"]

DEFAULT_DIR = "/dev/shm/ems"
SOCKET_NAME = "ems.sock"


@dataclass(frozen=True)
class Address:
    """Where the pool listens. ``auto`` addresses also say which directory to start one in."""

    kind: str  # "unix" | "tcp"
    path: Optional[str] = None
    host: Optional[str] = None
    port: Optional[int] = None
    auto: bool = False
    text: str = ""

    @property
    def directory(self) -> Optional[str]:
        return os.path.dirname(self.path) if self.path else None

    def endpoint(self) -> Union[str, Tuple[str, int]]:
        """What a socket connects to: the unix socket's path, or ``(host, port)``."""
        if self.kind == "tcp" and self.host is not None and self.port is not None:
            return self.host, self.port
        if self.kind == "unix" and self.path is not None:
            return self.path
        raise ValueError(f"incomplete pool address {self!r}")

    def __str__(self) -> str:
        return self.text


def parse_address(text: str) -> Address:
    """Parse a pool address; raises ``InvalidArgument`` naming ``server``."""
    if text == "auto" or text.startswith("auto:"):
        directory = text[5:] or DEFAULT_DIR
        return Address("unix", path=os.path.join(directory, SOCKET_NAME), auto=True, text=text)
    if text.startswith("tcp://"):
        host, sep, port = text[6:].rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise invalid("server", f"expected tcp://HOST:PORT, got {text!r}")
        return Address("tcp", host=host.strip("[]"), port=int(port), text=text)
    path = text[7:] if text.startswith("unix://") else text
    if "://" in path or not path:
        raise invalid("server", f"expected auto, a socket directory, unix://PATH or tcp://HOST:PORT, got {text!r}")
    if os.path.isdir(path) or not path.endswith(".sock"):
        path = os.path.join(path, SOCKET_NAME)
    return Address("unix", path=path, text=text)
