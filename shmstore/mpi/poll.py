"""Waiting for requests without taxing the application: MPI_Iprobe in C, with the GIL released.

A node's service must notice a request within microseconds while requests
come in, and cost the application nothing while none do. A Python loop of
``iprobe`` and ``sleep`` does neither well: every wake-up takes the GIL from
the leader rank's own Python threads (a pure-Python loop there ran 1.16-1.8x
slower beside an idle service), and a Python-level spin is slow to answer.
:func:`prober` hands the loop to a C extension of its own (``_probe.c``), which calls
``MPI_Iprobe`` of the MPI library mpi4py loaded, with the GIL released:
back to back for a short window after a request (no ``sched_yield``
between probes: a yield per probe made replies come 4x later, at random,
on a 2-core machine), then after naps that double up to a limit, with a
1 us timer slack (Linux lets a 20 us nap last 105 us by default). Where the
extension or the symbol is missing, or ``SHMSTORE_PURE_PYTHON`` is set, it
falls back to a Python loop, with the same behaviour and the old costs.
"""
from __future__ import annotations

import ctypes
import os
import select
import sys
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple

from mpi4py import MPI

from ..config import partner_hop, pure_python, service_idle, service_spin
from ..primitives.interrupts import interruptible

__all__ = ["prober", "python_prober", "ring_origin", "Ring", "spin_window", "idle_nap", "Pace", "quiet_wait",
           "quiet_barrier", "settle", "WORKED", "Urgency", "URGENT_GIL", "native"]

Probe = Callable[..., bool]


class Ring(NamedTuple):
    """A prober's doorbell (``doorbell.py``): the socket ``fd`` its naps sleep on too, and the wait's pace once it
    rings: a probe at once, then back to back for ``spin`` seconds, then after naps from ``nap`` doubling up to
    ``nap_max``, for at least ``window`` seconds more."""
    fd: int
    spin: float
    nap: float
    nap_max: float
    window: float


# the longest stretch the C prober waits before the main thread looks at signals again
_SLICE = 0.1


def _iprobe_address() -> int | None:
    """The address of ``MPI_Iprobe`` in the MPI library this process loaded, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libmpi" in line and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.cast(ctypes.CDLL(path).MPI_Iprobe, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None


def _extension() -> Any:
    """The C extension ``_probe`` (``_probe.c``), or None: not built, or ``SHMSTORE_PURE_PYTHON``."""
    if pure_python():
        return None
    try:
        from . import _probe  # type: ignore[attr-defined]  # built by setup.py where a compiler is
    except ImportError:
        return None
    return _probe


def _probe_wait() -> Callable[..., int] | None:
    """``_probe.probe_wait``, or None (see :func:`_extension`; and where the built extension predates the
    ``partner`` argument: a checkout pulled without rebuilding it)."""
    ext = _extension()
    return None if ext is None or not hasattr(ext, "partner_naps") else ext.probe_wait


def ring_origin() -> Callable[[], bool]:
    """``rung_here() -> bool``: whether the rings the C prober last took on this process's bell came from a
    thread on the CPU the prober ran on (then cleared; ``_probe.c``). A ring over the loopback or a veth pair
    wakes the service on the CPU of the rank that rang, which waits there for the answer, so the service naps
    right after answering instead of spinning on that rank's core. Always False with the Python prober."""
    ext = _extension()
    return (lambda: False) if ext is None else ext.rung_here


