"""A request frame read as its bytes come, never waiting for the rest.

With several links to serve, the agent must not wait for one peer's frame: a peer that
sends part of one and stops would hold every other link until the deadline.  Small plain
frames are peeked at until whole (the socket's buffer holds them).  A frame larger than
that, or any frame of a TLS link (whose bytes cannot be peeked at before they are
decrypted), is read into a :class:`Gathering` as far as it has arrived, and served once
it is whole; the link stays watched meanwhile, so more bytes wake the agent at once.
Nothing is read past the frame: what follows it (a push's payload, the next request) stays
in the stream for whoever reads it next.
"""
from __future__ import annotations

import socket
import ssl
from typing import Collection, Generic, Hashable, Iterator, Optional, TypeVar

from . import native, wire

__all__ = ["Gathering", "Gatherings", "WHOLE_MAX", "arrived_of", "whole_request"]

#: Largest request frame the agent waits to see whole before it reads it, while it serves
#: other links too (a socket buffer holds it); a larger one is gathered as it arrives.
WHOLE_MAX = 64 << 10

_K = TypeVar("_K", bound=Hashable)


def arrived_of(sock: socket.socket) -> int:
    """How far the next frame on ``sock`` has arrived (:func:`.native.frame_arrived` with
    :data:`WHOLE_MAX`).  Peeks, never reads; in C, because it runs before every request
    while several links are watched (two Python socket calls there, each with its poll and
    GIL hand-off, cost a fan-in beside a CPU hog about 13 % of its throughput)."""
    return native.frame_arrived(sock.fileno(), WHOLE_MAX)


def whole_request(sock: socket.socket) -> Optional[bool]:
    """Whether the next frame on ``sock`` has arrived whole (True too for the end of the
    stream, an error, and frames over :data:`WHOLE_MAX`, which are gathered as they come);
    None when nothing has arrived."""
    return _ARRIVED[arrived_of(sock) + 1]


#: Most bytes one read asks for (a read allocates what it asks for before it gets it).
_PIECE = 1 << 20

#: :func:`whole_request`'s answer for each of :func:`.native.frame_arrived`'s.
_ARRIVED: tuple[Optional[bool], ...] = (None, False, True, True)


class Gathering:
    """The bytes of one frame read so far from a link's socket (since ``started``, a
    ``time.monotonic``).  The header is checked (type among ``allowed``, sizes within the
    codec's limits) before the body is read, and the body grows as its bytes arrive, so a
    peer that announces much and sends little costs what it sent."""

    __slots__ = ("started", "_allowed", "_data", "_size")

    def __init__(self, started: float, allowed: Collection[int]) -> None:
        self.started = started
        self._allowed = allowed
        self._data = bytearray()
        self._size = wire.HEADER_SIZE  # until the header is in

    def feed(self, sock: socket.socket) -> Optional[bytes]:
        """Read what has arrived of the frame (never more, never waiting): the whole frame
        once it is, else None.  ``ConnectionResetError`` at the end of the stream,
        ``wire.WireError`` for a header the codec refuses, ``OSError`` as the socket gives."""
        while len(self._data) < self._size:
            piece = _read_some(sock, min(self._size - len(self._data), _PIECE))
            if piece is None:
                return None
            self._data += piece
            if self._size == wire.HEADER_SIZE and len(self._data) == wire.HEADER_SIZE:
                _cls, blen, alen = wire.FORMAT.parse_header(self._data, self._allowed)
                self._size += blen + alen
        return bytes(self._data)


def _read_some(sock: socket.socket, most: int) -> Optional[bytes]:
    """Up to ``most`` bytes that have arrived on ``sock`` (decrypted, for TLS), or None when
    none have; ``ConnectionResetError`` at the end of the stream."""
    timeout = sock.gettimeout()
    sock.settimeout(0.0)  # a socket with a timeout would wait for readiness before reading
    try:
        got = sock.recv(most)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
        return None
    finally:
        sock.settimeout(timeout)  # the stream's next reader reads with the link's timeout
    if not got:
        raise ConnectionResetError("the peer closed the connection mid-frame")
    return got


class Gatherings(Generic[_K]):
    """The frames being gathered, one per link (``_K``), each with the frame types it may
    be (``allowed``)."""

    def __init__(self, allowed: Collection[int]) -> None:
        self._allowed = allowed
        self._by_link: dict[_K, Gathering] = {}

    def __bool__(self) -> bool:
        return bool(self._by_link)

    def __contains__(self, link: _K) -> bool:
        return link in self._by_link

    def feed(self, link: _K, sock: socket.socket, now: float) -> Optional[bytes]:
        """Read what has come of ``link``'s frame (a new one begun at ``now``): the whole
        frame, or None while it is not; errors as :meth:`Gathering.feed` (the link's
        gathering ends then)."""
        gathering = self._by_link.get(link)
        if gathering is None:
            gathering = self._by_link[link] = Gathering(now, self._allowed)
        try:
            whole = gathering.feed(sock)
        except BaseException:
            del self._by_link[link]
            raise
        if whole is not None:
            del self._by_link[link]
        return whole

    def stalled(self, before: float) -> Iterator[_K]:
        """The links whose frame was begun before ``before``, forgotten here as they are
        given."""
        for link, gathering in list(self._by_link.items()):
            if gathering.started < before:
                del self._by_link[link]
                yield link
