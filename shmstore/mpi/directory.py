"""The location directory: which nodes hold a complete copy of a key, partitioned across nodes.

Every key has a home node, ``crc32(key) % nodes``, whose leader keeps that
key's entry in memory (a :class:`Directory`, served by the node's service).
A get miss asks the home once (``DirSourceSmall``: which holder to fetch
from; where the home holds the object itself, its lookup comes in the
answer, and where a third node does, the home forwards the question and
that holder answers) and else that holder (``Lookup``): at most two round
trips before bytes move, whatever the number of nodes and the object's size; ``locate`` is one round trip,
``delete`` one to the home plus one per holder. Paths that make a copy
register it (``Cluster.put``, a migration, a remote writer: ``DirAdd``,
answered, so a key is locatable when ``put`` returns); paths that remove one
unregister it (``Cluster.delete`` takes the whole entry, an overwrite
replaces it, a migration drops its source).

A fetch is registered when the home names its source: the fetch, named by
a token it sends along, is *pending* in the entry until its ``DirDone``
comes back with that token (posted, no reply awaited; a batch's
``DirSourceMany``/``DirDoneMany`` and a migration's ``DirSourceFor`` alike), which lists
the new copy. A small fetch whose source is a third node is forwarded
there (``Forward``) and answered by the holder. A ``delete`` or an overwrite meanwhile
takes or replaces the entry, and a ``DirDone`` that finds its node no
longer pending is refused: the copy of the deleted or replaced object is
removed (the home posts a ``Delete`` to that node). The taker does not
leave it at that: the get that made such a copy may have returned already
(its ``DirDone`` still on the way), and a get on that node after the delete
or overwrite, ordered after it by a barrier, found the old copy there (one
round in 7 to 30 of delete-barrier-get here, MPICH and Open MPI alike). So
``DirTake`` and ``DirReplace`` answer how many fetches of the old object
are still out (``Holders.pending``) and keep a record of them under the
taker's token; the taker asks again (``DirSettle``) until they have all
reported, deleting each copy they landed, before it returns (within
``peer_timeout``: a fetcher that died never reports, and its copy, if any,
goes when the refusal comes). So a fetch in flight never lets an old copy
outlive a delete or an overwrite, nor be read after one.

Every holder's copy is named by the object's creation time on that node
(``DirAdd``/``DirDone`` carry it), and every deletion the cluster makes
names the copy it means (``Delete(key, copy)``): a delete removes exactly
the listed copies, an overwrite exactly the old ones (``DirReplace``
returns them), a migration drops only the copies it moved from
(``DirDrop(key, node, copy)``). A later object put under the key meanwhile
is never dropped. Registrations of one node's objects sent by different
ranks may cross on the way (two ranks of a node overwriting a key at once):
an older object of a node never replaces the later one the entry lists for
it, which the node's store holds (one clock per node: versions compare).

Hot objects spread as a tree. A holder of a large object (``SPREAD_MIN``
bytes or more) sends to one fetcher at a time: the home answers each
``DirSource`` with a holder that is not sending, and keeps the fetcher
waiting while every holder is busy; a finished fetch (``DirDone``) frees its
source and adds a holder. When every node asks for one object at once, the
holders double each transfer time: all N nodes hold it after about
log2(N) transfer times instead of the N-1 of one source sending to each.
A holder whose fetcher never reports (it died mid-transfer) counts as free
again after ``stale_after`` seconds (``peer_timeout``), so one dead rank
does not stop the object's fetches for the rest of the job.

Ordering, so that concurrent operations never leave a copy the directory
misses (which ``delete`` would then miss too): a copy is registered after
it exists, and unregistered before it is deleted. A race can then only
leave an entry naming a node whose copy is gone, which heals as below.

What the directory cannot see: objects put or deleted through a plain
node-local ``shmstore.connect()`` (they are found on their own node only;
``Cluster.publish(keys)`` registers them), and copies removed behind its
back. Such an entry is stale, never harmful: a fetcher that finds a holder
without the object tells the home (``DirDone``, ``Outcome.STALE``), which drops it,
and asks again. Entries live as long as the job: the directory is in the
leaders' memory, not in the stores (a job that dies takes it along).
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
import zlib
from collections import deque
from typing import Any, Callable

from . import wire as W

__all__ = ["Directory", "home_of", "SPREAD_MIN", "WAIT"]

# objects of at least this many bytes are sent by each holder to one node at a time a DirSource answer that comes later
# (every holder busy)
SPREAD_MIN = 1 << 20
WAIT = object()


def home_of(key: str, nnodes: int) -> int:
    """The index of ``key``'s home node (stable across ranks and runs)."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % nnodes