def prober(comm: MPI.Comm) -> Probe:
    """``probe(source, tag, spin, nap, limit, nap_max=nap, ring=None, worked=0, urgent=0, partner=0) -> bool``:
    True once a message
    from ``source`` (or ``MPI.ANY_SOURCE``) with ``tag`` waits on ``comm``, False after ``limit`` seconds
    without; probing back to back for ``spin`` seconds, then after naps from ``nap`` seconds doubling up to
    ``nap_max``; ``ring``: a :class:`Ring` whose ring cuts a nap short (the naps are sleeps on its socket too);
    ``worked`` (a reply's wait): a probe that took longer moved bytes, and the next follows without a nap;
    ``urgent`` (a node's service): the GIL's switch interval from where it takes the GIL back (see
    :class:`Urgency`; :func:`native` says whether this prober does that itself); ``partner``: the thread id
    (of this machine; 0: none) of the thread the awaited message depends on (the service that will answer, the
    asker whose next request comes): where that thread waits to run on this very CPU (looked at from 40 us into
    the spin, every 20 us), the spinning thread moves to another CPU it may use that idles (``SHMSTORE_PARTNER_HOP``,
    default on: its affinity without this CPU, then its own again), else naps 20 us; never for any other thread.
    The GIL is released while it waits."""
    probe_wait = _probe_wait()
    if probe_wait is None:
        return python_prober(comm)
    addr = _iprobe_address()
    if addr is None:
        return python_prober(comm)
    ext = _extension()
    if hasattr(ext, "set_hop"):
        ext.set_hop(int(partner_hop()))
    handle = MPI._handleof(comm)

    # holds nothing: a Ctrl-C raises here at once (the caller burns the reply tag)
    @interruptible
    def probe(source: int, tag: int, spin: float, nap: float, limit: float, nap_max: float = 0.0,
              ring: Ring | None = None, worked: float = 0.0, urgent: float = 0.0, partner: int = 0) -> bool:
        bell = (-1, 0, 0, 0, 0) if ring is None else (ring.fd, int(ring.spin * 1e9), int(ring.nap * 1e9),
                                                      int(ring.nap_max * 1e9), int(ring.window * 1e9))
        while True:
            # in slices: the main thread looks at the signals that came (maybe to another thread) between them
            part = min(limit, _SLICE)
            rc = probe_wait(addr, source, tag, handle, int(spin * 1e9), int(nap * 1e9), int(part * 1e9),
                            int(nap_max * 1e9), *bell, int(worked * 1e9), int(urgent * 1e6), partner)
            if rc == 1:
                return True
            if rc < 0:  # MPI's own error, as mpi4py raises it: the caller names the node and rank it was about
                raise MPI.Exception(-rc)
            # the slice passed (a signal's nap cut short counts for nothing: at most one slice more)
            if rc == 0:
                limit -= part
                if limit <= 0:
                    return False
            spin, nap = 0.0, max(nap, nap_max)  # a long wait: its naps have grown already

    probe.native = True  # type: ignore[attr-defined]  # (see native())
    return probe


def native(probe: Probe) -> bool:
    """Whether ``probe`` is the C prober (:func:`prober`), not :func:`python_prober`."""
    return bool(getattr(probe, "native", False))


def python_prober(comm: MPI.Comm) -> Probe:
    """:func:`prober` in Python (where the C extension is missing or disabled): wakes take the GIL."""
    @interruptible
    def probe(source: int, tag: int, spin: float, nap: float, limit: float, nap_max: float = 0.0,
              ring: Ring | None = None, worked: float = 0.0, urgent: float = 0.0, partner: int = 0) -> bool:
        deadline = time.monotonic() + limit
        while True:
            began = time.perf_counter()
            if comm.iprobe(source, tag):
                break
            if time.monotonic() >= deadline:
                return False
            if worked > 0 and time.perf_counter() - began > worked:  # the probe moved bytes: again at once
                continue
            if ring is None:
                time.sleep(nap)
            elif _nap_or_ring(ring.fd, nap):  # rung: the ring's pace, for its window at least
                nap, nap_max = ring.nap, ring.nap_max
                deadline = max(deadline, time.monotonic() + ring.window)
                continue
            nap = min(nap * 2, max(nap, nap_max))
        return True

    return probe


# the GIL's switch interval while a node's service has requests to handle (Python's default: 5 ms)
URGENT_GIL = 100e-6


