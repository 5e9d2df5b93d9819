"""A TCP proxy for integrity tests: it forwards every connection to ``upstream`` and, once
armed for a direction, changes one byte of the first payload that shows it (a run of
:data:`MARK` bytes, which no frame of the protocols holds), then forwards faithfully again.

``FlipProxy(upstream)`` listens on ``127.0.0.1`` (``address``: ``(host, port)``);
``arm("up")`` flips in the client-to-server direction, ``arm("down")`` in the other;
``flipped`` counts the bytes changed, so a test can check that the corruption happened.
"""
from __future__ import annotations

import socket
import threading
from typing import List, Tuple

__all__ = ["FlipProxy", "MARK"]

#: The byte a test fills its payload with; the proxy flips one inside a run of :data:`_RUN`.
MARK = 0x5A
_RUN = bytes([MARK]) * 64


class FlipProxy:
    def __init__(self, upstream: Tuple[str, int]) -> None:
        self.upstream = upstream
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.address: Tuple[str, int] = self._lsock.getsockname()[:2]
        self._lock = threading.Lock()
        self._armed = {"up": False, "down": False}
        self.flipped = 0
        self._socks: List[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="flip-proxy", daemon=True).start()

    def arm(self, direction: str) -> None:
        with self._lock:
            self._armed[direction] = True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._lsock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                data = self._maybe_flip(data, direction)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _maybe_flip(self, data: bytes, direction: str) -> bytes:
        with self._lock:
            if not self._armed[direction]:
                return data
            at = data.find(_RUN)
            if at < 0:
                return data
            self._armed[direction] = False
            self.flipped += 1
        out = bytearray(data)
        out[at + len(_RUN) // 2] ^= 0x01
        return bytes(out)

    def close(self) -> None:
        self._lsock.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            s.close()