_NONE = object()  # no copy seen: never equal to a listed copy
# pending fetches without a token (unit tests drive the directory by hand)
_ANON = itertools.count()


class _Entry:
    __slots__ = ("holders", "copies", "nbytes", "sending", "since", "waiters", "pending")

    def __init__(self) -> None:
        self.holders: list[int] = []
        self.copies: dict[int, W.Version] = {}  # holder -> its copy (creation time there), None: unknown
        self.nbytes = 0
        # fetches named a source and not done yet, by token: (node, the copies of the sources it may use as
        # they were listed then: a report that one was empty drops it only if it still lists that copy)
        self.pending: dict[Any, tuple[int, dict[int, W.Version]]] = {}
        # holder -> fetches it serves now (large objects) holder -> when it was last handed to a fetcher
        # (time.monotonic)
        self.sending: dict[int, int] = {}
        self.since: dict[int, float] = {}
        # (node, answer, token) waiting for a holder
        self.waiters: deque[tuple[int, Callable[[Any], None], int]] = deque()


class _Closing:
    """The fetches of an object a delete or an overwrite took from the directory, still in flight (see
    :class:`wire.DirSettle`): how many, and the copies those that ended landed (the taker deletes them)."""
    __slots__ = ("key", "pending", "landed", "since")

    def __init__(self, key: str, pending: int) -> None:
        self.key, self.pending, self.since = key, pending, time.monotonic()
        self.landed: list[tuple[int, W.Version]] = []


