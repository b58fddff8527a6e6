"""Requests and replies: a rank's calls to node services, and the replies it waits for.

A call sends ``(reply_tag, message, ...)`` (``wire.request``) to the node's leader and waits for
the reply on its own tag. The wait probes in C with the GIL released
(``poll.py``): back to back for a moment where the host has a core to spare
(a reply usually comes within microseconds), then after naps from 20 us
doubling up to 1 ms, so a rank waiting long (for a busy holder of a hot
object) takes no core from the others, as MPICH's busy-polling blocking
receive would.

Every wait on another rank has a deadline, ``peer_timeout`` seconds (a
reply; a transfer's next frame; a large request's send), after which the
call raises :class:`~shmstore.errors.TransferError` naming the node, its
rank and the operation: a rank that died (a job run with automatic
cleanup disabled, as fault-tolerant codes run) never leaves the others
waiting for ever. The deadline costs the hot path nothing: the C prober
takes it as its limit, and the clock is read only once a wait naps. A
reply that comes after its call gave up must not be taken for another
call's: the tag of a call that timed out is never used again.

A get may bound its whole call too (``ref.get(timeout=)``, ``Cluster.get``):
:func:`bounded` sets the end for the calling thread, every wait of the call
ends by then at the latest, and the call raises
:class:`~shmstore.errors.GetTimeoutError` (a transfer under way is given up
as after a peer that stopped answering).
"""
from __future__ import annotations

import ast
import contextlib
import contextvars
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import errors
from ..primitives.interrupts import interruptible
from . import tags as T
from . import wire as W
from .abandon import give_up
from .doorbell import Bells
from .poll import WORKED, prober, settle

__all__ = ["Messenger", "gave_up"]

_NAP = 20e-6      # the first nap after the spin window
_NAP_MAX = 1e-3   # naps double up to this
# A reply is awaited with naps of at most this for its first _REPLY_SOON seconds: a reply that comes in a few
# ms (a service that was idle: it probes every 1 ms where ranks fill the cores) is seen within 100 us, not
# after a nap grown to 1 ms (which doubled the latency of a request after silence).
_REPLY_NAP_MAX = 100e-6
_REPLY_SOON = 0.02
_LATE_EVERY = 0.2  # seconds between the looks for late replies while some may come (see Messenger._sweep_late)
# and up to this while frames flow (MPI moves a large message only while it is tested)
_FRAME_NAP_MAX = 100e-6
_SETTING = "raise peer_timeout= / SHMSTORE_PEER_TIMEOUT"


def gil_hint() -> str:
    """What to say of a node that did not answer where mpi4py's tree-based reductions of Python objects are on
    (``mpi4py.rc.fast_reduce``, the default): ``comm.reduce``/``allreduce`` of objects hold the GIL while they
    wait for the other ranks, so a node leader inside one serves nobody (its service is a thread of it).
    Measured: a thread beside a waiting ``comm.reduce`` ran 1 loop in 1 s, 893-905 beside ``Barrier``,
    ``allreduce`` with ``fast_reduce`` off, or ``reduce`` with it off."""
    import os

    import mpi4py
    off = os.environ.get("MPI4PY_RC_FAST_REDUCE", "").strip().lower() in ("0", "false", "no", "off")
    if off or not getattr(mpi4py.rc, "fast_reduce", False):
        return ""
    return ("; or it waits in comm.reduce/allreduce of Python objects, which with mpi4py's tree-based reductions "
            "hold the GIL and stop its node's service: set MPI4PY_RC_FAST_REDUCE=0 (shmstore.mpi sets "
            "mpi4py.rc.fast_reduce = False itself where it imports MPI first)")
_LEFT_NOTE = 512  # bytes of a rank's notice that it left the cluster by an exception


# the end (time.monotonic()) of the call this thread is in, where it was given a timeout (bounded)
_END: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("shmstore_call_end", default=None)


@contextlib.contextmanager
def bounded(timeout: float | None) -> Iterator[None]:
    """Every wait on another rank inside the block (in this thread) ends within ``timeout`` seconds of its start
    (None: no bound beyond ``peer_timeout``); one that would wait longer raises GetTimeoutError."""
    if timeout is None:
        yield
        return
    if not timeout >= 0:
        raise errors.InvalidArgumentError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    token = _END.set((time.monotonic() + float(timeout), float(timeout)))
    try:
        yield
    finally:
        _END.reset(token)


