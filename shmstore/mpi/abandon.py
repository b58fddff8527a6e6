"""Requests given up on: kept, with the memory MPI may still touch, until MPI is done with them.

A rank gives up on a peer after ``peer_timeout`` seconds (or a Ctrl-C), but
MPI does not give up with it. ``MPI_Cancel`` of a receive that has already
matched its send does nothing: the receive goes on writing its buffer when
the sender's bytes come (a SIGSTOPped sender that wakes; with UCX over CMA,
the receiver's own next MPI call copies them). A send whose receiver is
late goes on reading its buffer when the receiver wakes. ``MPI_Request_free``
only forgets the request, not its buffer. So the buffer of a request given
up on must stay what it was until MPI says the request is over:

1. the step that gave up, seen from a fetch: the receive is cancelled, and
   the arena space reserved for the object is set aside (its key is free
   again: a later get fetches anew) but not freed;
2. the request is tested now and then (a thread of this module, a few times
   a second while any is held): once ``MPI_Test`` says it completed,
   cancelled (``MPI_Test_cancelled``) or with its bytes all in, nothing
   writes into that space any more, and it is freed (``release``);
3. where the peer never comes back (it died), the space stays set aside for
   the life of the process; the spill process frees it with the rest of
   what a dead client held.

The same holds for a send's source: the pin of the object a node service
sends stays (its lease is kept here) until the send is over, so no delete,
spill or put can reuse the space that a late receiver still reads. A
pickled request or reply (``isend``) keeps its bytes in its request object,
which is kept here too.

Before this, a rank stopped for longer than ``peer_timeout`` in the middle
of a fetch, then resumed, raised ``TransferError`` (right), put an object of
its own into the space the receive had reserved, and MPI then wrote the rest
of the old transfer over the new object: hundreds of MB silently wrong.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, Callable

from mpi4py import MPI

__all__ = ["give_up", "held", "wait_released", "stats"]

log = logging.getLogger("shmstore")

# the tending thread's naps: short after a give-up, then a few a second
_NAP_MIN, _NAP_MAX = 0.001, 0.1


class _Held:
    """Requests given up together, what they keep alive, and what to do once MPI is done with all of them."""

    __slots__ = ("reqs", "keep", "release", "since", "cancel_at")

    def __init__(self, reqs: list[MPI.Request], keep: Any, release: Callable[[], object] | None,
                 cancel_at: float | None = None) -> None:
        self.reqs, self.keep, self.release, self.since = reqs, keep, release, time.monotonic()
        self.cancel_at = cancel_at  # when the requests left to finish (a drain) are cancelled after all


# the list and the counters one thread tests the held requests at a time (MPI forbids testing one request
_lock = threading.Lock()
_sweeping = threading.Lock()
                              # from two threads at once)
_held: list[_Held] = []
_thread: list[threading.Thread | None] = [None]
_exiting = [False]
_counts = {"given_up": 0, "cancelled": 0, "completed": 0, "held": 0, "released_late": 0}


def give_up(reqs: Iterable[MPI.Request | None], release: Callable[[], object] | None = None,
            keep: Any = None, drain: float = 0.0) -> bool:
    """Give up on ``reqs``: cancel each that is still live, then ``release()`` (and drop ``keep``: the
    buffers, leases or pickled bytes the requests use) once MPI is done with every one of them: at once
    where each is complete or cancelled now (True), else from this module's thread when they are (False).
    ``drain``: let the live ones finish for up to that many seconds first, cancelling only those left then
    (receives whose sender is alive and sends anyway: its frames land, and its sends end too, instead of
    waiting for a receiver that cancelled).

    Never raises (``release`` runs later where it cannot run now; its own errors are logged).
    """
    live = [r for r in reqs if r is not None and r]
    with _lock:
        _counts["given_up"] += len(live)
    if drain <= 0:
        _cancel(live)
    live = [r for r in live if not _over(r)]
    if not live:
        _run(release)
        return True
    with _lock:
        _held.append(_Held(live, keep, release, time.monotonic() + drain if drain > 0 else None))
        _counts["held"] += 1
        if _thread[0] is None and not _exiting[0]:
            t = threading.Thread(target=_tend, name="shmstore-mpi-abandoned", daemon=True)
            _thread[0] = t
            t.start()
    return False


def held() -> int:
    """Groups of requests given up on that MPI still has (their memory is kept)."""
    with _lock:
        return len(_held)


def wait_released(limit: float) -> bool:
    """Wait until no request given up on is held (their memory released), ``limit`` seconds at most; True if
    none is left. Tests the requests itself (MPI moves the bytes only inside its calls)."""
    deadline = time.monotonic() + limit
    nap = _NAP_MIN
    while True:
        _sweep()
        if not held():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(nap)
        nap = min(nap * 2, 0.02)


def stats() -> dict[str, int]:
    """Counters since the process started: requests given up on, how many MPI confirmed cancelled, how many
    completed instead, groups that had to be held, and groups released late (after being held)."""
    with _lock:
        return dict(_counts, holding=len(_held))


def _cancel(reqs: list[MPI.Request]) -> None:
    for r in reqs:
        try:
            r.Cancel()
        # MPI may refuse to cancel (a send on some transports): it is then waited for
        except Exception:
            pass


def _over(r: MPI.Request) -> bool:
    """Whether MPI is done with ``r`` (completed, or cancelled): testing it once."""
    status = MPI.Status()
    try:
        if not r.Test(status):
            return False
    # MPI failed it (its peer died): it completed, in error; nothing touches its buffer now
    except Exception:
        return True
    try:
        cancelled = status.Is_cancelled()
    except Exception:
        cancelled = False
    with _lock:
        _counts["cancelled" if cancelled else "completed"] += 1
    return True


def _run(release: Callable[[], object] | None) -> None:
    if release is None:
        return
    try:
        release()
    except Exception:  # e.g. the store was closed meanwhile: what it held went with it
        log.warning("shmstore.mpi: releasing what a given-up transfer held failed", exc_info=True)


def _sweep() -> None:
    """Test every held request once; release the groups MPI is done with."""
    with _sweeping:
        with _lock:
            groups = list(_held)
        done = []
        now = time.monotonic()
        for g in groups:
            if MPI.Is_finalized():
                return
            if g.cancel_at is not None and now >= g.cancel_at:  # drained long enough: its sender is gone
                g.cancel_at = None
                _cancel(g.reqs)
            g.reqs = [r for r in g.reqs if not _over(r)]
            if not g.reqs:
                done.append(g)
        if not done:
            return
        with _lock:
            for g in done:
                _held.remove(g)
                _counts["released_late"] += 1
        for g in done:
            _run(g.release)
            g.keep = None


def _tend() -> None:
    """Test the held requests, a few times a second, until none is left (then the thread ends)."""
    nap = _NAP_MIN
    while True:
        time.sleep(nap)
        nap = min(nap * 2, _NAP_MAX)
        with _lock:
            if not _held or _exiting[0]:
                _thread[0] = None
                return
        _sweep()


# registered after mpi4py's own (it imports MPI first), so it runs before MPI_Finalize
@atexit.register
def _stop() -> None:
    with _lock:
        _exiting[0] = True
    t = _thread[0]
    if t is not None:
        t.join(1.0)