class Directory:
    """One node's share of the directory: key -> nodes holding a copy, and who is sending. Thread-safe.

    :meth:`handle` answers the directory messages of :mod:`wire`; a
    ``DirSource`` that must wait returns ``WAIT`` and is answered later
    through the ``answer`` callable it came with. A ``DirDone`` returns
    whether its copy is listed (False: refused, the copy must go).
    """

    def __init__(self, stale_after: float = 60.0) -> None:
        self._entries: dict[str, _Entry] = {}
        # deletes and overwrites settling the fetches in flight of what they took, by the taker's token; and the
        # taker of each such fetch, by (fetch token, key)
        self._closing: dict[int, _Closing] = {}
        self._closed_by: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()
        self.stale_after = stale_after  # a holder sending longer than this is free again (its fetcher died)

    def ask(self, msg: Any) -> Any:
        """The answer to ``msg`` from this rank (the leader keeping this share): no message; a ``DirSource``
        that must wait for a free holder waits here."""
        if type(msg) not in _LATER:  # the requests that may be answered later
            return self.handle(msg, _no_answer)
        box: queue.SimpleQueue[Any] = queue.SimpleQueue()
        result = self.handle(msg, box.put)
        return box.get() if result is WAIT else result

    def handle(self, msg: Any, answer: Callable[[Any], None]) -> Any:
        later: list[tuple[Callable[[Any], None], Any]] = []  # answers to send once the lock is dropped
        try:
            on = self._on[type(msg)]
        except KeyError:
            raise TypeError(f"not a directory message: {type(msg).__name__}") from None
        with self._lock:
            result = on(self, msg, answer, later)
        for reply, value in later:
            reply(value)
        return result

    def _get(self, msg: W.DirGet, answer: Any, later: list[Any]) -> W.Located:
        return W.Located([list(e.holders) if (e := self._entries.get(k)) else [] for k in msg.keys])

    def _source(self, msg: W.DirSource | W.DirSourceSmall, answer: Callable[[Any], None], later: list[Any]) -> Any:
        e = self._entries.get(msg.key)
        if e is None:
            return None
        node, holders = msg.node, e.holders
        others = holders if node not in holders else [h for h in holders if h != node]
        if not others:
            return None
        src = others[node % len(others)]  # small: no queueing; fetchers start at different holders
        if e.nbytes >= SPREAD_MIN:
            if e.waiters:  # fetchers queued first get any holder freed since (a stale one)
                self._serve(msg.key, later)
            free = self._free_holder(e, node)
            if free is None:
                e.waiters.append((node, answer, msg.token))
                return WAIT
            src = free
        _pend(e, msg.token, node, [src])
        return W.Source(src)

    def _source_for(self, msg: W.DirSourceFor, answer: Any, later: list[Any]) -> W.Source | None:
        """A migration's pull from the holder it chose: pending, nothing to choose."""
        e = self._entries.get(msg.key)
        if e is None or msg.source not in e.holders or e.copies.get(msg.source) != msg.version:
            # replaced or moved since the caller looked: its source is not the key's now
            return None
        _pend(e, msg.token, msg.node, [msg.source])
        return W.Source(msg.source)

    def _source_many(self, msg: W.DirSourceMany, answer: Any, later: list[Any]) -> W.Located:
        out = []
        for key in msg.keys:
            e = self._entries.get(key)
            others = [h for h in e.holders if h != msg.node] if e else []
            if others:
                assert e is not None
                _pend(e, msg.token, msg.node, others)
            out.append(others)
        return W.Located(out)

    def _done_many(self, msg: W.DirDoneMany, answer: Any, later: list[Any]) -> W.Refused:
        refused: list[tuple[str, W.Version]] = []
        for key, source, outcome, nbytes, version in msg.items:
            if not self._done(W.DirDone(key, source, msg.node, outcome, nbytes, version, msg.token), answer, later) \
                    and version is not None:
                refused.append((key, version))
        return W.Refused(refused)

    def _add_many(self, msg: W.DirAdd, answer: Any, later: list[Any]) -> None:
        copies = msg.copies or [None] * len(msg.keys)
        for k, size, version in zip(msg.keys, msg.sizes, copies):
            self._add(k, msg.node, size, version)

    def _copies(self, msg: W.DirCopies, answer: Any, later: list[Any]) -> W.Holders:
        e = self._entries.get(msg.key)
        return W.Holders(_listed(e) if e else [])

    def _done(self, msg: W.DirDone, answer: Any, later: list[Any]) -> bool:
        e = self._entries.get(msg.key)
        if msg.source == W.GAVE_UP:
            # the fetcher gave its question up (a get's timeout, Ctrl-C) before the answer came: out of the queue
            # for a holder, or the fetch named ended as failed from the source it was named (never waited for)
            if not msg.token:
                return True
            if e is not None and any(w[2] == msg.token for w in e.waiters):
                e.waiters = deque(w for w in e.waiters if w[2] != msg.token)
            named = e.pending.get(msg.token) if e is not None else None
            if named is None or named[0] != msg.node or len(named[1]) != 1:
                # not a fetch named here (any more): a delete or an overwrite that took the entry meanwhile may
                # count it as in flight, and settles without it now
                if self._closed_by:
                    self._settled(msg._replace(outcome=W.Outcome.FAILED))
                if e is not None:
                    self._serve(msg.key, later)
                return True
            msg = msg._replace(source=next(iter(named[1])), outcome=W.Outcome.FAILED)
        if msg.token and self._closed_by:
            self._settled(msg)
        seen = _unpend(e, msg.token, msg.node, msg.source) if e is not None else None
        was_pending = seen is not None
        if e is not None and was_pending and e.sending.get(msg.source, 0) > 0:
            e.sending[msg.source] -= 1
        if msg.outcome is W.Outcome.COPIED and was_pending and msg.version is not None:
            # (no version: the fetch found the key there already and made nothing; what it found is listed by
            # the path that made it, or is an old copy an overwrite is deleting: listed on this word, it once
            # let a migration drop the only copy of the new object, taking the old one for its destination's)
            self._add(msg.key, msg.node, msg.nbytes, msg.version)
        elif msg.outcome is W.Outcome.STALE and was_pending and e is not None and msg.source in e.holders \
                and e.copies.get(msg.source) == seen.get(msg.source, _NONE):  # type: ignore[union-attr]
            # the copy found missing is the one listed when the source was named: not a copy landed since
            self._drop(msg.key, msg.source)
        if e is not None and (e.waiters or not e.holders):
            self._serve(msg.key, later)
        if msg.outcome is not W.Outcome.COPIED or was_pending:
            return True
        e = self._entries.get(msg.key)
        return e is not None and msg.node in e.holders  # listed anyway (put there meanwhile), else refused

    def _drop_one(self, msg: W.DirDrop, answer: Any, later: list[Any]) -> bool:
        e = self._entries.get(msg.key)
        if e is None or msg.node not in e.holders or e.copies.get(msg.node) != msg.version:
            # not listed, or another object is (put there meanwhile): that one stays
            return False
        if msg.keep >= 0 and msg.keep not in e.holders:
            # the move's destination lost its copy meanwhile: this one is the key's last
            return False
        self._drop(msg.key, msg.node)
        self._serve(msg.key, later)
        return True

    def _take(self, msg: W.DirTake, answer: Any, later: list[Any]) -> W.Holders:
        e = self._entries.pop(msg.key, None)
        if e is None:
            return W.Holders([])
        later.extend((reply, None) for _, reply, _ in e.waiters)  # the key is gone: nothing to fetch
        # fetches in flight: refused when they end, and settled by the taker
        return W.Holders(_listed(e), self._close(msg.key, e, msg.token))

    def _replace(self, msg: W.DirReplace, answer: Any, later: list[Any]) -> W.Holders:
        if _older(msg.version, self._entries.get(msg.key), msg.node):
            # two ranks of one node overwrote at once and the later object's registration came first: the
            # entry names that node's object now (this one is gone there) and the copies fetched of it since
            return W.Holders([])
        old = self._entries.pop(msg.key, None)
        e = self._entries[msg.key] = _Entry()
        e.holders, e.nbytes, e.copies = [msg.node], int(msg.nbytes), {msg.node: msg.version}
        if old is None:
            return W.Holders([])
        e.waiters = old.waiters  # fetchers waiting for a holder get the new object
        self._serve(msg.key, later)
        # fetches of the old object in flight: refused when they end, and settled by the overwriter
        return W.Holders(_listed(old, but=msg.node), self._close(msg.key, old, msg.token))

    def _settle(self, msg: W.DirSettle, answer: Any, later: list[Any]) -> W.Holders:
        c = self._closing.get(msg.token)
        if c is None or c.key != msg.key:
            return W.Holders([])
        landed, c.landed = c.landed, []
        if not c.pending:
            del self._closing[msg.token]
        return W.Holders(landed, c.pending)

    def _close(self, key: str, e: _Entry, token: int) -> int:
        """Keep a record, under the taker's ``token``, of the fetches of ``e`` (just taken) in flight: how many."""
        fetches = [t for t in e.pending if isinstance(t, int)]  # (token 0: unit tests driving it by hand)
        if not token or not fetches:
            return 0
        now = time.monotonic()
        for t in [t for t, c in self._closing.items() if now - c.since > 2 * self.stale_after]:
            del self._closing[t]  # its taker gave up on it long ago (or died)
            for k in [k for k, v in self._closed_by.items() if v == t]:
                del self._closed_by[k]
        self._closing[token] = _Closing(key, len(fetches))
        for t in fetches:
            self._closed_by[(t, key)] = token
        return len(fetches)

    def _settled(self, msg: W.DirDone) -> None:
        """A fetch a delete or an overwrite is settling ended: what it landed is the taker's to delete."""
        taker = self._closed_by.pop((msg.token, msg.key), None)
        c = self._closing.get(taker) if taker is not None else None
        if c is None:
            return
        c.pending -= 1
        if msg.outcome is W.Outcome.COPIED and msg.version is not None:
            c.landed.append((msg.node, msg.version))

    _on: dict[type, Callable[..., Any]] = {
        W.DirGet: _get, W.DirSource: _source, W.DirSourceSmall: _source, W.DirSourceFor: _source_for,
        W.DirAdd: _add_many, W.DirDone: _done, W.DirDrop: _drop_one,
        W.DirTake: _take, W.DirReplace: _replace, W.DirSourceMany: _source_many, W.DirDoneMany: _done_many,
        W.DirCopies: _copies, W.DirSettle: _settle}

    def _add(self, key: str, node: int, nbytes: int, version: W.Version = None) -> None:
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = _Entry()
        if node not in e.holders:
            e.holders.append(node)
        # the latest registration that knows names the copy: a fetch that found the key put there meanwhile knows
        # none, and the put's own registration names it (clobbered with "unknown", a move's source drop deleted a
        # later write); a later object on that node registered first stands (see _replace)
        if (version is not None or node not in e.copies) and not _older(version, e, node):
            e.copies[node] = version
        e.nbytes = max(e.nbytes, int(nbytes))

    def _drop(self, key: str, node: int) -> None:
        e = self._entries.get(key)
        if e is not None and node in e.holders:
            e.holders.remove(node)
            e.copies.pop(node, None)
            e.sending.pop(node, None)
            e.since.pop(node, None)

    def _free_holder(self, e: _Entry, node: int) -> int | None:
        """A holder of ``e`` other than ``node`` sending to nobody, or for longer than ``stale_after`` seconds
        (its fetcher died: it never reports), marked as sending now; else None."""
        free = [h for h in e.holders if h != node and e.sending.get(h, 0) == 0]
        now = time.monotonic()
        if not free:
            free = [h for h in e.holders if h != node and now - e.since.get(h, now) > self.stale_after]
            if not free:
                return None
        src = free[node % len(free)]
        e.sending[src], e.since[src] = 1, now
        return src

    def _serve(self, key: str, later: list[Any]) -> None:
        """Hand free holders to waiting fetchers; with no holder left, tell them there is none."""
        e = self._entries.get(key)
        if e is None:
            return
        while e.waiters:
            node, reply, token = e.waiters[0]
            if not [h for h in e.holders if h != node]:
                e.waiters.popleft()
                later.append((reply, None))
                continue
            src = self._free_holder(e, node)
            if src is None:
                break
            e.waiters.popleft()
            _pend(e, token, node, [src])
            later.append((reply, W.Source(src)))
        if not e.holders and not e.waiters and not e.pending:
            del self._entries[key]

    def get(self, key: str) -> list[int]:
        with self._lock:
            e = self._entries.get(key)
            return list(e.holders) if e else []

    def __len__(self) -> int:
        return len(self._entries)