class Urgency:
    """The GIL's switch interval while a node's service has requests to handle (its probes pass
    ``urgent=URGENT_GIL``): :meth:`on` once a request is in, :meth:`off` once the service is idle again.

    Where the application's main thread computes in Python, the service gets the GIL only once the main thread
    drops it, asked to after the switch interval of waiting: 5 ms by default, and again for every MPI call of the
    request's handling (each releases the GIL, and the main thread takes it meanwhile): gets back to back from a
    holder in pure Python took a median of 8.5-9.5 ms (0.75-0.8 ms at 100 us, mpi/README). ``native`` (the C
    prober, Python before 3.12): the prober itself lowers the interval from where it takes the GIL back, after a
    request or an idle sleep alike, and gives the application's back as it lets the GIL go for its next wait, so
    it is lowered exactly while the service wants or holds the GIL; :meth:`on` does nothing, :meth:`off` gives it
    back. Otherwise :meth:`on` lowers it from Python (after the first wait, at the default interval) and
    :meth:`off` gives it back. An interval the application set shorter stays; one it sets meanwhile is kept."""

    _lowering: weakref.WeakSet[Urgency] = weakref.WeakSet()  # a forked child gives the interval back

    def __init__(self, interval: float = URGENT_GIL, native: bool = False) -> None:
        self.interval = interval
        self.saved: float | None = None  # the interval to give back, while lowered from Python
        ext = _extension()
        self._ext = ext if native and ext is not None and hasattr(ext, "lowers") and ext.lowers() else None
        Urgency._lowering.add(self)

    @property
    def native(self) -> bool:
        """Whether the C prober lowers and gives back the interval itself."""
        return self._ext is not None

    def python(self) -> None:
        """The service probes from Python from now on (the C prober failed): the interval is lowered from here."""
        if self._ext is not None:
            self._ext.give_back()
            self._ext = None

    def on(self) -> None:
        """A request is in: the interval is ``interval`` until :meth:`off`."""
        if self._ext is None and self.saved is None and sys.getswitchinterval() > self.interval:
            self.saved = sys.getswitchinterval()
            sys.setswitchinterval(self.interval)

    def off(self) -> None:
        """The service is idle: the interval it lowered is given back (one the application set meanwhile
        stays)."""
        if self._ext is not None:
            self._ext.give_back()
            return
        if self.saved is None:
            return
        if abs(sys.getswitchinterval() - self.interval) < 1e-7:
            sys.setswitchinterval(self.saved)
        self.saved = None

    @classmethod
    def _after_fork_in_child(cls) -> None:
        """A child forked while a service had the interval lowered (a DataLoader worker forked during a burst)
        has no service to give it back: it gets the application's interval at once."""
        for urgency in list(cls._lowering):
            urgency.off()


os.register_at_fork(after_in_child=Urgency._after_fork_in_child)


def _nap_or_ring(fd: int, nap: float) -> bool:
    """Sleep ``nap`` seconds or until the bell socket ``fd`` (non-blocking) rings: True when rung, every ring
    taken."""
    if not 0 <= fd < 1024:  # past select's limit: a plain nap (the ring is taken by the next C wait, or never)
        time.sleep(nap)
        return False
    try:
        ready = select.select([fd], [], [], nap)[0]
    except (OSError, ValueError):  # closed under us: the nap's time, never a spin
        time.sleep(nap)
        return False
    try:
        while ready and os.read(fd, 64):
            pass
    except OSError:  # BlockingIOError: every ring taken
        pass
    return bool(ready)


@interruptible
def quiet_wait(reqs: list[MPI.Request], first_nap: float = 20e-6, nap_max: float = 1e-3) -> None:
    """Wait for ``reqs`` without spinning: test after naps from ``first_nap`` doubling to ``nap_max`` seconds
    (MPICH's blocking waits busy-poll, taking a core from ranks that share it)."""
    nap = first_nap
    while not MPI.Request.Testall(reqs):
        time.sleep(nap)
        nap = min(nap * 2, nap_max)


# a test or probe that took this long did work (copied or read part of a message), not just looked
WORKED = 10e-6


