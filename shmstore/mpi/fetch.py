"""Fetching objects into this node: one at a time, or in batches.

A get that misses asks the key's home which holder to fetch from
(``DirSource``; the home makes this node *pending* in the key's entry, see
directory.py). A small object (up to ``T.INLINE_MAX``) comes inside a reply
(the home's, where it holds the object, else the holder's ``Lookup``) and
lands in one C call; then the fetch posts ``DirDone`` to the home (the new
copy is listed) without waiting for an answer. One round trip in all where
the home or this node holds the entry, two otherwise.

A larger object goes through the node's migration map, so that concurrent
requests for one key on a node cause one transfer: the same first question
names its holder (for a hot object the answer may wait for a free holder,
so copies spread as a tree) and the holder pins it (the home's or the
forwarded lookup, else the fetcher's ``Lookup``); then the fetcher takes the
map entry (where another rank of its node has it, it gives the source back
with a failed ``DirDone`` and waits for that transfer), room is made and
the entry reserved here, and the bytes go from the source's arena (or
spill file) straight into this node's arena as a few raw frames, whatever
the number of blobs; ``DirDone`` then also frees the source for the next
fetcher. An object up to ``T.PUSH_MAX`` in the source's host memory comes
as one frame the source sends with its lookup's answer (``Found.pushed``),
for copies whose first level is host memory: a 1 MiB get that missed makes
one round trip before the bytes (the question, forwarded to the holder),
where it made two (and a Data request, three before that). A pushed frame
the fetcher will not use (another rank of its node has the entry, the key
is here already, the get gave up before the answer) is drained into a
buffer and dropped: MPI cannot cancel a send, and the source keeps its pin
until its frame went.

A batch (``fetch(keys)``, ``get_many``) goes in rounds of ``T.BATCH``
keys: holders asked once per home node, objects looked up once per source
node (small ones inside the reply), new copies registered once per home.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Callable, TypeAlias

import numpy as np
from mpi4py import MPI

from .. import errors
from ..client.puts import Incoming
from ..levels import Level, parse_levels
from ..meta import layout as L
from ..meta.keyref import Contents
from ..meta.keys import encode_key
from ..node import inbound
from ..placement import DEFAULT_PUT_LEVELS
from . import tags as T
from . import wire as W
from .abandon import give_up
from .cuda import cuda_aware
from .dirclient import DirectoryClient
from .links import Links
from .rpc import call_limit, out_of_time
from .staging import recv_staged

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["Fetcher"]

Levels: TypeAlias = Iterable[Level] | Level | None  # where copies go (None: the default put levels)
_ASK = object()  # no lookup answer yet: ask the source
# a batch's requests ask the services to wait for the next one without naps this long
_LINGER = 1e-3


class Fetcher:
    """Transfers into this rank's node ``store`` over ``links``, asking the directory through ``dirs``.
    Thread-safe (a Cluster's verbs and its service's pulls use it at once)."""

    def __init__(self, links: Links, dirs: DirectoryClient, store: Store) -> None:
        self.links, self.dirs, self.store = links, dirs, store
        self.kernel = store.kernel
        self.me: int = links.node
        self.streams = T.default_streams()  # streams per transfer (at most len(links.bulk))
        self._tokens = itertools.count(1)
        self._token_lock = threading.Lock()

    def token(self) -> int:
        """A name for one fetch while it is pending at a home, unique in the job (this rank's, counted)."""
        with self._token_lock:
            return (int(self.links.rank) << 40) | next(self._tokens)

    # ---- one key ----------------------------------------------------------------
    def fetch_one(self, key: str, source: int | None, levels: Levels, block: int, missed: bool = False,
                  source_version: W.Version = None, direct: bool = False) -> None:
        """One deduplicated transfer of ``key`` into this node (from ``source``, whose copy the directory
        listed as ``source_version``, else from a holder the directory names); ``missed``: the caller just found
        it missing here; ``direct``: from ``source`` without the directory (see :meth:`copy_from`)."""
        kb = encode_key(key)
        node, sid = self.kernel.node, self.kernel.sid
        if source is None and missed and self._from_directory(key, levels, block, first=True):
            # one question: a small object came inline, no migration entry (two ranks at once both land it:
            # harmless); a large one's transfer took the entry once its source was known
            return
        for _ in range(4):
            if not missed and key in self.store:
                return
            missed = False
            owner, slot = inbound.begin(node, sid, kb)
            if not owner:
                err = inbound.wait(node, slot, sid, kb, call_limit(self.store.config.spill_timeout * 2))
                if err is None or err == "retry":
                    continue
                late = out_of_time(f"another rank's transfer of {key!r} into this node", key)
                if late is not None:
                    raise late
                raise _shared_error(key, self.links.name, err)  # the error of the transfer we waited for
            with _ending(node, [slot]):
                if key not in self.store:
                    self._one(key, source, source_version, levels, block, direct)
            return
        if key not in self.store:
            # the transfers waited for kept ending with the key gone again (a writer deleting and putting it as
            # fast as it can, two suites at once on 2 cores): this rank's own, outside the slot (two ranks landing
            # it is harmless: the second finds it there)
            self._one(key, source, source_version, levels, block, direct)

    def _one(self, key: str, source: int | None, source_version: W.Version, levels: Levels, block: int,
             direct: bool) -> None:
        """The transfer :meth:`fetch_one` asks for, once (the caller deduplicates)."""
        if direct and source is not None:
            self._direct(key, source, levels, block)
        elif source is None:
            self._from_directory(key, levels, block)
        else:
            self._pull(key, source, source_version, levels, block)

    def _from_directory(self, key: str, levels: Levels, block: int, first: bool = False) -> bool:
        """Fetch from the holder the key's home names (one round trip to it, one to the holder; one in all
        where the home holds it); a holder without the object is reported stale and the home asked again.
        ``first``: a get's first question, before this node's migration entry is taken: a large object's
        transfer takes it once the lookup says it is large; False (nothing done, the source given back) where
        another rank of this node has it."""
        held: list[int] = []  # the migration entry a first question's large transfer took
        with _ending(self.kernel.node, held):
            return self._ask_and_fetch(key, levels, block, first, held)

    def _ask_and_fetch(self, key: str, levels: Levels, block: int, first: bool, held: list[int]) -> bool:
        """:meth:`_from_directory`'s questions and transfer; a migration entry it takes goes into ``held``."""
        nodes = self.links.nodes
        # Each stale answer is progress (the home drops the copy that was not there) but a writer overwriting
        # and deleting the key as fast as it can may outrun a few: more tries, a short pause after the first
        # round of them (two test suites at once on 2 cores: 'lost it while asked' after len(nodes) + 2)
        for attempt in range(4 * len(nodes) + 8):
            if attempt >= len(nodes) + 2:
                time.sleep(min(0.001 * attempt, 0.02))
            # first: where a third node holds it, the home forwards the question and the holder answers
            token = self.token()
            ask = W.DirSourceSmall if first else W.DirSource
            try:
                answer = self.dirs.ask(ask(key, self.me, T.INLINE_MAX, token, _push_max(levels)), any_source=first)
            except BaseException:  # given up (a get's timeout, Ctrl-C, a peer's deadline): the home may have
                self._gave_up(key, token)  # named a source or queued it meanwhile, for a fetch that never comes
                raise
            if answer is None:
                if key in self.store:  # it came here meanwhile (a migration, a put)
                    return True
                raise errors.ObjectNotFoundError(f"no node has {key!r} (nodes: {list(nodes)})", key)
            src = answer.node
            found: Any = answer.found if type(answer) is W.Sourced else _ASK  # Sourced: looked up
            outcome, nbytes, version = W.Outcome.FAILED, 0, None
            try:
                if first and not held:
                    if found is _ASK:  # pins it (or pushes it)
                        found = self.links.messenger.call(src, W.Lookup(key, T.INLINE_MAX, _push_max(levels)))
                    if found is not None and found.inline is None:  # large: one transfer per node
                        slot = self._take_slot(key, src, found)
                        if slot is None:
                            return False
                        held.append(slot)
                        try:
                            here = key in self.store  # another rank landed it just before
                        except BaseException:
                            self._release(src, found)
                            raise
                        if here:
                            self._release(src, found)
                            return True
                nbytes, version = self._from(src, key, levels, block, found)
                outcome = W.Outcome.COPIED if nbytes >= 0 else W.Outcome.STALE
            finally:
                # posted, no reply awaited: the home made this node pending when it named the source, so a
                # delete meanwhile finds it; this rank's later requests to the home come after this one
                try:
                    listed = self.dirs.ask(W.DirDone(key, src, self.me, outcome, max(nbytes, 0), version,
                                                     token), post=True)
                except errors.TransferError:
                    if outcome is not W.Outcome.FAILED:  # else the error on its way out says what failed first
                        raise
                    listed = None
            if outcome is W.Outcome.COPIED:
                if listed is False and version is not None:  # refused by our own directory: deleted or
                    self.kernel.delete(key, True, version)  # replaced while it came; the old copy goes, again
                    continue
                return True
        raise errors.TransferError(f"every node the directory names for {key!r} lost it while asked", key)

    def _gave_up(self, key: str, token: int) -> None:
        """Tell the key's home that the fetch ``token`` gave its question up: what it was named or queued for
        ends as failed, the holder free for the next fetcher at once (not after ``peer_timeout``). Posted."""
        try:
            self.dirs.ask(W.DirDone(key, W.GAVE_UP, self.me, W.Outcome.FAILED, 0, None, token), post=True)
        except Exception:  # the home is gone too: nothing to free
            pass

    def _take_slot(self, key: str, src: int, found: W.Found) -> int | None:
        """This node's migration entry for ``key``, for the transfer of what ``src`` ``found`` (pinned there);
        None, the pin given back, where another rank of this node holds the entry (the caller waits for it)."""
        try:
            owner, slot = inbound.begin(self.kernel.node, self.kernel.sid, encode_key(key))
        except BaseException:
            self._release(src, found)
            raise
        if owner:
            return slot
        self._release(src, found)
        return None

    def _pull(self, key: str, source: int, source_version: W.Version, levels: Levels, block: int) -> None:
        """A migration's transfer from node ``source`` (its copy ``source_version``, as the directory listed it):
        pending at the home while the bytes move, the new copy listed before it returns (the registration is
        answered).

        Raises:
            ObjectNotFoundError: the key was deleted, replaced or moved from ``source`` meanwhile.
        """
        nodes = self.links.nodes
        token = self.token()
        if self.dirs.ask(W.DirSourceFor(key, self.me, source, source_version, token)) is None:
            raise errors.ObjectNotFoundError(f"{key!r} was deleted, replaced or moved from node "
                                             f"{nodes[source]!r} while the migration began", key)
        outcome, nbytes, version = W.Outcome.FAILED, 0, None
        try:
            nbytes, version = self._from(source, key, levels, block)
            outcome = W.Outcome.COPIED if nbytes >= 0 else W.Outcome.STALE
        finally:
            try:
                listed = self.dirs.ask(W.DirDone(key, source, self.me, outcome, max(nbytes, 0), version, token))
            except errors.TransferError:
                if outcome is not W.Outcome.FAILED:  # else the error on its way out says what failed first
                    raise
                listed = None
        if outcome is W.Outcome.STALE:
            raise errors.ObjectNotFoundError(f"node {nodes[source]!r} has no copy of {key!r} to move", key)
        if listed is False:
            if version is not None:
                self.kernel.delete(key, True, version)
            raise errors.ObjectNotFoundError(f"{key!r} was deleted or replaced while it moved", key)

    def copy_from(self, src: int, key: str, levels: Levels, block: int) -> None:
        """Copy ``key`` from node ``src``, which the caller knows holds it, without asking the directory (a
        checkpoint's partner copy: the holder's put came before the collective that started it; a restore:
        the ranks said which node holds what), deduplicated with this node's other ranks; the new copy is not
        listed (the caller publishes it).

        Raises:
            ObjectNotFoundError: ``src`` has no copy (deleted meanwhile).
        """
        self.fetch_one(key, src, levels, block, direct=True)

    def _direct(self, key: str, src: int, levels: Levels, block: int) -> None:
        nbytes, _ = self._from(src, key, levels, block)
        if nbytes < 0:
            raise errors.ObjectNotFoundError(f"node {self.links.nodes[src]!r} has no copy of {key!r}", key)

    def _from(self, src: int, key: str, levels: Levels, block: int, found: Any = _ASK) -> tuple[int, W.Version]:
        """Transfer ``key`` from node ``src`` (what its lookup ``found``, else asked now): its size (-1 where
        ``src`` has no copy) and the copy id of the object made here (None: it was put here meanwhile)."""
        if found is _ASK:  # pins it there if found (or pushes it)
            found = self.links.messenger.call(src, W.Lookup(key, T.INLINE_MAX, _push_max(levels)))
        if found is None:
            return -1, None
        return int(found.nbytes), self._transfer(key, src, found, levels, block)

    # ---- batches ----------------------------------------------------------------
    def fetch_batch(self, keys: list[str], levels: Levels, block: int) -> set[str]:
        """Fetch the missing ``keys`` in rounds of ``T.BATCH``: the keys this rank brought here. Keys another
        rank of this node is fetching are left to it (and to the caller's check)."""
        node, sid = self.kernel.node, self.kernel.sid
        missing = [k for k in keys if k not in self.store]
        landed: set[str] = set()
        for start in range(0, len(missing), T.BATCH):
            chunk = missing[start: start + T.BATCH]
            mine: list[tuple[str, int]] = []  # (key, migration slot) this rank transfers
            try:
                begun = inbound.begin_many(node, sid, [encode_key(k) for k in chunk])
                mine = [(k, slot) for k, (owner, slot) in zip(chunk, begun) if owner]
                landed.update(self._round([k for k, _ in mine], levels, block))
            finally:
                inbound.finish_many(node, [(slot, None if k in landed or k in self.store else "retry")
                                              for k, slot in mine])
        return landed

    def _round(self, keys: list[str], levels: Levels, block: int) -> set[str]:
        """One round of a batched fetch: holders asked per home (this node pending in each entry), objects
        looked up per source, outcomes posted per home. Returns the keys now here."""
        msg, dirs = self.links.messenger, self.dirs
        holders: dict[str, list[int]] = {}
        token = self.token()
        for home, ks in dirs.by_home(keys).items():
            holders.update(zip(ks, dirs.ask_at(home, W.DirSourceMany(ks, self.me, token), linger=_LINGER).nodes))
        by_src: dict[int, list[str]] = {}
        for k in keys:
            hs = holders[k]
            if hs:
                by_src.setdefault(hs[self.me % len(hs)], []).append(k)
        # every key the homes made pending gets an outcome, whatever happens here
        outcome: dict[str, W.DoneItem] = {
            k: W.DoneItem(k, src, W.Outcome.FAILED, 0) for src, ks in by_src.items() for k in ks}
        landed: set[str] = set()
        try:
            for src, ks in by_src.items():
                spin = msg.spin and msg.spin + 10e-6 * len(ks)  # a few us a key there: wait without naps
                found = msg.call(src, W.LookupMany(ks, T.INLINE_MAX), spin=spin, linger=_LINGER).items
                for k, f in zip(ks, found):  # each found is pinned there until sent
                    if f is None:
                        outcome[k] = W.DoneItem(k, src, W.Outcome.STALE, 0)
                        continue
                    version = self._transfer(k, src, f, levels, block)
                    outcome[k] = W.DoneItem(k, src, W.Outcome.COPIED, int(f.nbytes), version)
                    landed.add(k)
        finally:
            unreported = None
            for home, ks in dirs.by_home(list(outcome)).items():  # every home hears, though one may be gone
                try:
                    refused = dirs.ask_at(home, W.DirDoneMany(self.me, [outcome[k] for k in ks], token), post=True)
                except errors.TransferError as exc:
                    unreported = unreported or exc
                    continue
                for k, version in refused.copies if refused else ():  # our own directory refused it: deleted or
                    self.kernel.delete(k, True, version)                  # replaced meanwhile
                    landed.discard(k)
            if unreported is not None and sys.exc_info()[1] is None:  # else the error on its way out is first
                raise unreported
        return landed

    # ---- the bytes ----------------------------------------------------------------
    def _transfer(self, key: str, src: int, found: W.Found, levels: Levels, block: int) -> W.Version:
        """Make ``key`` here from what node ``src`` ``found``: the new object's creation time (its copy id:
        what a refusal deletes), None where it was put here meanwhile (another rank of this node landed the
        same small object, or put or overwrote the key: what we wanted)."""
        try:
            made = self._make(key, found, levels)
        except BaseException:  # nothing made: what the source pinned (or pushed) for us goes back
            self._release(src, found)
            raise
        if made is None:  # here already (another rank, a put)
            self._release(src, found)
            return None
        if not isinstance(made, Incoming):  # small: landed (its creation time)
            self._count(found.nbytes)
            return made
        inc = made
        unfinished = _Unfinished()
        try:
            self._receive(key, src, inc, found, block, unfinished)
            inc.seal()
        except BaseException:
            self._let_go(inc, unfinished)
            raise
        self._count(found.nbytes)
        return float(inc.reservation.ctime)

    def _make(self, key: str, found: W.Found, levels: Levels) -> Incoming | W.Version:
        """The new object for what a source ``found``: a small one landed (its creation time), else an
        :class:`Incoming` to receive into; None where the key is here already (another rank of this node landed
        the same small object, or it was put or overwritten here: what we wanted)."""
        order = parse_levels(levels, DEFAULT_PUT_LEVELS)
        kernel, ref, n = self.kernel, self.kernel.begin(key), found.nbytes
        what = Contents(found.kind, n, n, found.nblobs, found.array_meta)
        deadline, nap = time.monotonic() + self.store.config.spill_timeout, 20e-6
        while True:
            try:
                if found.inline is not None and order[0] == Level.MEMORY:  # small: one C call copies and seals
                    version: W.Version = kernel.puts.put_stored(ref, what._replace(src=found.inline), Level.MEMORY)
                    if version is not None:
                        return version
                return self.store.placement.place(key, order, lambda level: kernel.puts.ingest(ref, what, level))
            except errors.ObjectExistsError:
                return None
            # being written here: wait for the writer (a fetch of the same small object by another rank, which is not
            # deduplicated)
            except errors.ObjectLockedError:
                if key in self.store:
                    return None
                if time.monotonic() > deadline:
                    raise
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)

    @staticmethod
    def _let_go(inc: Incoming, unfinished: _Unfinished) -> None:
        """Give back the space of a transfer that failed: at once where every receive is over, else once MPI
        is done with the ones it could not cancel (``abandon.py``: a stopped sender that wakes still fills
        them), or, where this rank gave up by its own choice (``unfinished.drain``), once the source's frames
        landed (cancelled after ``peer_timeout`` where they never do). Meanwhile the space is set aside, not
        freed, and the key is free for another fetch."""
        if unfinished.reqs:
            try:
                inc.set_aside()
            except errors.ShmStoreError:  # its stripe lock stayed taken: the key stays taken until released
                pass
        give_up(unfinished.reqs, release=inc.drop, keep=unfinished.buffer, drain=unfinished.drain)

    def _release(self, src: int, found: W.Found) -> None:
        """Let the source unpin what it pinned for us (a large object we will not take). Posted: nothing waits
        for the answer (a call here, out of a get's own time, raised though its Release went). A frame it
        pushed is drained instead: the source keeps its pin until MPI is done with the frame."""
        if found.pushed:
            self.links.messenger.drain(self.links.leaders[src], found)
        elif found.handle:
            self.links.messenger.post(src, W.Release(found.handle))

    def _count(self, nbytes: int) -> None:
        node = self.kernel.node
        with node.admin:
            L.add_transfer_stats(node.buf, transfers=1, received=nbytes)

    def _receive(self, key: str, src: int, inc: Incoming, found: W.Found, block: int,
                 unfinished: _Unfinished) -> None:
        """Fill the new object ``inc`` with what node ``src`` ``found`` (inline, or as frames)."""
        nbytes, sink = found.nbytes, inc.sink
        dst = sink.buffer()  # host memory MPI can receive into (the arena), or None
        if dst is None and cuda_aware() and hasattr(sink, "cuda_buffer"):
            dst = sink.cuda_buffer()  # the device array itself: CUDA-aware MPI receives into it
        if found.inline is not None:
            if isinstance(dst, np.ndarray):
                dst[:] = np.frombuffer(found.inline, np.uint8)
            else:
                sink.write(np.frombuffer(found.inline, np.uint8), 0)
        elif found.pushed:
            self._pushed(key, src, dst if isinstance(dst, np.ndarray) else None, found, unfinished,
                         copy_in=lambda b: sink.write(b, 0))
        elif nbytes and dst is not None:
            unfinished.buffer = dst  # mapped while MPI may still write it (a closed store keeps it mapped)
            self._frames(key, src, dst, nbytes, found.handle, block, unfinished)
        # a file or a device without CUDA-aware MPI: frames through host blocks
        elif nbytes:
            self._frames(key, src, None, nbytes, found.handle, block, unfinished,
                         copy_in=lambda pos, n, b: sink.write(b, pos))

    def _pushed(self, key: str, src: int, dst: np.ndarray | None, found: W.Found, unfinished: _Unfinished,
                copy_in: Callable[[np.ndarray], None]) -> None:
        """Receive the one frame node ``src`` pushed with its answer ``found`` into ``dst`` (host memory), else
        into a buffer of its own handed to ``copy_in`` (a file, a device). As :meth:`_frames` where it fails."""
        msg, peer = self.links.messenger, self.links.leaders[src]
        into = dst if dst is not None else np.empty(found.nbytes, np.uint8)
        unfinished.buffer = into  # mapped while MPI may still write it (a closed store keeps it mapped)
        try:
            req = self.links.bulk[0].Irecv([into, MPI.BYTE], source=peer, tag=found.pushed)
        except MPI.Exception as exc:  # the source is gone
            msg.burn(found.pushed)
            raise msg.failed(src, "transfer", key, exc) from exc
        msg.paid(found.pushed)  # this receive takes the frame: MPI matches in order of posting
        try:
            msg.wait([req], src, key)
        except BaseException as exc:
            unfinished.reqs.append(req)
            msg.burn(found.pushed)  # the frame may still come on this tag: never a later call's
            if _own_choice(exc):  # the source is alive: its frame lands in the set-aside space (_let_go)
                unfinished.drain = self.store.config.peer_timeout
            raise
        if dst is None:
            copy_in(into)

    def _frames(self, key: str, src: int, dst: Any, nbytes: int, handle: int, block: int, unfinished: _Unfinished,
                copy_in: Callable[[int, int, np.ndarray], None] | None = None) -> None:
        """Receive an object's frames into ``dst`` (host or device memory), or with ``copy_in`` through
        host blocks handed to it; one thread per stream (this one runs the first). A source that sends no
        frame for ``peer_timeout`` seconds is taken for dead: TransferError, the receives into ``dst`` still
        live left in ``unfinished`` (the caller gives them up with the space, see :meth:`_let_go`). The
        first stream that fails (a Ctrl-C on this thread included) stops the others at their next look."""
        msg, bulk = self.links.messenger, self.links.bulk
        streams = max(1, min(self.streams, len(bulk)))
        plan, peer = T.frames(nbytes, block, streams), self.links.leaders[src]
        tag = msg.next_tag()
        try:
            msg.call_tagged(src, W.Data(handle, block, streams), key, tag=tag)
        except BaseException as exc:
            if _own_choice(exc) and dst is not None:
                # this rank gave up (its timeout, a Ctrl-C), not the source: the source sends every frame all
                # the same, and waits for them to be taken (for peer_timeout, holding the object's pin): take
                # them into the space set aside for them (see _let_go)
                for i in range(streams):
                    unfinished.reqs.extend(bulk[i].Irecv([dst[pos: pos + n], MPI.BYTE], source=peer, tag=tag)
                                           for pos, n in plan[i::streams])
                unfinished.drain = self.store.config.peer_timeout
            raise
        failed: list[BaseException] = []
        stop = threading.Event()

        def wait(reqs: list[MPI.Request]) -> None:
            msg.wait(reqs, src, key, stop)

        def stream(i: int) -> None:
            reqs: list[MPI.Request] = []
            try:
                if copy_in is not None:  # the staging gives its own requests up, with its blocks
                    recv_staged(bulk[i], peer, tag, plan[i::streams], copy_in, wait=wait)
                    return
                for pos, n in plan[i::streams]:
                    reqs.append(bulk[i].Irecv([dst[pos: pos + n], MPI.BYTE], source=peer, tag=tag))
                wait(reqs)
            except BaseException as exc:  # re-raised on the calling thread
                unfinished.reqs.extend(r for r in reqs if r)
                failed.append(exc)
                stop.set()

        threads = [threading.Thread(target=stream, args=(i,), name="shmstore-mpi-stream", daemon=True)
                   for i in range(1, min(streams, len(plan)))]
        for t in threads:
            t.start()
        stream(0)
        for t in threads:
            t.join()
        if failed:
            msg.burn(tag)  # frames may still come on this tag: never a later transfer's
            first = next((e for e in failed if not isinstance(e, Exception)), failed[0])  # a Ctrl-C first
            if _own_choice(first):  # the source is alive: its frames land in the set-aside space (_let_go)
                unfinished.drain = self.store.config.peer_timeout
            if isinstance(first, MPI.Exception):  # a receive failed to start (its sender is gone)
                raise msg.failed(src, "transfer", key, first) from first
            raise first