_LATER = frozenset({W.DirSource, W.DirSourceSmall})  # may wait for a free holder (answered later)


def _no_answer(value: Any) -> None:
    raise AssertionError("only a DirSource is answered later")


def _older(version: W.Version, e: _Entry | None, node: int) -> bool:
    """Whether ``version`` (an object's creation time on ``node``) is older than the object ``e`` lists on
    ``node``: registrations of one node's objects sent by different ranks can arrive out of order, and the
    node's store holds only the later object (versions of one node compare: one clock)."""
    listed = None if e is None else e.copies.get(node)
    return version is not None and listed is not None and version < listed


def _listed(e: _Entry, but: int = -1) -> list[tuple[int, W.Version]]:
    """The holders of ``e`` (other than node ``but``) with their copies."""
    return [(h, e.copies.get(h)) for h in e.holders if h != but]


def _pend(e: _Entry, token: int, node: int, sources: list[int]) -> None:
    """Node ``node`` fetches from one of ``sources`` now, named ``token``: pending, with their copies as
    listed. (Token 0, from callers that name none, is told apart by node and source only.)"""
    e.pending[token or ("node", node, next(_ANON))] = (node, {h: e.copies.get(h) for h in sources})


def _unpend(e: _Entry, token: int, node: int, source: int) -> dict[int, W.Version] | None:
    """End the pending fetch ``token`` of ``node`` (with token 0: one of ``node``'s that could use ``source``):
    the copies it saw, or None where it is not pending here (the entry was taken or replaced since its
    source was named: a fetch named in the new entry is another one)."""
    if token:
        found = e.pending.pop(token, None)
        return found[1] if found is not None and found[0] == node else None
    for k, (n, seen) in list(e.pending.items()):
        if n == node and source in seen and not isinstance(k, int):
            del e.pending[k]
            return seen
    return None
