"""The states of a link and the moves between them, in one place.

::

    OPENING --opened()--> READY --mark_closing()--> CLOSING --+
       |                    |                                  |
       +---mark_broken()----+----------> BROKEN ---------------+--closed()--> CLOSED

- ``OPENING``: made, not usable yet (the server's end until the peer attaches its request
  connection, a collective link until its process group exists).
- ``READY``: transfers run.
- ``CLOSING``: an end on purpose is under way: this end unlinks or finalizes, or the peer
  said ``UNLINK``.  The end of the streams that follows is expected, not a failure.
- ``BROKEN``: failed (peer gone, stream lost, a deadline passed mid-request); transfers
  fail fast naming the reason.  Its sockets may still be open until it is closed.
- ``CLOSED``: sockets, mappings and transport given back (:meth:`.Link.close`, the one
  teardown path).

:attr:`LinkLife.broken` is the reason transfers can no longer run (None while they can),
the one field every reader checks.  ``on_broken`` (the engine: waits for pushes from the
peer fail) is told once, when a link that nobody was closing fails or the expected end of
a closing one arrives; a link this end closes tells it nothing (the engine decides what
an unlink means for those waits).
"""
from __future__ import annotations

import enum
import logging
import socket
import threading
from typing import Callable, Optional

from .metrics import EngineMetrics

__all__ = ["LinkState", "LinkLife"]

log = logging.getLogger("datadist")


class LinkState(enum.Enum):
    OPENING = "opening"
    READY = "ready"
    CLOSING = "closing"
    BROKEN = "broken"
    CLOSED = "closed"


_LIVE = (LinkState.OPENING, LinkState.READY)


class LinkLife:
    """The state of one link (see the module docstring); a base of :class:`.Link`.
    Moves are made from any thread; each is idempotent."""

    remote_cluster_id: int
    metrics: Optional[EngineMetrics]

    def __init__(self, on_broken: Optional[Callable[[int, str], None]]) -> None:
        self.on_broken = on_broken
        self.state = LinkState.OPENING
        #: Why transfers can no longer run (None while they can).
        self.broken: Optional[str] = None
        self._opened = threading.Event()   # set once, on the move to READY
        self._moving = threading.Lock()
        self._serve_lent = False   # the serve socket is in use off the agent thread
        self._serve_left: Optional[socket.socket] = None  # ... and was left to its borrower to close

    @property
    def up(self) -> bool:
        """READY and not failed: what the engine counts as a link up."""
        return self.state is LinkState.READY and self.broken is None

    @property
    def ever_opened(self) -> bool:
        """Whether the link has been READY (a link that failed while opening never was)."""
        return self._opened.is_set()

    def wait_opened(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the link to be (or have been) READY."""
        return self._opened.wait(timeout)

    def opened(self) -> None:
        """OPENING -> READY (a link that ended meanwhile stays ended)."""
        with self._moving:
            if self.state is LinkState.OPENING:
                self.state = LinkState.READY
                self._opened.set()

    def mark_closing(self, reason: Optional[str] = None) -> None:
        """OPENING or READY -> CLOSING: an end on purpose.  With ``reason`` (this end
        unlinks) transfers fail fast from now on and ``on_broken`` is never told; without
        it (the peer said ``UNLINK``, or this end is about to) they may still run, and the
        end of stream that follows tells ``on_broken`` as an expected end."""
        with self._moving:
            if self.state in _LIVE:
                self.state = LinkState.CLOSING
            if reason is not None and self.broken is None:
                self.broken = reason

    def mark_broken(self, reason: str) -> None:
        """The link failed (``reason`` says how): a live link moves to BROKEN, counted as
        a link failure and logged as a warning; a closing one keeps CLOSING (the end was
        expected).  Only the first reason counts."""
        with self._moving:
            if self.broken is not None or self.state is LinkState.CLOSED:
                return
            self.broken = reason
            expected = self.state is LinkState.CLOSING
            if not expected:
                self.state = LinkState.BROKEN
        if not expected and self.metrics is not None:
            self.metrics.link_failed()
        log.log(logging.INFO if expected else logging.WARNING, "link to cluster %d %s: %s",
                self.remote_cluster_id, "closed" if expected else "broken", reason)
        if self.on_broken is not None:
            self.on_broken(self.remote_cluster_id, reason)

    def lend_serve(self) -> bool:
        """Lend the serve socket to a thread that serves one request off the agent thread
        (:mod:`.handoff`); False if the link is closed already.  While it is lent, closing
        the link shuts the socket down (the borrower fails at once) but leaves closing it to
        :meth:`give_back_serve`: its descriptor must not be reused under the borrower."""
        with self._moving:
            if self.state is LinkState.CLOSED:
                return False
            self._serve_lent = True
            return True

    def leave_serve(self, sock: socket.socket) -> bool:
        """Whether the serve socket ``sock`` is lent (the closing link then leaves it to
        its borrower)."""
        with self._moving:
            if self._serve_lent:
                self._serve_left = sock
            return self._serve_lent

    def give_back_serve(self) -> None:
        """The borrower is done with the serve socket: closed now if the link was closed
        meanwhile."""
        with self._moving:
            self._serve_lent = False
            sock, self._serve_left = self._serve_left, None
        if sock is not None:
            sock.close()

    def closed(self) -> bool:
        """-> CLOSED; whether this call made the move (the caller then gives back what
        the link holds)."""
        with self._moving:
            if self.state is LinkState.CLOSED:
                return False
            self.state = LinkState.CLOSED
            if self.broken is None:
                self.broken = "link closed"
            return True