@contextlib.contextmanager
def _ending(node: Any, slots: list[int]) -> Iterator[None]:
    """End this node's migration entries ``slots`` (those taken by the time the block ends) as the block ends:
    a miss leaves no error (the waiters look again and miss too), nor does a call out of its own time (they look
    again and take the transfer over); another failure is the waiters' error."""
    try:
        yield
    except (errors.ObjectNotFoundError, errors.GetTimeoutError):
        for slot in slots:
            inbound.finish(node, slot)
        raise
    except BaseException as exc:
        for slot in slots:
            inbound.finish(node, slot, f"{type(exc).__name__}:{exc}")
        raise
    for slot in slots:
        inbound.finish(node, slot)


class _Unfinished:
    """The receives of a failed transfer that MPI may still write into, and the buffer they write into."""

    __slots__ = ("reqs", "buffer", "drain")

    def __init__(self) -> None:
        self.reqs: list[MPI.Request] = []
        self.buffer: Any = None
        # seconds to let the receives finish before cancelling them (abandon.give_up): the source is alive
        self.drain = 0.0


def _push_max(levels: Levels) -> int:
    """The largest object a lookup for copies on ``levels`` may push with its answer (``T.PUSH_MAX``): one
    whose first level is host memory (a frame into a device goes at a Data request, staged or CUDA-aware)."""
    return T.PUSH_MAX if parse_levels(levels, DEFAULT_PUT_LEVELS)[0] == Level.MEMORY else 0


def _own_choice(exc: BaseException) -> bool:
    """Whether a transfer failed by this rank's choice (its call's timeout, a Ctrl-C), not its source's."""
    return isinstance(exc, errors.GetTimeoutError) or not isinstance(exc, Exception)


def _shared_error(key: str, node: str, err: str) -> Exception:
    name, _, msg = err.partition(":")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.ObjectNotFoundError):
        return cls(msg, key)
    return errors.TransferError(f"transfer of {key!r} into node {node!r} failed: {msg or err}", key)
