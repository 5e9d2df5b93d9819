"""A session's next frame, gathered as its bytes arrive, never waiting for more.

A frame that the socket's buffer shows whole is read in one go by the worker that serves
it.  Two kinds cannot be seen whole before they are read: a frame larger than a socket
buffer holds (an authenticated tenant's long key list), and any frame on a TLS connection
(its records cannot be peeked into).  Those are gathered here, a piece at a time, by
whichever thread looks at the session (a worker woken by the bytes, then the dispatcher's
keeper), and only a whole frame goes to a worker: a peer that sends part of one and stops
holds no thread, and is closed when ``read_timeout`` passes.

Memory grows with what arrived, never with what a header announces.
"""
from __future__ import annotations

import mmap
import socket
import ssl
from typing import List, Optional

from .._errors import ProtocolError
from ..pool import wire
from datadist.engine.codec import HEADER_SIZE

__all__ = ["Inbox"]

#: Most bytes taken from the socket in one read.
_PIECE = 1 << 20


class Inbox:
    """The frame being gathered (see the module docstring); one reader at a time.

    A frame larger than one piece is read straight into an anonymous mapping of its
    announced size: its pages are taken as bytes land in them (so memory still follows what
    arrived), it is never copied to be put together, and it goes back to the system the
    moment its message is decoded (heap memory of that size would stay with the worker's
    arena, once on each worker)."""

    def __init__(self) -> None:
        self._parts: List[bytes] = []
        self._got = 0
        self._size = 0  # the whole frame's, once its header is in
        self._mapped: Optional[mmap.mmap] = None  # a frame larger than a piece
        #: Why the stream cannot go on (a refused header, its end); the reader ends it.
        self.broken: Optional[Exception] = None

    @property
    def started(self) -> bool:
        """Whether part of a frame is in (the rest must be gathered here too)."""
        return self._got > 0

    def gather(self, sock: socket.socket, max_frame: int) -> Optional[bool]:
        """Take what has arrived of the frame without waiting: True once it is whole (or
        :attr:`broken`), False while part of it is in, None when nothing has arrived."""
        if self.broken is not None:
            return True
        sock.settimeout(0)  # non-blocking: an empty socket raises instead of waiting
        try:
            while True:
                want = (self._size or HEADER_SIZE) - self._got
                if want == 0:
                    return True
                if self._mapped is not None:
                    got = sock.recv_into(memoryview(self._mapped)[self._got:])
                else:
                    piece = sock.recv(min(want, _PIECE))
                    got = len(piece)
                    self._parts.append(piece)
                if not got:
                    self.broken = ConnectionResetError("the peer closed the connection")
                    return True
                self._got += got
                if not self._size and self._got >= HEADER_SIZE:
                    self._size = wire.frame_size(self._joined()[:HEADER_SIZE], max_frame)
                    if self._size > _PIECE:
                        self._mapped = mmap.mmap(-1, self._size)
                        self._mapped[:self._got] = self._joined()
                        self._parts = []
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False if self.started else None
        except (OSError, ProtocolError) as exc:  # ssl.SSLError is an OSError
            self.broken = exc
            return True

    def _joined(self) -> bytes:
        if len(self._parts) > 1:
            self._parts = [b"".join(self._parts)]
        return self._parts[0]

    def take(self) -> wire.Message:
        """The whole frame's message (after :meth:`gather` said True and nothing is
        :attr:`broken`); the inbox is empty again.  ``ProtocolError`` for a bad frame."""
        frame = self._joined() if self._mapped is None else memoryview(self._mapped)
        self._parts, self._got, self._size, self._mapped = [], 0, 0, None
        return wire.decode(frame)
