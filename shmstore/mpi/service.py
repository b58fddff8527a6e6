"""The service of one node: answers other ranks' requests for this node's objects.

One per node, run as a daemon thread by the node's leader rank, on the
cluster's private communicator. It waits for requests in C with the GIL
released (``poll.py``): probing back to back for a moment after each request
(where the host has a core to spare; longer where the request asks it to
linger: a batch's next request comes soon), then after naps from 50 us
doubling to 200 us while requests come at their recent pace (``poll.Pace``:
eight times the recent gap between requests, 5 ms to 0.5 s: a loop of remote
gets keeps it, one fetch and then silence lets it go within 5 ms), and after
that, idle, it sleeps in the kernel on its doorbell (``doorbell.py``: a
request after silence rings it awake, and every 10 ms it looks at MPI
anyway; every nap is a sleep on the doorbell too, so a rung request ends
it); its thread asks the scheduler for short slices, so that a ring or a
nap's end takes the core from a computing or MPI-spinning rank at once.
With ``SHMSTORE_DOORBELL=0`` it probes every 1 ms where every core
of the host has a rank (on a 2-core VM, 200 us naps held for half a second
after each request cost the ranks' Python 15-40% of their speed), every 50
us where a core is spare (``poll.idle_nap``).
A service starts idle: nothing probes busily before the first request. An idle node so costs
next to no CPU and never takes the GIL from the application, instead of
spinning in a blocking receive (MPICH busy-polls, and a spinning thread
would steal a core from every rank of the node). Bulk sends run in threads
of their own, and replies that may pass MPI's eager size go out without
waiting for their requester (``outbox.py``), so lookups and directory
requests are answered while large objects stream out.

A bulk send pins the source object (a lease) from the LOOKUP that
announced it until its frames are sent, so the spill process cannot move it
and a delete is deferred; a lease the requester never collects expires after
``HANDLE_TTL`` seconds. Pulls (a migration into this node) run in their own
thread, so this loop never waits on another node's service.

Nothing here waits for ever on a rank that died: a bulk send whose receiver
takes no frame for ``peer_timeout`` seconds is given up, and so is a reply
the requester never takes (``outbox.py``); pulls wait as any fetch does (see
``rpc.py``). A send given up on keeps its lease, the source's pin, until MPI
is done with it (``abandon.py``): a receiver that was only stopped reads the
source when it wakes, so the space must not be reused before.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from mpi4py import MPI

from .. import errors
from ..levels.device import to_host
from ..meta import layout as L
from ..primitives import native
from . import abandon
from . import tags as T
from . import wire as W
from .abandon import give_up
from .cuda import cuda_aware
from .dirclient import DirectoryClient
from .directory import WAIT, Directory
from .doorbell import SAFETY, Bells, Doorbell
from .fetch import Fetcher
from .links import Links
from .outbox import Outbox
from .poll import URGENT_GIL, WORKED, Pace, Ring, Urgency, prober, python_prober, ring_origin, settle
from .poll import native as is_native
from .staging import send_staged

if TYPE_CHECKING:
    from ..store import Store
    from ..streams import Writer

__all__ = ["Service", "HANDLE_TTL"]

HANDLE_TTL = 120.0
_NO_REPLY = object()
_SENDER = "shmstore-mpi-send"  # the name of bulk-send threads
# a pushed frame's first seconds: its sender's probes move its bytes without naps between them (see _loop); past
# this, a frame not taken yet waits for a stopped or busy receiver, and the loop naps as for any send under way
_PUSH_FRESH = 0.05
_PUSH_DRIVE = 2e-3  # how long the loop tests a frame it just pushed before it probes again (see _start_pushes)
_BUSY_PAUSE = 50e-6   # the first nap after the spin window; naps double up to _ACTIVE_PAUSE
# the longest nap while requests come at their recent pace (poll.Pace's window)
_ACTIVE_PAUSE = 200e-6
# probe interval of an idle node where every core computes (poll.idle_nap: 50 us where
_IDLE_PAUSE = 1e-3
                      # the host has a core to spare): the first request after a pause waits <= 1 ms
_LINGER_MAX = 0.005   # the longest spin a request may ask for (its linger)
_SLICE_NS = 100_000  # the scheduler slice the loop's thread asks for (the shortest Linux grants)
_RUNG = 0.005  # after a ring, how long the request it announced may take to land before the loop sleeps again


class Service:
    """Serves this node's ``store`` over ``links`` (its share of the directory: ``dirs.local``; pulls into the
    node through ``fetcher``); owned by the leader's Cluster (``close`` stops it).

    Thread-safe towards the Cluster: it only uses the store's thread-safe API.
    """

    def __init__(self, links: Links, dirs: DirectoryClient, store: Store, fetcher: Fetcher,
                 spin: float = 0.0, idle: float = _IDLE_PAUSE, bell: Doorbell | None = None,
                 bells: Bells | None = None) -> None:
        if dirs.local is None:
            raise errors.InvalidArgumentError("a node service needs the node's share of the directory")
        self.comm = links.comm
        self.links = links
        self.spin = spin
        # seconds between probes once requests stopped coming at their pace (poll.idle_nap)
        self.idle = idle
        self.store = store
        self.kernel = store.kernel
        self.fetcher = fetcher
        self.timeout: float = store.config.peer_timeout
        self._ids = itertools.count(1)
        self._leases: dict[int, tuple[Any, float]] = {}  # handle -> (lease: host or device bytes, deadline)
        # frames pushed with lookups' answers, tended by the loop: (request, lease: the pin, when it went)
        self._pushes: list[tuple[MPI.Request, Any, float]] = []
        # frames a lookup promised to push, started once its answer went (see _push)
        self._promised: list[tuple[Any, int, int]] = []
        self._writers: dict[int, Writer] = {}
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []  # pulls and bulk sends under way
        self._outbox = Outbox(self.comm, self.timeout)  # replies and posts not yet taken by their receivers
        # idle, the loop sleeps on its doorbell (doorbell.py); its own posts ring the nodes they go to
        self.bell = bell
        if bells is not None:
            node_of = {rank: node for node, rank in enumerate(links.leaders)}
            self._outbox.ring = lambda rank: bells.sent(node_of[rank]) if rank in node_of else None
        # bytes sent inside replies, counted once the reply is out (off the reply's path)
        self._sent_later = 0
        # ranks on this machine (one kernel: their threads may share this thread's CPUs), set by the Cluster
        # once every rank said where it runs; the loop's spin after answering one gives way to the asking
        # thread where it waits for the same CPU (poll.prober's partner)
        self.near: frozenset[int] = frozenset()
        self.directory: Directory = dirs.local  # this node's share of the location directory (see directory.py)
        self._handlers: dict[type, Callable[[int, int, Any], Any]] = {
            W.Lookup: self._on_lookup, W.LookupMany: self._on_lookup_many, W.Data: self._on_data,
            W.Release: self._on_release, W.Has: self._on_has, W.Delete: self._on_delete, W.Pull: self._on_pull,
            W.Read: self._on_read,
            W.WriterOpen: self._on_writer_open, W.Write: self._on_write, W.WriterClose: self._on_writer_close,
            W.Forward: self._on_forward, W.DirSource: self._on_dir_source, W.DirSourceSmall: self._on_dir_source_small}
        for kind in (W.DirAdd, W.DirDrop, W.DirGet, W.DirTake, W.DirReplace, W.DirSourceFor, W.DirDone,
                     W.DirSourceMany, W.DirDoneMany, W.DirCopies, W.DirSettle):
            self._handlers[kind] = self._on_directory
        self._thread = threading.Thread(target=self._loop, name="shmstore-mpi-service", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def thread_id(self) -> int:
        """The loop's thread id on this machine (0 before :meth:`start`)."""
        return self._thread.native_id or 0

    @property
    def sending(self) -> bool:
        """Whether a bulk send is under way (its requester's next request, a registration, comes soon)."""
        return any(t.name == _SENDER and t.is_alive() for t in self._workers)

    def close(self, wait: float = 60.0) -> None:
        """Stop serving (once nobody sends requests any more); idempotent. Drops uncollected leases and
        aborts remote writers. ``wait``: seconds to give the loop, and each pull or send under way, to end
        (short where the cluster is left by an exception: the job is about to end)."""
        if not self._stop.is_set() and self._thread.is_alive():
            self._stop.set()
            stop = W.request_nowait(self.comm, W.Stop(), self.comm.rank, 0)  # the loop ends on it; a send to
            if self.bell is not None:
                self.bell.ring_self()
            self._thread.join(wait)  # this very rank completes only once received: never blocking on it
            if not stop.Test():
                give_up([stop])
        self._stop.set()
        if self.bell is not None and not self._thread.is_alive():
            self.bell.close()
        for t in self._workers:
            t.join(wait)
        self._leases.clear()
        for w in self._writers.values():
            w.abort()
        self._writers.clear()

    # ---- loop ------------------------------------------------------------------
    def _loop(self) -> None:
        probe = prober(self.comm)
        urgency = Urgency(native=is_native(probe))  # the GIL comes back within URGENT_GIL while it is wanted
        try:
            self._serve(probe, urgency)
        finally:
            urgency.off()

    def _serve(self, probe: Callable[..., bool], urgency: Urgency) -> None:
        native.set_timer_slack(2000)  # this thread's 50 us naps then last ~55 us, not ~105
        # woken (a ring, a nap's end) it takes the core from a rank's compute or MPI spin at once, not at the end
        # of that thread's slice (Linux 6.12+; elsewhere nothing changes)
        native.set_slice(_SLICE_NS)
        self._outbox.own()
        status = MPI.Status()
        pace = Pace()  # idle from the start: no busy window before any request
        spin = self.spin
        idle_nap = self.idle
        # with a doorbell every nap is a sleep on it too: a request whose sender rang is seen at the ring, not
        # at the nap's end; after a ring the loop probes closely for _RUNG (the request may come after its ring)
        ring = None if self.bell is None else Ring(self.bell.sock.fileno(), spin, _BUSY_PAUSE, _ACTIVE_PAUSE, _RUNG)
        rung_here = ring_origin()
        partner = 0  # the thread of this machine that sent the last request (see near)
        while True:
            idle = time.monotonic() - pace.last
            if self._outbox.out or self._outbox.handed:
                self._outbox.tend()
            if self._pushes:
                self._tend_pushes()
            try:
                if self._outbox.out or self.sending or self._pushes:
                    # a transfer's next request (its registration) comes as soon as the bytes are out; while a
                    # frame pushed in the last _PUSH_FRESH s is under way, a probe that took long moved its bytes
                    # (over TCP the sender's own MPI calls move them) and the next follows at once
                    fresh = WORKED if self._pushes and time.monotonic() - self._pushes[-1][2] < _PUSH_FRESH else 0.0
                    ready = probe(MPI.ANY_SOURCE, T.TAG_REQUEST, spin, _BUSY_PAUSE, 0.002, ring=ring, worked=fresh,
                                  urgent=URGENT_GIL, partner=partner)
                    pace.last = time.monotonic()
                elif idle < pace.window:
                    ready = probe(MPI.ANY_SOURCE, T.TAG_REQUEST, spin, _BUSY_PAUSE, pace.window - idle,
                                  max(min(_ACTIVE_PAUSE, idle_nap), _BUSY_PAUSE), ring=ring, urgent=URGENT_GIL,
                                  partner=partner)
                # asleep only while MPI has nothing of this process in flight: a transfer given up on still
                # moves its bytes only inside MPI calls (over TCP, the replies queue behind them), so with
                # held requests the loop probes at its idle pace as before
                elif ring is not None and not abandon.held():
                    # asleep in the kernel until a request rings (or the safety net's time): no CPU, no GIL
                    ready = probe(MPI.ANY_SOURCE, T.TAG_REQUEST, 0.0, SAFETY, SAFETY, ring=ring, urgent=URGENT_GIL)
                else:
                    ready = probe(MPI.ANY_SOURCE, T.TAG_REQUEST, 0.0, idle_nap, 1.0, ring=ring, urgent=URGENT_GIL)
            except (errors.TransferError, OverflowError, OSError):  # the C prober failed: probe from Python
                probe = python_prober(self.comm)
                urgency.python()
                continue
            # MPI reports a failure (a rank died, on transports that say so): go on
            except MPI.Exception:
                time.sleep(_IDLE_PAUSE)
                continue
            if not ready:
                if not (self._outbox.out or self.sending or self._pushes):  # idle, not only between requests
                    urgency.off()
                spin = self.spin
                if idle > 1.0:
                    self._expire()
                continue
            urgency.on()
            pace.request(time.monotonic())
            reply_tag, msg, linger, thread = W.receive(self.comm, MPI.ANY_SOURCE, T.TAG_REQUEST, status)
            spin = max(self.spin, min(float(linger), _LINGER_MAX)) if self.spin else 0.0
            if ring is not None and rung_here():  # woken on the asker's own core, where it waits: no spin there
                spin = 0.0
            src = status.Get_source()
            partner = thread if src in self.near else 0
            if isinstance(msg, W.Stop):
                self._drain(status)
                return
            try:
                reply = self.handle(src, reply_tag, msg)
                if reply is not _NO_REPLY and reply_tag:
                    self._outbox.reply(reply, src, reply_tag)
            finally:
                if self._promised:
                    self._start_pushes()
            if self._sent_later:
                self._count_sent(self._sent_later)
                self._sent_later = 0

    def _drain(self, status: MPI.Status) -> None:
        """Handle what was posted before the cluster's closing barrier (a fetch's DirDone) but came after
        our own Stop: nothing is left unreceived on the communicator when it is freed; and see the last
        replies out (their requesters took them before the barrier)."""
        deadline = time.monotonic() + 0.05
        while time.monotonic() < deadline:
            if not self.comm.iprobe(MPI.ANY_SOURCE, T.TAG_REQUEST, status):
                time.sleep(0.001)
                continue
            reply_tag, msg, _, _ = W.receive(self.comm, status.Get_source(), T.TAG_REQUEST)
            if not reply_tag:
                self.handle(status.Get_source(), 0, msg)
                if self._promised:  # a Forward answered its fetcher inside the handler: the frame follows (_push)
                    self._start_pushes()
        self._tend_pushes(give_up_all=True)  # taken before the barrier, or drained by their askers
        self._outbox.drain(10.0)

    def handle(self, src: int, tag: int, msg: Any) -> Any:
        """The reply to request ``msg`` from rank ``src`` (or ``_NO_REPLY``: answered elsewhere); a
        :class:`wire.Failure` where it failed."""
        try:
            return self._handlers[type(msg)](src, tag, msg)
        except Exception as exc:  # a bad request must not kill the node's service
            return W.Failure.of(exc)

    def _expire(self) -> None:
        now = time.monotonic()
        for h in [h for h, (_, deadline) in self._leases.items() if deadline < now]:
            del self._leases[h]

    def _spawn(self, name: str, run: Callable[[], None]) -> None:
        """Run ``run`` in a thread of its own (a pull or a bulk send): this loop never waits on it. The list
        keeps only live threads: the loop scans it for senders before every probe."""
        t = threading.Thread(target=run, name=name, daemon=True)
        self._workers = [w for w in self._workers if w.is_alive()] + [t]
        t.start()

    # ---- handlers --------------------------------------------------------------
    def _on_lookup(self, src: int, tag: int, msg: W.Lookup) -> W.Found | None:
        found, sent = self._lookup(msg.key, msg.inline_max, (src, tag, msg.push_max))
        self._sent_later += sent
        return found

    def _on_lookup_many(self, src: int, tag: int, msg: W.LookupMany) -> W.FoundMany:
        out, sent = [], 0
        for key in msg.keys:
            found, n = self._lookup(key, msg.inline_max)
            out.append(found)
            sent += n
        self._sent_later += sent
        return W.FoundMany(out)

    def _lookup(self, key: str, inline_max: int, push: tuple[int, int, int] | None = None
                ) -> tuple[W.Found | None, int]:
        """What a Lookup of ``key`` finds (None: nothing), and the bytes it carries inline. ``push``: (the
        asking rank, its reply tag, its ``push_max``): a larger object of at most ``push_max`` bytes in host
        memory goes to it at once, as one frame on that tag (``Found.pushed``), not at a Data request."""
        try:
            x = self.kernel.export(key, inline_max)
        except errors.ObjectNotFoundError:
            return None, 0
        if x.inline is not None:
            return W.Found(x.kind, x.nbytes, x.nblobs, x.array_meta, x.inline, 0), len(x.inline)
        if push is not None and 0 < x.nbytes <= push[2] and push[1] and self._push(x.lease, push[0], push[1]):
            return W.Found(x.kind, x.nbytes, x.nblobs, x.array_meta, None, 0, push[1]), 0
        h = next(self._ids)
        self._leases[h] = (x.lease, time.monotonic() + HANDLE_TTL)
        return W.Found(x.kind, x.nbytes, x.nblobs, x.array_meta, None, h), 0

    def _push(self, lease: Any, dest: int, tag: int) -> bool:
        """Promise the leased host object to rank ``dest`` as one frame on ``tag``: the loop starts its send
        right after the answer that says so went (:meth:`_start_pushes`), so the answer never queues behind the
        frame's bytes (over TCP it did: a 1 MiB get's answer came after the whole frame, ~1 ms here), and tends it
        (:meth:`_tend_pushes`: no thread to start, which delayed the answer by ~0.5 ms here), dropping the lease,
        the pin, once it went. False (nothing promised) for device memory (it goes at a Data request)."""
        if hasattr(lease, "__cuda_array_interface__"):
            return False
        self._promised.append((lease, dest, tag))
        return True

    def _start_pushes(self) -> None:
        """Start the sends of the frames promised by the request just answered (:meth:`_push`)."""
        promised, self._promised = self._promised, []
        for lease, dest, tag in promised:
            try:
                req = self.links.bulk[0].Isend([lease[0: lease.nbytes], MPI.BYTE], dest=dest, tag=tag)
            except MPI.Exception:  # the asker is gone: nothing waits for the frame (the lease, the pin, goes)
                continue
            self._pushes.append((req, lease, time.monotonic()))
            # move its bytes now, for up to _PUSH_DRIVE: over TCP only the sender's own MPI calls move them
            # (left to the loop's probes, a 1 MiB frame took ~0.9 ms there, ~0.4 ms so); the rest, or a frame
            # whose asker is stopped, is left to the loop (_tend_pushes)
            end = time.monotonic() + _PUSH_DRIVE
            try:
                while not req.Test() and time.monotonic() < end:
                    pass
            except MPI.Exception:  # its receiver died: _tend_pushes gives it up
                pass

    def _tend_pushes(self, give_up_all: bool = False) -> None:
        """Drop the leases of the pushed frames that went; give up those the asker took nothing of for
        ``peer_timeout`` seconds (it died or hangs: the pin stays until MPI is done with the frame, as a
        stopped asker still reads it when it wakes), or all of them with ``give_up_all``."""
        now, left = time.monotonic(), []
        for req, lease, since in self._pushes:
            try:
                done: bool | None = req.Test()
            except MPI.Exception:  # its receiver died
                done = None
            if done:
                self._count_sent(lease.nbytes)
            elif done is None or give_up_all or now - since > self.timeout:
                give_up([req], keep=lease)
            else:
                left.append((req, lease, since))
        self._pushes = left

    def _on_data(self, src: int, tag: int, msg: W.Data) -> Any:
        entry = self._leases.pop(msg.handle, None)
        if entry is None:
            raise errors.TransferError(f"transfer handle {msg.handle} expired (after {HANDLE_TTL:g} s)")
        lease = entry[0]
        bulk = self.links.bulk
        streams = max(1, min(int(msg.streams), len(bulk)))
        plan = T.frames(lease.nbytes, msg.block, streams)
        staged = hasattr(lease, "__cuda_array_interface__") and not cuda_aware()  # device bytes via host blocks
        reqs: list[MPI.Request] = []
        if not staged:
            # host memory, or device memory handed to a CUDA-aware MPI as it is: the frames are posted here,
            # before the reply, so the requester's receives find them waiting (a thread started for them
            # first ran 0.2-4 ms later on 2 busy cores, the frames with it); a thread waits for them to go
            try:
                for i, (pos, n) in enumerate(plan):
                    reqs.append(bulk[i % streams].Isend([lease[pos: pos + n], MPI.BYTE], dest=src, tag=tag))
            except MPI.Exception:  # the requester is gone: nothing to answer
                give_up(reqs, keep=lease)
                return _NO_REPLY
        self._outbox.reply(lease.nbytes, src, tag)

        def send() -> None:
            try:
                if staged:
                    send_staged(bulk[:streams], src, tag, plan, lambda pos, n, b: to_host(b, lease[pos: pos + n]),
                                wait=lambda reqs: self._sent(reqs, src))
                else:
                    self._sent(reqs, src)
            except (errors.TransferError, MPI.Exception):
                # the requester died or hangs: its frames are given up, and the lease (the pin of the source
                # object) goes only once MPI is done with them: a receiver that wakes later still reads it
                give_up(reqs, keep=lease)
                return
            self._count_sent(lease.nbytes)

        self._spawn(_SENDER, send)
        return _NO_REPLY

    def _sent(self, reqs: list[MPI.Request], dest: int) -> None:
        """Wait for the sends ``reqs`` to rank ``dest`` without spinning (the receiver copies; this end sees
        them finish).

        Raises:
            TransferError: ``dest`` took no frame for ``peer_timeout`` seconds (the sends are left live: the
                caller gives them up with their source, ``abandon.give_up``).
        """
        try:
            done = settle(reqs, self.timeout, False, _BUSY_PAUSE, _BUSY_PAUSE)
        except MPI.Exception:  # MPI failed a send (the receiver died)
            done = False
        if not done:
            raise errors.TransferError(f"rank {dest} took no frame within {self.timeout:g} s: it died, hangs or "
                                       f"cannot be reached (raise peer_timeout= / SHMSTORE_PEER_TIMEOUT)", None, dest)

    def _on_release(self, src: int, tag: int, msg: W.Release) -> None:
        self._leases.pop(msg.handle, None)

    def _on_has(self, src: int, tag: int, msg: W.Has) -> bool:
        return msg.key in self.store

    def _on_delete(self, src: int, tag: int, msg: W.Delete) -> bool:
        try:
            self.kernel.delete(msg.key, False, msg.version)
            return True
        except errors.ObjectNotFoundError:
            return False

    def _on_pull(self, src: int, tag: int, msg: W.Pull) -> Any:
        def run() -> None:
            try:
                self.fetcher.fetch_one(msg.key, msg.source, None, msg.block, source_version=msg.version)
                reply: Any = None
            except Exception as exc:
                reply = W.Failure.of(exc)
            self._outbox.reply(reply, src, tag)
        self._spawn("shmstore-mpi-pull", run)
        return _NO_REPLY

    def _on_directory(self, src: int, tag: int, msg: Any) -> Any:
        """A directory request: answered at once, or (a DirSource waiting for a free holder) later."""
        def answer(value: Any) -> None:
            if tag:
                self._outbox.reply(value, src, tag)
        result = self.directory.handle(msg, answer)
        if result is WAIT:
            return _NO_REPLY
        # a posted registration: the copies of keys deleted or replaced while they came go here
        if not tag:
            if result is False and isinstance(msg, W.DirDone) and msg.version is not None:
                self._drop_version(msg.node, msg.key, msg.version)
            elif isinstance(msg, W.DirDoneMany):
                for key, version in result.copies:
                    self._drop_version(msg.node, key, version)
        return result

    def _on_dir_source(self, src: int, tag: int, msg: W.DirSource) -> Any:
        """A DirSource: where the home (this node) is the holder named, its answer carries the lookup."""
        result = self._on_directory(src, tag, msg)
        if msg.inline_max and type(result) is W.Source and result.node == self.links.node:
            return self._sourced(msg.key, msg.inline_max, (src, tag, msg.push_max))
        return result

    def _on_dir_source_small(self, src: int, tag: int, msg: W.DirSourceSmall) -> Any:
        """A DirSourceSmall: answered with the lookup where this node holds it, by the holder where a third
        node does (a Forward: one hop less than a Lookup of the fetcher's own)."""
        result = self._on_directory(src, tag, msg)
        if type(result) is not W.Source:  # none, or waiting
            return result
        if result.node == self.links.node:
            return self._sourced(msg.key, msg.inline_max, (src, tag, msg.push_max))
        if tag:
            self._outbox.post(W.Forward(msg.key, msg.inline_max, src, tag, msg.push_max),
                              self.links.leaders[result.node])
            return _NO_REPLY
        return result

    def _sourced(self, key: str, inline_max: int, push: tuple[int, int, int] | None = None) -> W.Sourced:
        found, sent = self._lookup(key, inline_max, push)
        self._sent_later += sent
        return W.Sourced(self.links.node, found)

    def _on_forward(self, src: int, tag: int, msg: W.Forward) -> Any:
        """Answer the fetcher whose DirSource the home forwarded here (it waits on its own reply tag)."""
        try:
            reply: Any = self._sourced(msg.key, msg.inline_max, (msg.rank, msg.tag, msg.push_max))
        except Exception as exc:  # the fetcher hears of it, as from a Lookup of its own
            reply = W.Failure.of(exc)
        self._outbox.reply(reply, msg.rank, msg.tag)
        return _NO_REPLY

    def _drop_version(self, node: int, key: str, version: float) -> None:
        """Delete the object ``version`` of ``key`` on node ``node`` without waiting: here at once, elsewhere by a
        posted Delete (never a newer object under the key)."""
        if node == self.links.node:
            self.kernel.delete(key, True, version)
        else:
            self._outbox.post(W.Delete(key, version), self.links.leaders[node])

    def _on_read(self, src: int, tag: int, msg: W.Read) -> W.Chunk:
        with self.store.open_reader(msg.key) as r:
            r.seek(msg.offset)
            data = r.read(msg.n)
            size = r.size
        self._count_sent(len(data))
        return W.Chunk(size, data)

    def _on_writer_open(self, src: int, tag: int, msg: W.WriterOpen) -> int:
        h = next(self._ids)
        self._writers[h] = self.store.open_writer(msg.key, msg.size)
        return h

    def _on_write(self, src: int, tag: int, msg: W.Write) -> None:
        w = self._writers.get(msg.handle)
        if w is None:
            raise errors.StoreClosedError(f"remote writer {msg.handle} is closed")
        try:
            w.write(msg.data)
        except errors.ShmStoreError:
            self._writers.pop(msg.handle).abort()
            raise

    def _on_writer_close(self, src: int, tag: int, msg: W.WriterClose) -> float | None:
        """Seal or drop the writer's object: the sealed object's creation time (None: aborted, or gone)."""
        w = self._writers.pop(msg.handle, None)
        if w is None:
            return None
        if msg.abort:
            w.abort()
            return None
        w.close()
        try:
            return float(self.store.get_info(w.key).created)
        except errors.ObjectNotFoundError:
            return None

    def _count_sent(self, nbytes: int) -> None:
        node = self.kernel.node
        with node.admin:
            L.add_transfer_stats(node.buf, sent=nbytes)
