"""The sends of a node's service that it never waits for: replies and posts, kept until taken.

A service loop that waited for each reply to be taken would wait for ever
on a requester that died (a blocking send to a dead rank never returns on
some transports), and, for a reply over MPI's eager size (a batch's
lookups), hold every request behind it until its requester takes it. So
every send goes out without blocking (``wire.py``); most are done at once
(MPI buffered them), and the others are kept here until they complete.
The loop tends them between requests; those still not taken after
``timeout`` seconds without any of them completing are cancelled and
dropped (their receivers died), so that the loop naps again instead of
probing as if a transfer were under way, for ever.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

from mpi4py import MPI

from . import wire as W
from .poll import cancel, settle

__all__ = ["Outbox"]


class Outbox:
    """Sends over ``comm`` kept until taken, given up after ``timeout`` seconds. :meth:`reply` and :meth:`post`
    are thread-safe; :meth:`tend` and :meth:`drain` belong to the loop thread (the one that called
    :meth:`own`), which alone touches the list of sends out."""

    def __init__(self, comm: MPI.Comm, timeout: float) -> None:
        self.comm, self.timeout = comm, timeout
        self._out: list[MPI.Request] = []  # sends not yet taken by their receivers
        self._since = 0.0  # when one of them was last taken (or the first went out)
        self._handoff: queue.SimpleQueue[MPI.Request] = queue.SimpleQueue()  # the same, from other threads
        self._owner: int | None = None

    def own(self) -> None:
        """The calling thread (the service's loop) tends the sends from now on."""
        self._owner = threading.get_ident()

    @property
    def waiting(self) -> bool:
        """Whether sends of the loop's are out, not taken yet."""
        return bool(self._out)

    def busy(self) -> bool:
        """Whether any send is out (the loop's or another thread's): :meth:`tend` has work."""
        return bool(self._out) or not self._handoff.empty()

    def reply(self, value: Any, dest: int, tag: int) -> None:
        """Answer rank ``dest`` on ``tag``. Where MPI fails to send (it reports ``dest`` gone) nobody is left
        to answer."""
        try:
            self._keep(W.reply(self.comm, value, dest, tag))
        except MPI.Exception:
            pass

    def post(self, msg: Any, dest: int) -> None:
        """Send ``msg`` to the service on rank ``dest`` for no answer, as :meth:`reply` sends."""
        try:
            self._keep(W.post(self.comm, msg, dest))
        except MPI.Exception:
            pass

    def _keep(self, req: MPI.Request) -> None:
        if req.Test():  # the usual case: MPI buffered it
            return
        if threading.get_ident() == self._owner:
            self._out.append(req)
        else:
            self._handoff.put(req)

    def _take_handoff(self) -> None:
        while not self._handoff.empty():
            self._out.append(self._handoff.get_nowait())

    def tend(self) -> None:
        """Forget the sends taken; give up on those none of which was taken for ``timeout`` seconds."""
        self._take_handoff()
        try:
            if MPI.Request.Testall(self._out):  # the usual case: taken
                self._out.clear()
                self._since = 0.0
                return
            now = time.monotonic()
            if MPI.Request.Testsome(self._out) or not self._since:  # some taken since: the others may be too
                self._out = [r for r in self._out if r]
                self._since = now
                return
            expired = now - self._since > self.timeout
        except MPI.Exception:  # MPI failed one of them (its receiver died): the others will not come either
            expired = True
        if expired:
            self._drop()

    def drain(self, limit: float) -> None:
        """Wait for every send out to be taken, ``limit`` seconds at most (the last replies when the service
        stops: their requesters took them before the closing barrier), then drop what is left."""
        self._take_handoff()
        try:
            if self._out and not settle(self._out, min(limit, self.timeout), False, 0.001, 0.001):
                cancel(self._out)
        except MPI.Exception:  # a receiver that died
            cancel(self._out)
        self._out.clear()
        self._since = 0.0

    def _drop(self) -> None:
        cancel(self._out)
        self._out.clear()
        self._since = 0.0
