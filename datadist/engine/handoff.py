"""Transfers the agent hands off: served on a thread of their own, so that a peer that
stops sending or reading mid-transfer never holds the one thread that serves every link.

The agent hands a transfer off only while other links wait, and only when its bytes would
wait for the peer (:func:`.native.moves_now`: a push's payload not all arrived, a pull's
answer larger than the free send buffer); the link is unwatched meanwhile (its peer sends
nothing before the answer) and watched again once the answer is sent.
"""
from __future__ import annotations

import contextlib
import socket
import threading
from typing import Callable, NamedTuple, Optional

from . import npu, wire
from .layout import Plan
from .link import Link, shut_down

__all__ = ["Deferred", "HandOffs"]


class Deferred(NamedTuple):
    """A transfer to serve off the agent thread: its link and socket, the rest of it
    (returns the reply), a pull's payload and whether its checksum follows, and the
    staging buffers it holds until its answer is sent."""

    link: Link
    sock: socket.socket
    rest: Callable[[], wire.Message]
    payload: Optional[Plan]
    summed: bool
    scope: contextlib.ExitStack


#: Sends a reply, and a pull's payload behind it: ``(sock, reply, payload, summed)``.
Answer = Callable[[socket.socket, wire.Message, Optional[Plan], bool], None]


class HandOffs:
    """The transfers served off the agent thread, a thread each, with the engine's
    ``device`` current.  ``answer`` sends a reply (and payload), ``failed(link, exc)``
    ends a link whose transfer failed, ``done(link)`` has the agent watch a link again
    (from any thread).  A link's serve socket is lent to its thread
    (:meth:`.LinkLife.lend_serve`): closing the link meanwhile shuts it down, and the
    thread closes it when done."""

    def __init__(self, device: str, answer: Answer, failed: Callable[[Link, Exception], None],
                 done: Callable[[Link], None]) -> None:
        self._device = device
        self._answer, self._failed, self._done = answer, failed, done
        self._lock = threading.Lock()
        self._threads: dict[threading.Thread, socket.socket] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._threads)

    def start(self, served: Deferred) -> None:
        """Serve ``served`` on a thread of its own (raises if the link is closed already
        or no thread can start: the caller ends the link)."""
        if not served.link.lend_serve():
            raise ConnectionError("the link was closed")
        thread = threading.Thread(target=self._serve, args=(served,), daemon=True,
                                  name=f"datadist-serve-{served.link.remote_cluster_id}")
        try:
            with self._lock:
                self._threads[thread] = served.sock
            thread.start()
        except BaseException:
            with self._lock:
                self._threads.pop(thread, None)
            served.link.give_back_serve()
            raise

    def _serve(self, served: Deferred) -> None:
        npu.set_device(self._device)  # staging copies run on this thread
        try:
            with served.scope:
                self._answer(served.sock, served.rest(), served.payload, served.summed)
        except Exception as exc:
            self._failed(served.link, exc)
            return
        finally:
            with self._lock:
                self._threads.pop(threading.current_thread(), None)
            served.link.give_back_serve()
        self._done(served.link)

    def end(self, timeout: float) -> None:
        """End the transfers still served (their streams shut down: they fail at once) and
        wait for them, so none touches a cache after the engine has given its memory back."""
        with self._lock:
            threads = list(self._threads.items())
        for _thread, sock in threads:
            shut_down(sock)
        for thread, _sock in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