@interruptible
def settle(reqs: list[MPI.Request], timeout: float, busy: bool, first_nap: float = 20e-6,
           nap_max: float = 1e-3, stop: threading.Event | None = None, end: float | None = None) -> bool:
    """Wait for ``reqs`` (a transfer's frames): True once all completed, False where none completed for
    ``timeout`` seconds (the peer died, or stalls: the caller gives them up with their memory,
    ``abandon.give_up``, and says which).

    The deadline counts from the last request that completed, not from the start, so a large object moving
    frame by frame is never cut short. ``busy``: test back to back (the rank has a core of its own: MPI
    progresses the bytes only inside the tests), else after naps from ``first_nap`` doubling to ``nap_max``,
    except after a test that took over ``WORKED`` (it copied part of a message: the next test goes on at once).
    The clock is read only after a test that found nothing new, every 64th such test while busy. ``stop``:
    False as soon as it is set (seen when the clock is read). ``end``: False at this ``time.monotonic()`` at the
    latest, frames flowing or not (a call's own timeout, ``rpc.bounded``). Interruptible: Ctrl-C raises here at once,
    the requests left as they are (the caller gives them up with their memory).
    """
    left = len(reqs)
    if MPI.Request.Testall(reqs):  # the usual case for a small transfer: done by the first look
        return True
    last = float("inf") if end is None else end
    deadline = min(time.monotonic() + timeout, last)
    nap, idle = first_nap, 0
    clock = time.perf_counter
    while True:
        began = clock()
        done = MPI.Request.Testsome(reqs)
        if done is None:  # every request inactive: all completed
            return True
        if done:
            left -= len(done)
            if left <= 0:
                return True
            deadline = min(time.monotonic() + timeout, last)
            # frames are flowing: look again soon (the next one's hand-shake waits for a test)
            nap = first_nap
            continue
        if busy:
            idle += 1
            if idle & 63 or (time.monotonic() < deadline and not (stop is not None and stop.is_set())):
                continue
            return False
        if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            return False
        if clock() - began > WORKED:
            # the test moved bytes (MPICH copies a large message over CMA 512 KiB per test: the receiver's own
            # work, not a wait): test again at once (a nap there made a 1 MiB frame take 0.3 ms, not 0.08)
            nap = first_nap
            continue
        time.sleep(nap)
        nap = min(nap * 2, nap_max)


def quiet_barrier(comm: MPI.Comm) -> None:
    """A barrier over ``comm`` that waits without spinning (see :func:`quiet_wait`): for ranks that wait
    long while others work, e.g. beside a benchmark on a machine with fewer cores than ranks."""
    quiet_wait([comm.Ibarrier()])


def spin_window(ranks_on_host: int) -> float:
    """Seconds a service probes back to back after a request: ``SHMSTORE_SERVICE_SPIN_US`` (microseconds),
    else 200 us where the host has a core per rank, else 0 (more ranks than cores: a spinning service or
    waiting rank would take time from a rank that computes).

    Raises:
        ConfigError: a bad ``SHMSTORE_SERVICE_SPIN_US``.
    """
    chosen = service_spin()
    if chosen is not None:
        return chosen
    return 200e-6 if ranks_on_host <= (os.cpu_count() or 1) else 0.0


def idle_nap(ranks_on_host: int) -> float:
    """Seconds between the probes of a node service that had no request for a while:
    ``SHMSTORE_SERVICE_IDLE_US`` (microseconds), else 50 us where the host has a core to spare (fewer ranks
    than cores: a request after a pause is answered within about 100 us, and the probes, a microsecond each,
    run on the spare core), else 1 ms (every core computes: 1,000 short wake-ups a second take next to
    nothing from the ranks; a request after a pause then waits up to about 1 ms).

    Raises:
        ConfigError: a bad ``SHMSTORE_SERVICE_IDLE_US``.
    """
    chosen = service_idle()
    if chosen is not None:
        return chosen
    return 50e-6 if ranks_on_host < (os.cpu_count() or 1) else 1e-3


class Pace:
    """How long after a request a node service keeps its naps short (``window`` seconds): ``factor`` times
    the recent gap between requests (an average of the gaps within the window), from ``floor`` to
    ``ceiling`` seconds.

    A stream of requests (a loop of remote gets whose requests reach this node a few ms apart) keeps the
    window open, each request answered within a short nap; one burst and then silence (an application
    that fetched and computes again) closes it within ``floor``, after which the service naps as long as
    an idle one. A gap of up to ``slack`` windows still counts as the stream's pace (the window grows to
    it); a longer silence says nothing of a pace: the next request starts over from ``floor``.
    """

    slack = 4.0

    def __init__(self, floor: float = 0.005, ceiling: float = 0.5, factor: float = 8.0) -> None:
        self.floor, self.ceiling, self.factor = floor, ceiling, factor
        self.gap = floor / factor
        self.window = floor
        self.last = float("-inf")

    def request(self, now: float) -> None:
        """A request came at ``now`` (``time.monotonic()``)."""
        gap = now - self.last
        if gap <= self.slack * self.window:
            self.gap += (gap - self.gap) / 4
        else:
            self.gap = self.floor / self.factor
        self.window = min(self.ceiling, max(self.floor, self.factor * self.gap))
        self.last = now