def call_end() -> float | None:
    """The end of this thread's bounded call (see :func:`bounded`), None where it has none."""
    bound = _END.get()
    return None if bound is None else bound[0]


def call_limit(limit: float) -> float:
    """``limit`` seconds of a wait, cut to what is left of this thread's bounded call (0 once its end passed)."""
    end = call_end()
    return limit if end is None else max(0.0, min(limit, end - time.monotonic()))


def out_of_time(what: str, key: Any = None, peer: int | None = None) -> errors.GetTimeoutError | None:
    """The error of a bounded call whose end has passed (``what`` was under way), None while time is left."""
    bound = _END.get()
    if bound is None or time.monotonic() < bound[0]:
        return None
    return errors.GetTimeoutError(f"did not finish within the timeout of {bound[1]:g} s it was given ({what} was "
                                  f"under way and is given up): ask again, or give it more time",
                                  key if isinstance(key, str) else None, peer)


class Messenger:
    """Calls to the services of the nodes ``names`` (leaders ``leaders``) over ``comm``, each wait at most
    ``timeout`` seconds (see the module's docstring). Thread-safe."""

    def __init__(self, comm: MPI.Comm, names: list[str], leaders: list[int], spin: float,
                 timeout: float = 60.0, bells: Bells | None = None, frames: MPI.Comm | None = None) -> None:
        self.comm, self.names, self.leaders, self.spin, self.timeout = comm, names, leaders, spin, timeout
        self.frames = frames  # the communicator of the frames pushed with lookups' answers (see drain)
        self.bells = bells  # rings a node's service awake after this rank's silence towards it (doorbell.py)
        self._tags = itertools.count()
        self._tag_lock = threading.Lock()
        self._burnt: set[int] = set()  # tags of calls that gave up: a late reply may still come on them
        # of those, the calls whose reply was not taken, and until when it may come (see _take_late)
        self._late: dict[int, float] = {}
        self._sweeping = threading.Lock()
        self._sweeper: threading.Thread | None = None  # takes late replies while this rank makes no call
        self._closed = threading.Event()  # the cluster closes: the sweeper leaves (woken at once)
        # tags whose reply came with a pushed frame that no receive of this rank has matched yet: a later call
        # on the same tag would get a push from the same holder, and its receive could take the older frame
        self._owed: set[int] = set()
        self._probe = prober(comm)
        self._posted: set[int] = set()  # nodes posted to since the last flush
        self._note = bytearray(_LEFT_NOTE)  # another rank's notice that it left by an exception (say_left)
        self._watch: MPI.Request | None = None  # the receive of that notice, posted by the first barrier
        self._notes: list[MPI.Request] = []  # this rank's own notices (small: sent at once; kept, never waited)
        # requests sent by this rank (calls answered, posts not), for the benchmarks
        self.calls = self.posts = 0
        # calls answered by another node than the one asked (the request went on to it)
        self.forwarded = 0
        # per node, its service thread's id where it runs on this rank's machine (else 0), set by the Cluster
        # once every rank said where it runs: a wait for that service's reply gives way to it where it waits
        # for the waiting thread's CPU (poll.prober's partner)
        self.partners: list[int] = [0] * len(names)

    def next_tag(self) -> int:
        """A reply tag for a new call (counted in :attr:`calls`)."""
        with self._tag_lock:
            self.calls += 1
            tag = T.TAG_REPLY_MIN + next(self._tags) % (T.TAG_REPLY_MAX - T.TAG_REPLY_MIN)
            # never a tag a late reply or frame may still come on
            while (self._burnt and tag in self._burnt) or (self._owed and tag in self._owed):
                tag = T.TAG_REPLY_MIN + next(self._tags) % (T.TAG_REPLY_MAX - T.TAG_REPLY_MIN)
            return tag

    def owe(self, tag: int) -> None:
        """A frame pushed on reply tag ``tag`` came with its answer: no new call uses the tag until
        :meth:`paid` (a receive matched the frame's place in MPI's order) or a drain of it is over."""
        with self._tag_lock:
            self._owed.add(tag)

    def paid(self, tag: int) -> None:
        """The receive of the frame pushed on ``tag`` is posted (it, not a later call's, takes that frame)."""
        with self._tag_lock:
            self._owed.discard(tag)

    def call(self, node: int, msg: Any, key: Any = None, spin: float | None = None, linger: float = 0.0,
             any_source: bool = False, patience: float = 1.0) -> Any:
        """Send ``msg`` to ``node``'s service and return its reply; ``spin``: seconds to wait for it without
        napping (default :attr:`spin`; longer for a request that takes the service long); ``linger``:
        seconds the service should wait for this rank's next request without napping (more follow soon);
        ``any_source``: the reply may come from another node's service (a forwarded request);
        ``patience``: the wait's deadline in units of :attr:`timeout` (more for a request whose service
        waits on a third rank itself: its own deadline, naming that rank, must pass first).

        Raises:
            TransferError: no reply within the deadline (naming the node, its rank and the request).
            the exception the service reported (a :class:`wire.Failure`), naming the node.
        """
        return self.call_tagged(node, msg, key, spin, linger, any_source, patience)[1]

    def call_tagged(self, node: int, msg: Any, key: Any = None, spin: float | None = None,
                    linger: float = 0.0, any_source: bool = False, patience: float = 1.0,
                    tag: int | None = None) -> tuple[int, Any]:
        """:meth:`call`, also returning the reply tag (bulk frames follow a Data reply on it); ``tag``: the reply
        tag to use (from :meth:`next_tag`: the caller knows it even where the call fails)."""
        dest, tag = self.leaders[node], self.next_tag() if tag is None else tag
        if self._late:
            self._take_late()
        try:
            self._send(node, msg, tag, linger if self.spin else 0.0, key)
        except BaseException:  # the request may still arrive late, and its reply come on this tag
            self.burn(tag, reply=True)
            raise
        spin = self.spin if spin is None else spin
        source = MPI.ANY_SOURCE if any_source else dest  # a reply tag is this rank's alone while the call lasts
        try:
            limit = call_limit(self.timeout * patience)
            # a probe that moved bytes (a frame queued before the reply, over TCP) is followed by the next at once
            if not self._probe(source, tag, spin, _NAP, min(limit, _REPLY_SOON), _REPLY_NAP_MAX, worked=WORKED,
                               partner=self.partners[node]) and (
                    limit <= _REPLY_SOON or not self._probe(source, tag, 0.0, _REPLY_NAP_MAX,
                                                            limit - _REPLY_SOON, _NAP_MAX, worked=WORKED)):
                self.burn(tag, reply=True)
                key = key if key is not None else getattr(msg, "key", None)
                raise out_of_time(f"a {_operation(msg)} request to node {self.names[node]!r}", key, dest) or \
                    self.late(node, f"did not answer a {_operation(msg)} request", self.timeout * patience, key)
            if any_source:
                status = MPI.Status()
                reply = W.receive_reply(self.comm, source, tag, status)
                if status.Get_source() != dest:
                    self.forwarded += 1  # asked one node, answered by another: one message more
            else:
                reply = W.receive_reply(self.comm, source, tag)
            if W.pushed(reply):
                self.owe(tag)  # until its frame's receive is posted (fetch.py) or drained
        except MPI.Exception as exc:
            raise self.failed(node, msg, key, exc) from exc
        # a Ctrl-C while it waited: the reply may still come, never to a later call
        except BaseException:
            self.burn(tag, reply=True)
            raise
        if isinstance(reply, W.Failure):
            raise reply.exception(f"node {self.names[node]!r}", key if key is not None else getattr(msg, "key", None),
                                  dest)
        return tag, reply

    @interruptible
    def wait(self, reqs: list[MPI.Request], node: int, key: Any = None, stop: threading.Event | None = None) -> None:
        """Wait for ``reqs`` (bulk frames from or to ``node``): testing back to back where this rank has a
        core of its own, else after naps (20 us doubling up to 1 ms), so that ranks sharing cores let the
        senders and each other run; ``stop``: give up once it is set (another stream of the transfer
        failed). Ctrl-C raises here at once.

        Raises:
            TransferError: no frame completed for :attr:`timeout` seconds, or ``stop`` was set. The requests
                are left as they are: MPI may still read or write their buffers, so the caller gives them up
                together with that memory (``abandon.give_up``), never frees it at once.
        """
        try:
            done = settle(reqs, self.timeout, self.spin > 0, _NAP, _FRAME_NAP_MAX, stop, call_end())
        except MPI.Exception as exc:
            raise self.failed(node, "transfer", key, exc) from exc
        late = None if done else out_of_time(f"a transfer from node {self.names[node]!r}", key, self.leaders[node])
        if late is not None:
            raise late
        if not done and stop is not None and stop.is_set():
            raise errors.TransferError(f"transfer from node {self.names[node]!r} given up: another of its streams "
                                       f"failed", key if isinstance(key, str) else None, self.leaders[node])
        if not done:
            raise self.late(node, "sent no frame", self.timeout, key)

    def burn(self, tag: int, reply: bool = False) -> None:
        """Never use reply tag ``tag`` again: a call or a transfer on it was given up, and a late reply or
        frame may still come on it (it must not be taken for a later call's). ``reply``: the call's reply was
        not taken; where it comes, this rank's next call takes it (:meth:`_take_late`)."""
        with self._tag_lock:
            self._burnt.add(tag)
            if reply:
                self._late[tag] = time.monotonic() + 2 * self.timeout
                if self._sweeper is None and not self._closed.is_set():
                    self._sweeper = threading.Thread(target=self._sweep_late, name="shmstore-mpi-late",
                                                     daemon=True)
                    self._sweeper.start()

    def _sweep_late(self) -> None:
        """Take the late replies every ``_LATE_EVERY`` seconds while some may come, also where this rank makes
        no call (it computes for hours after a get gave up): each holds its holder's pin (a pushed frame's
        for ever: MPI cannot cancel a send) until taken."""
        while True:
            self._closed.wait(_LATE_EVERY)
            with self._tag_lock:
                if not self._late or self._closed.is_set():
                    if not self._closed.is_set():  # (closing: stop_watching joins it)
                        self._sweeper = None
                    return
            self._take_late(sweeper=True)

    def _take_late(self, sweeper: bool = False) -> None:
        """Take the replies that came on the tags of calls given up, and give back what they pinned: a lookup
        answered after its asker gave up (a get's timeout, a Ctrl-C) named a large object pinned for a Data
        request that never comes, and the holder kept that pin, and the object's memory with it though it was
        deleted, until its handle expired (``HANDLE_TTL``, 120 s). Posted: the holder answers nothing. A tag is
        looked at until its reply came, or for twice ``timeout`` (the holder let the pin go by then). ``sweeper``:
        the sweeper thread's look, which never touches the communicator once the cluster closes."""
        if not self._sweeping.acquire(blocking=False):  # another thread of this rank is at it
            return
        try:
            if sweeper and (self._closed.is_set() or self.comm == MPI.COMM_NULL):  # (freed without stop_watching)
                return
            status, now = MPI.Status(), time.monotonic()
            for tag, until in list(self._late.items()):
                if not self.comm.iprobe(MPI.ANY_SOURCE, tag, status):
                    if now > until:
                        del self._late[tag]
                    continue
                source = status.Get_source()
                reply = W.receive_reply(self.comm, source, tag)
                del self._late[tag]
                for found in W.pushed(reply):
                    self.drain(source, found)
                if source in self.leaders:
                    for handle in W.handles(reply):
                        self._send(self.leaders.index(source), W.Release(handle), 0, 0.0)
        # a node gone (nothing of it to give back), a reply that does not decode: the call that swept goes on
        except Exception:
            pass
        finally:
            self._sweeping.release()

    def drain(self, peer: int, found: W.Found) -> None:
        """Take and drop the frame rank ``peer`` pushed with its answer ``found`` where this rank will not use
        it (a get given up before the answer came; another rank of this node fetches the object; it is here
        already): its holder keeps the object pinned until MPI is done with the frame, and MPI cannot cancel
        a send. Never waits: the receive lands in a buffer of its own, dropped once it is over (``abandon.py``;
        cancelled after ``timeout`` where it never is)."""
        if self.frames is None or not found.pushed:
            return
        tag, sink, began = found.pushed, np.empty(found.nbytes, np.uint8), time.monotonic()
        self.owe(tag)
        try:
            req = self.frames.Irecv([sink, MPI.BYTE], source=peer, tag=tag)
        except MPI.Exception:  # the holder is gone: nothing pinned is left (the tag is never used again)
            self.burn(tag)
            return

        def over() -> None:
            # taken: the tag is free again; cancelled after ``timeout`` (this rank stopped that long): the frame
            # may still come, and must never be taken for a later call's
            if time.monotonic() - began < self.timeout:
                self.paid(tag)
            else:
                self.burn(tag)
        give_up([req], release=over, keep=sink, drain=self.timeout)

    @interruptible
    def barrier(self, reqs: list[MPI.Request], what: str = "barrier") -> None:
        """Wait for ``reqs`` (an ``Ibarrier``) as long as it takes, like MPI's own collectives: the other ranks
        may compute for hours before they reach it. Testing back to back for the spin window where this rank
        has a core of its own, then after naps (20 us doubling up to 1 ms). Ctrl-C raises here at once (the
        store's signal handler does not wait for a barrier to end: it holds nothing of the store).

        Raises:
            TransferError: a rank left the cluster by an exception (:meth:`say_left`): it never comes.
        """
        watch = self._watch_left()
        spin_until, nap = None, _NAP
        while True:
            if MPI.Request.Testall(reqs):
                return
            if watch.Test():
                raise self._left_error(what)
            if self.spin > 0:
                now = time.monotonic()
                spin_until = spin_until or now + self.spin
                if now < spin_until:
                    continue
            time.sleep(nap)
            nap = min(nap * 2, _NAP_MAX)

    def say_left(self, exc: BaseException | None) -> None:
        """Tell every other rank that this one left the cluster by the exception ``exc`` (a small message to
        each, never waited for): their :meth:`barrier` (a cluster's ``close`` and ``barrier``) then raises
        instead of waiting for ever for a rank that will not come."""
        what = f"{type(exc).__name__}: {exc}" if exc is not None else "an exception"
        note = repr((self.comm.rank, what[:_LEFT_NOTE - 64])).encode()[:_LEFT_NOTE]
        for r in range(self.comm.size):
            if r != self.comm.rank:
                try:
                    self._notes.append(self.comm.Isend([note, MPI.BYTE], dest=r, tag=T.TAG_LEFT))
                except MPI.Exception:  # that rank is gone already
                    continue

    def stop_watching(self) -> None:
        """Withdraw the receive of other ranks' departures and drop the replies that came late, on the tags of
        calls that gave up (the cluster closes collectively: every service has stopped; MPI warns at exit of
        messages never received)."""
        if self._watch is not None:
            give_up([self._watch], keep=self._note)
            self._watch = None
        with self._tag_lock:
            self._closed.set()  # the sweeper of late replies leaves
            sweeper = self._sweeper
        if sweeper is not None:  # before the communicator is freed: a probe on a freed one aborts the job
            sweeper.join(self.timeout)
        swept = self._sweeping.acquire(timeout=self.timeout)  # a look of another thread's is over
        try:
            with self._tag_lock:
                burnt = sorted(self._burnt)
            status = MPI.Status()
            for tag in burnt:
                while self.comm.iprobe(MPI.ANY_SOURCE, tag, status):
                    source = status.Get_source()
                    for found in W.pushed(W.receive_reply(self.comm, source, tag)):
                        self.drain(source, found)
        finally:
            if swept:
                self._sweeping.release()

    def _watch_left(self) -> MPI.Request:
        if self._watch is None:
            self._watch = self.comm.Irecv([self._note, MPI.BYTE], source=MPI.ANY_SOURCE, tag=T.TAG_LEFT)
        return self._watch

    def _left_error(self, what: str) -> errors.TransferError:
        text = bytes(self._note).rstrip(b"\0").decode(errors="replace")
        try:
            rank, why = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            rank, why = -1, text
        node = next((self.names[i] for i, leader in enumerate(self.leaders) if leader == rank), None)
        where = f"rank {rank}" + (f" (leader of node {node!r})" if node is not None else "")
        return errors.TransferError(f"{what} of the cluster failed: {where} left it by an exception ({why}), so "
                                    f"this collective call can never complete; leave the cluster by an exception "
                                    f"too (this one, uncaught, ends the job)", None, rank)

    def late(self, node: int, what: str, waited: float, key: Any = None) -> errors.TransferError:
        """The error of a wait on ``node`` that passed its deadline: ``what`` it did not do, naming the node, its
        rank and the setting (:class:`Cluster`'s verbs add which operation of which key gave up)."""
        rank = self.leaders[node]
        return errors.TransferError(f"node {self.names[node]!r} (rank {rank}) {what} within {waited:g} s: that "
                                    f"rank died, hangs or cannot be reached ({_SETTING}){gil_hint()}",
                                    key if isinstance(key, str) else None, rank)

    def failed(self, node: int, msg: Any, key: Any, exc: BaseException) -> errors.TransferError:
        """The error of an MPI call about ``node`` that failed (MPI reports that rank gone, on transports
        that do), naming the node, its rank and the request (``msg``: a message, or what was under way)."""
        what = msg if isinstance(msg, str) else f"a {_operation(msg)} request"
        key = key if key is not None else getattr(msg, "key", None)
        rank = self.leaders[node]
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return errors.TransferError(f"node {self.names[node]!r} (rank {rank}): MPI failed in {what}, that rank "
                                    f"may have died ({first})", key if isinstance(key, str) else None, rank)

    def _send(self, node: int, msg: Any, tag: int, linger: float, key: Any = None) -> None:
        """Send request ``msg`` to ``node``'s service: a small one at once (MPI buffers it); one that may pass
        MPI's eager size (a remote writer's bytes, a batch) without blocking, waited for with the deadline
        (a blocking send waits for the receiver: for ever if it died)."""
        try:
            if type(msg) not in _BULKY and not (type(msg) is W.DirAdd and len(msg.keys) > 8):  # a put's: small
                W.request(self.comm, msg, self.leaders[node], tag, linger)  # buffered at once
                if self.bells is not None:
                    self.bells.sent(node)
                return
            req = W.request_nowait(self.comm, msg, self.leaders[node], tag, linger)
        except MPI.Exception as exc:
            raise self.failed(node, msg, key, exc) from exc
        if self.bells is not None:
            self.bells.sent(node)
        try:
            done = settle([req], self.timeout, self.spin > 0, _NAP, _NAP_MAX, end=call_end())
        # MPI failed it, or a Ctrl-C: the request holds the pickled bytes MPI may still read
        except BaseException as exc:
            give_up([req])
            if isinstance(exc, MPI.Exception):
                raise self.failed(node, msg, key, exc) from exc
            raise
        if not done:
            give_up([req])
            key = key if key is not None else getattr(msg, "key", None)
            raise out_of_time(f"a {_operation(msg)} request to node {self.names[node]!r}", key,
                              self.leaders[node]) or \
                self.late(node, f"did not take a {_operation(msg)} request", self.timeout, key)

    def post(self, node: int, msg: Any) -> None:
        """Send ``msg`` to ``node``'s service without waiting for (or getting) a reply. Messages a rank
        sends to one node arrive in the order sent (and are handled in that order).

        Raises:
            TransferError: the message was not taken within the deadline.
        """
        self._send(node, msg, 0, 0.0)
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



_BULKY = frozenset({W.Write, W.LookupMany, W.DirSourceMany, W.DirDoneMany})  # may pass MPI's eager size


def _operation(msg: Any) -> str:
    """What request ``msg`` asked, in words: ``Lookup`` -> "lookup", ``DirSourceMany`` -> "dir source many"."""
    name = type(msg).__name__
    return "".join(" " + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def gave_up(exc: errors.TransferError, operation: str, key: Any) -> None:
    """Start the message of ``exc`` (about to be raised again) with the operation that failed and its key
    (once: an operation made of others keeps the name of the one that failed first)."""
    if getattr(exc, "operation", None) is None:
        what = repr(key) if isinstance(key, str) else f"{len(key)} keys ({', '.join(map(repr, key[:3]))}" \
            f"{', ...' if len(key) > 3 else ''})"
        exc.args = (f"{operation} of {what} failed: {exc.args[0] if exc.args else exc}",) + exc.args[1:]
        vars(exc)["operation"] = operation
        if exc.object_id is None and isinstance(key, str):
            exc.object_id = key
