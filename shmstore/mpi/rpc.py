"""Requests and replies: a rank's calls to node services, and the replies it waits for.

A call sends ``(reply_tag, message)`` to the node's leader and waits for
the reply on its own tag. The wait probes in C with the GIL released
(``poll.py``): back to back for a moment where the host has a core to spare
(a reply usually comes within microseconds), then after naps from 20 us
doubling up to 1 ms, so a rank waiting long (for a busy holder of a hot
object) takes no core from the others, as MPICH's busy-polling blocking
receive would.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any

from mpi4py import MPI

from . import tags as T
from . import wire as W
from .poll import prober, quiet_wait

__all__ = ["Messenger"]

_NAP = 20e-6      # the first nap after the spin window
_NAP_MAX = 1e-3   # naps double up to this


class Messenger:
    """Calls to the services of the nodes ``names`` (leaders ``leaders``) over ``comm``. Thread-safe."""

    def __init__(self, comm: MPI.Comm, names: list[str], leaders: list[int], spin: float) -> None:
        self.comm, self.names, self.leaders, self.spin = comm, names, leaders, spin
        self._tags = itertools.count()
        self._tag_lock = threading.Lock()
        self._probe = prober(comm)
        self._posted: set[int] = set()  # nodes posted to since the last flush
        self.calls = self.posts = 0  # requests sent by this rank (calls answered, posts not), for the benchmarks
        self.forwarded = 0  # calls answered by another node than the one asked (the request went on to it)

    def next_tag(self) -> int:
        """A reply tag for a new call (counted in :attr:`calls`)."""
        with self._tag_lock:
            self.calls += 1
            return T.TAG_REPLY_MIN + next(self._tags) % (T.TAG_REPLY_MAX - T.TAG_REPLY_MIN)

    def call(self, node: int, msg: Any, key: Any = None, spin: float | None = None, linger: float = 0.0,
             any_source: bool = False) -> Any:
        """Send ``msg`` to ``node``'s service and return its reply; ``spin``: seconds to wait for it without
        napping (default :attr:`spin`; longer for a request that takes the service long); ``linger``:
        seconds the service should wait for this rank's next request without napping (more follow soon);
        ``any_source``: the reply may come from another node's service (a forwarded request).

        Raises:
            the exception the service reported (a :class:`wire.Failure`), naming the node.
        """
        return self.call_tagged(node, msg, key, spin, linger, any_source)[1]

    def call_tagged(self, node: int, msg: Any, key: Any = None, spin: float | None = None,
                    linger: float = 0.0, any_source: bool = False) -> tuple[int, Any]:
        """:meth:`call`, also returning the reply tag (bulk frames follow a Data reply on it)."""
        dest, tag = self.leaders[node], self.next_tag()
        W.request(self.comm, msg, dest, tag, linger if self.spin else 0.0)
        spin = self.spin if spin is None else spin
        source = MPI.ANY_SOURCE if any_source else dest  # a reply tag is this rank's alone while the call lasts
        while not self._probe(source, tag, spin, _NAP, 3600.0, _NAP_MAX):
            pass
        if any_source:
            status = MPI.Status()
            reply = W.receive_reply(self.comm, source, tag, status)
            if status.Get_source() != dest:
                self.forwarded += 1  # asked one node, answered by another: one message more
        else:
            reply = W.receive_reply(self.comm, source, tag)
        if isinstance(reply, W.Failure):
            raise reply.exception(f"node {self.names[node]!r}", key if key is not None else getattr(msg, "key", None),
                                  dest)
        return tag, reply

    def wait(self, reqs: list[MPI.Request]) -> None:
        """Wait for ``reqs`` (bulk receives): in MPI's blocking wait where this rank has a core of its own,
        else testing after naps (20 us doubling up to 1 ms), so that ranks sharing cores let the senders
        and each other run."""
        if self.spin > 0:
            MPI.Request.Waitall(reqs)
            return
        quiet_wait(reqs, _NAP, _NAP_MAX)

    def post(self, node: int, msg: Any) -> None:
        """Send ``msg`` to ``node``'s service without waiting for (or getting) a reply. Messages a rank
        sends to one node arrive in the order sent (and are handled in that order)."""
        W.post(self.comm, msg, self.leaders[node])
        with self._tag_lock:
            self._posted.add(node)
            self.posts += 1

    def flush(self) -> None:
        """Return once every node this thread's rank posted to since the last flush has handled those
        messages: one round trip to each (a request answered after them)."""
        with self._tag_lock:
            nodes, self._posted = self._posted, set()
        for node in sorted(nodes):
            self.call(node, W.DirGet([]))
