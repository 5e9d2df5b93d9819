"""Application messages between linked engines (``LLMDataDist.send_notification``).

A serving framework needs a word back from its peer beside the bytes: "request r's blocks
are pulled, free them" is what a decode instance tells its prefill instance.  A note
travels one way, from the end that made a link to the end that accepted it, in order with
that link's transfers, so a note sent after a pull returns is received after the pull was
served.  The receiver files each note under the link's authenticated peer.

The box is bounded in count and in characters: notes nobody collects do not grow the
process.  When it is full the oldest notes are dropped and counted.
"""
from __future__ import annotations

import collections
import logging
import threading

__all__ = ["NoteBox", "MAX_NOTE_BYTES", "MAX_PENDING_NOTES", "MAX_PENDING_NOTE_CHARS"]

log = logging.getLogger("datadist")

#: Largest note, in UTF-8 bytes (a link frame before payload is capped at 64 KiB).
MAX_NOTE_BYTES = 60 << 10
#: Notes kept until collected; older ones are dropped first.
MAX_PENDING_NOTES = 65536
#: Characters of notes kept until collected (a peer sending the largest notes as fast as
#: it can fills this long before the count above); older ones are dropped first.
MAX_PENDING_NOTE_CHARS = 16 << 20


class NoteBox:
    """Received notes, oldest first (thread-safe)."""

    def __init__(self, capacity: int = MAX_PENDING_NOTES, chars: int = MAX_PENDING_NOTE_CHARS) -> None:
        self._notes: collections.deque[tuple[int, str]] = collections.deque()
        self._capacity = capacity
        self._chars_max = chars
        self._chars = 0
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self.dropped = 0

    def record(self, cluster_id: int, text: str) -> None:
        with self._lock:
            while self._notes and (len(self._notes) >= self._capacity
                                   or self._chars + len(text) > self._chars_max):
                self._chars -= len(self._notes.popleft()[1])
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, ...: a flood logs a few lines
                    log.warning("%d notification(s) dropped: nobody collected them (get_notifications)",
                                self.dropped)
            self._notes.append((cluster_id, text))
            self._chars += len(text)
            self._arrived.notify_all()

    def take(self, timeout_s: float = 0.0) -> list[tuple[int, str]]:
        """Every note received so far, oldest first; the box is empty afterwards.  With
        ``timeout_s`` > 0 and none there, waits that long at most for the first."""
        with self._lock:
            if not self._notes and timeout_s > 0:
                self._arrived.wait(timeout_s)
            notes = list(self._notes)
            self._notes.clear()
            self._chars = 0
        return notes
