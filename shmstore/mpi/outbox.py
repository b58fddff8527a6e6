"""The replies and posts of a node's service, which it never waits for the receivers to take.

Small ones go at once (MPI buffers them). A reply that may pass MPI's
eager size (a batch's lookups, a chunk, an object inline) would make a
blocking send wait until the requester takes it, holding the service's
loop and every request behind it (about 1 ms), and for ever where the
requester died: it goes without blocking and is kept here until it
completes. The loop tends the kept sends between requests; those still not
taken after ``timeout`` seconds without any of them completing are
given up (cancelled, and kept by ``abandon.py`` until MPI is done with
them: their receivers died, or wake later), so that the loop naps again
instead of probing as if a transfer were under way, for ever. Where MPI
reports a send failed (its receiver is gone), nobody is left to answer.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from mpi4py import MPI

from . import wire as W
from .abandon import give_up
from .poll import settle

__all__ = ["Outbox"]


class Outbox:
    """Replies and posts over ``comm``, the large ones kept until taken and given up after ``timeout`` seconds.
    :meth:`reply` and :meth:`post` are thread-safe; :meth:`tend` and :meth:`drain` belong to the loop thread
    (the one that called :meth:`own`), which alone touches :attr:`out`, and tends while :attr:`out` or
    :attr:`handed` says there is something to tend."""

    def __init__(self, comm: MPI.Comm, timeout: float) -> None:
        self.comm, self.timeout = comm, timeout
        self.out: list[MPI.Request] = []  # sends not yet taken by their receivers (the loop checks it)
        self.handed = False  # other threads handed sends over since the loop last took them
        self._since = 0.0  # when one of them was last taken (or the first went out)
        self._handoff: queue.SimpleQueue[MPI.Request] = queue.SimpleQueue()  # the sends of other threads
        self._owner: int | None = None
        self.ring: Callable[[int], object] | None = None  # rings rank ``dest``'s service after a post

    def own(self) -> None:
        """The calling thread (the service's loop) tends the sends from now on."""
        self._owner = threading.get_ident()

    def reply(self, value: Any, dest: int, tag: int) -> None:
        """Answer rank ``dest`` on ``tag``."""
        try:
            if _large(value):
                self._keep(W.reply_nowait(self.comm, value, dest, tag))
            else:
                W.reply(self.comm, value, dest, tag)  # small: buffered at once, 0.5 us less than a kept isend
        except MPI.Exception:
            pass

    def post(self, msg: Any, dest: int) -> None:
        """Send the small ``msg`` to the service on rank ``dest`` for no answer (and ring it: doorbell.py)."""
        try:
            W.post(self.comm, msg, dest)
        except MPI.Exception:
            return
        if self.ring is not None:
            self.ring(dest)

    def _keep(self, req: MPI.Request) -> None:
        if threading.get_ident() == self._owner:
            self.out.append(req)
        else:
            self._handoff.put(req)
            self.handed = True

    def _take_handoff(self) -> None:
        self.handed = False
        while not self._handoff.empty():
            self.out.append(self._handoff.get_nowait())

    def tend(self) -> None:
        """Forget the sends taken; give up on those none of which was taken for ``timeout`` seconds."""
        self._take_handoff()
        try:
            if MPI.Request.Testall(self.out):  # the usual case: taken
                self.out.clear()
                self._since = 0.0
                return
            now = time.monotonic()
            if MPI.Request.Testsome(self.out) or not self._since:  # some taken since: the others may be too
                self.out = [r for r in self.out if r]
                self._since = now
                return
            expired = now - self._since > self.timeout
        # MPI failed one of them (its receiver died): the others will not come either
        except MPI.Exception:
            expired = True
        if expired:
            self._drop()

    def drain(self, limit: float) -> None:
        """Wait for every send out to be taken, ``limit`` seconds at most (the last replies when the service
        stops: their requesters took them before the closing barrier), then drop what is left."""
        self._take_handoff()
        try:
            if self.out and not settle(self.out, min(limit, self.timeout), False, 0.001, 0.001):
                give_up(self.out)
        except MPI.Exception:  # a receiver that died
            give_up(self.out)
        self.out = []
        self._since = 0.0

    def _drop(self) -> None:
        # each request keeps its pickled bytes until MPI is done with it (abandon.py)
        give_up(self.out)
        self.out = []
        self._since = 0.0


def _large(reply: Any) -> bool:
    """Whether ``reply`` may pickle to more than MPI's eager size (a few KiB)."""
    if isinstance(reply, W.Sourced):
        reply = reply.found
    if isinstance(reply, W.Found):
        return reply.inline is not None and len(reply.inline) > 1024
    return isinstance(reply, (W.FoundMany, W.Chunk))
