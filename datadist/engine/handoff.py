"""Transfers the agent hands off: served on a thread of their own, so that a peer that
stops sending or reading mid-transfer never holds the one thread that serves every link.

The agent hands a transfer off only while other links wait, and only when its bytes would
wait for the peer (:func:`.native.moves_now`: a push's payload not all arrived, a pull's
answer larger than the free send buffer); the link is unwatched meanwhile (its peer sends
nothing before the answer) and watched again once the answer is sent.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
from typing import Callable, NamedTuple, Optional

from . import npu, wire
from .layout import Plan
from .link import Link, shut_down

__all__ = ["Deferred", "HandOffs"]

log = logging.getLogger("datadist")


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


#: How long a thread that served a transfer waits for the next one before it ends (s).
IDLE_S = 10.0


class _Worker:
    """A thread that serves handed-off transfers one after another: ``job`` is the one it
    serves next (None when it should end), ``wake`` is set when a job is given."""

    def __init__(self, job: Deferred, run: Callable[[_Worker], None], name: str) -> None:
        self.job: Optional[Deferred] = job
        self.wake = threading.Event()
        self.thread = threading.Thread(target=run, args=(self,), daemon=True, name=name)
        self.ready = False  # the engine's device made current on this thread


class HandOffs:
    """The transfers served off the agent thread, each on a thread of its own while it
    runs, with the engine's ``device`` current.  ``answer`` sends a reply (and payload),
    ``failed(link, exc)`` ends a link whose transfer failed, ``done(link)`` has the agent
    watch a link again (from any thread).  A link's serve socket is lent to its thread
    (:meth:`.LinkLife.lend_serve`): closing the link meanwhile shuts it down, and the
    thread closes it when done.

    Threads are kept for :data:`IDLE_S` after their transfer and given the next one:
    waking an idle thread costs tens of microseconds, starting one costs from about a
    hundred on an idle machine to most of a millisecond on a busy one, which is what a
    TLS push (whose arrival the agent cannot see before it decrypts) would pay each time."""

    def __init__(self, device: str, answer: Answer, failed: Callable[[Link, Exception], None],
                 done: Callable[[Link], None]) -> None:
        self._device = device
        self._answer, self._failed, self._done = answer, failed, done
        self._lock = threading.Lock()
        self._busy: dict[_Worker, socket.socket] = {}
        self._idle: list[_Worker] = []
        self._ended = False
        self._made = itertools.count(1)  # names the threads (a thread dump tells them apart)

    def __len__(self) -> int:
        """Transfers being served now."""
        with self._lock:
            return len(self._busy)

    def start(self, served: Deferred) -> None:
        """Serve ``served`` off the agent thread (raises if the link is closed already, the
        hand-offs ended, or no thread can start: the caller ends the link; the transfer's
        staging buffers are given back)."""
        try:
            if not served.link.lend_serve():
                raise ConnectionError("the link was closed")
            try:
                self._give(served)
            except BaseException:
                served.link.give_back_serve()
                raise
        except BaseException:
            served.scope.close()
            raise

    def _give(self, served: Deferred) -> None:
        """``served`` to an idle thread (the one idle last), or to a new one."""
        with self._lock:
            if self._ended:
                raise ConnectionError("the engine is stopping")
            worker = self._idle.pop() if self._idle else None
            if worker is not None:
                worker.job = served
                self._busy[worker] = served.sock
                worker.wake.set()
                return
            worker = _Worker(served, self._run, f"datadist-serve-{next(self._made)}")
            self._busy[worker] = served.sock
            try:
                worker.thread.start()
            except BaseException:
                del self._busy[worker]
                raise

    def _run(self, worker: _Worker) -> None:
        while worker.job is not None and self._serve(worker, worker.job):
            if not worker.wake.wait(IDLE_S):
                with self._lock:
                    if worker.job is None:  # given none meanwhile (or the hand-offs ended): end
                        if worker in self._idle:
                            self._idle.remove(worker)
                        return

    def _serve(self, worker: _Worker, served: Deferred) -> bool:
        """Serve one transfer; whether the thread is to wait for the next one.  The thread
        is made idle (under the lock that :meth:`end` takes) before the link is handed
        back, so that a next request the link's peer sends at once finds it idle, and a
        thread is always busy, idle, or past its last look at :attr:`_ended`."""
        ok = False
        try:
            with served.scope:
                if not worker.ready:
                    npu.set_device(self._device)  # staging copies run on this thread
                    worker.ready = True
                self._answer(served.sock, served.rest(), served.payload, served.summed)
            ok = True
        except Exception as exc:
            self._callback(self._failed, served.link, exc)
        finally:
            with self._lock:
                self._busy.pop(worker, None)
                worker.job = None
                keep = not self._ended
                if keep:
                    worker.wake.clear()
                    self._idle.append(worker)
            served.link.give_back_serve()
        if ok:
            self._callback(self._done, served.link)
        return keep

    @staticmethod
    def _callback(fn: Callable[..., None], *args: object) -> None:
        """A callback of the agent's, which must not end a thread kept for the next transfer."""
        try:
            fn(*args)
        except Exception:
            log.exception("a callback of a transfer served off the agent failed")

    def end(self, timeout: float) -> None:
        """End the transfers still served (their streams shut down: they fail at once) and
        the idle threads, and wait for them, so none touches a cache after the engine has
        given its memory back."""
        with self._lock:
            self._ended = True
            busy = list(self._busy.items())
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.wake.set()  # its job is None: it ends
        for _worker, sock in busy:
            shut_down(sock)
        for worker in [w for w, _ in busy] + idle:
            if worker.thread is not threading.current_thread():
                worker.thread.join(timeout)
