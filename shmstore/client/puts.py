"""Putting objects: reserve an invisible entry, copy outside any lock, seal.

A put first reserves its entry in state ``writing`` (invisible to get, and
owned by this client's slot) with its space - a cut of this client's chunk
for a small object, an extent of its own for a large one, or DISK quota -
then copies with no lock held, then seals under the stripe lock. A writer
that dies leaves a ``writing`` entry that the janitor drops; one that fails
drops it itself.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from ..errors import InvalidArgumentError, ShmStoreError
from ..meta import layout as L
from ..meta.keyref import Contents, KeyRef, Reservation, being_written_error, exists_error
from ..meta.table import EntryStolen, find_entry, owns_entry
from ..node import serialize
from ..node.protocols import PutContext, Sink, StorageLevel
from ..values import Level, ObjectInfo
from .state import ClientState

__all__ = ["Puts", "Incoming"]

_monotonic = time.monotonic
_new = tuple.__new__
# an overwrite's creation time is at least this much later than the replaced object's (float seconds since
# 1970 resolve about 0.24 us)
_TICK = 1e-6

Shortcut = Callable[[PutContext, KeyRef, "serialize.Encoded | Contents", Callable[[int, int], object]],
                    "Reservation | None"]
"""A level's ``try_put(client, ref, what, give_up)`` (see ``StorageLevel.try_put``): ``what`` placed and its
entry inserted in one step, or None (nothing changed) where the general way must do it, as every level but the
arena's (its C fast path) always answers. Asked only where this client has the C operations."""


class Puts:
    """The put side of a :class:`~shmstore.client.kernel.Kernel`: reserve an entry, copy, seal.

    Owned by the kernel, which hands it out as ``kernel.puts`` (writers and
    transfers reserve, seal and abort through it); shares the kernel's
    :class:`~shmstore.client.state.ClientState`. Process-safe through the
    store's locks; thread-safe.
    """

    def __init__(self, state: ClientState) -> None:
        self.node, self.slot, self.sid, self.session = state.node, state.slot, state.sid, state.session
        self._supply, self._fast, self._prefault = state.supply, state.fast, state.prefault
        self._buf, self._lay, self._table, self._stripes = state.buf, state.lay, state.table, state.stripes
        self._meta_addr, self._stripe_addrs = state.meta_addr, state.stripe_addrs
        self._state, self._put_ctx = state, state.put_context
        self._levels: dict[int, tuple[StorageLevel, Shortcut | None]] = {}  # level: (it, its try_put)
        self.inherited = False  # in a forked child: the entries are the parent's, never given up here

    def put(self, ref: KeyRef, obj: Any, level: int, overwrite: bool = False) -> ObjectInfo:
        """Store ``obj`` under the key of ``ref`` on ``level``.

        A level with a shortcut for small values (``try_put``: the arena's
        one C call) is asked first; everything else goes the one general way:
        reserve, write outside any lock, seal. With ``overwrite``, an
        existing object of the key is replaced atomically (see
        :meth:`replace`).

        Raises:
            ObjectExistsError: the key is present. ObjectLockedError: it is being written.
            StorageFullError: no room on the level, at once.
            SerializationError: bad input; nothing changes.
            InvalidArgumentError: the level is not available here.
        """
        enc = serialize.encode(obj)
        lv, shortcut = self._levels.get(level) or self._level(ref.key, level)
        if shortcut is not None and not overwrite and enc.src is not None:  # one buffer to copy: try the level's
            done = shortcut(self._put_ctx, ref, enc, self.give_up)  # shortcut (copied and sealed at once), else None
            if done is not None:
                return self._new_info(ref.key, enc, lv.level, done.stored, done.ctime)
        r = self.reserve(ref, Contents(enc.kind, enc.size, enc.nbytes, enc.nblobs, enc.meta), level, overwrite)
        try:
            lv.write(r.idx, r.gen, r.offset, L.ENTRY_HEAD.get(self._buf, self._lay.entry(r.idx), "flags"), enc,
                     ref.key)
            ctime = r.ctime
            if overwrite:
                ctime = self.replace(ref, r.idx, r.stripe)
            else:
                self.seal(r.idx, r.stripe)
        except BaseException:
            self.give_up(r.idx, r.gen)  # a no-op once sealed (an exception after the last step)
            raise
        return self._new_info(ref.key, enc, lv.level, r.stored, ctime)

    def ingest(self, ref: KeyRef, what: Contents, level: int,
               give_up: Callable[[int, int, bool], object] | None = None) -> Incoming:
        """Reserve ``what`` on ``level`` and open the level's sink for its bytes: a new object filled from
        outside one copy of a put (a writer's stream, an incoming transfer), sealed or dropped through the
        :class:`Incoming` this returns. The one way both are composed; the room is made by whoever calls
        this through ``Placement.place`` (StorageFullError sends it to the next level, or waits for room).
        ``give_up(idx, gen, blocking)``: how :meth:`Incoming.drop` gives the entry back (default
        :meth:`give_up`; a kernel's defers what a finalizer cannot do).

        Raises:
            as :meth:`reserve`; the level's own error opening its sink (the entry is given back).
        """
        r = self.reserve(ref, what, level)
        try:
            sink = self.level_of(ref.key, level).sink(r.idx, r.gen, r.offset, what.size, ref.key)
        except BaseException:
            self.abort(r.idx)
            raise
        return Incoming(self, ref.key, Level(level), r, sink, give_up or self.give_up)

    def level_of(self, key: str, level: int) -> StorageLevel:
        """The level ``level`` of this store, if this process can use it (see :meth:`_level`)."""
        return (self._levels.get(level) or self._level(key, level))[0]

    def _level(self, key: str, level: int) -> tuple[StorageLevel, Shortcut | None]:
        """The level ``level`` of this store and its shortcut for small values (if it has one), if this
        process can use it (remembered: a level's availability here never changes).

        Raises:
            InvalidArgumentError: it is not available here (saying why).
        """
        lv = self.node.levels.get(Level(level))
        why = "it is not registered" if lv is None else lv.available()
        if lv is None or why:
            raise InvalidArgumentError(f"cannot place {key!r} on {Level(level).name}: {why} "
                                       f"(use Level.MEMORY or Level.DISK)")
        found = self._levels[level] = (lv, None if self._fast is None else lv.try_put)  # see Shortcut
        return found

    def put_stored(self, ref: KeyRef, what: Contents, level: int) -> float | None:
        """A small object from its stored bytes ``what.src`` (a fetched copy), copied and sealed in one step
        by ``level``'s shortcut (as a small :meth:`put`): its creation time (``ObjectInfo.created``).

        Returns None (nothing changed) where the general way (reserve, write,
        seal) must do it: a level without a shortcut, no C extension, larger
        than a chunk's cut, empty, no room, a busy stripe lock.

        Raises:
            ObjectExistsError: the key is present. ObjectLockedError: it is being written.
            InvalidArgumentError: the level is not available here.
        """
        if not 0 < what.nbytes == len(what.src):
            return None
        _, shortcut = self._levels.get(level) or self._level(ref.key, level)
        done = None if shortcut is None else shortcut(self._put_ctx, ref, what, self.give_up)
        return None if done is None else float(done.ctime)

    def _new_info(self, key: str, enc: serialize.Encoded, level: Level, stored: int, ctime: float) -> ObjectInfo:
        """ObjectInfo of an object this process just sealed (nobody pins it yet)."""
        info: ObjectInfo = _new(ObjectInfo, (key, enc.nbytes, level, False, True, enc.nblobs,
                                             serialize.KIND_NAMES[enc.kind], stored, 0, self.session, ctime))
        # (tuple.__new__: the NamedTuple's own __new__ is a Python call on every put)
        return info

    def reserve(self, ref: KeyRef, what: Contents, level: int, shadow: bool = False) -> Reservation:
        """Create an invisible ``writing`` entry for ``what`` (``what.src`` unused) on ``level``, with
        ``what.size`` bytes of the level's space (arena or disk quota).

        With ``shadow`` the entry is an overwrite's: in no chain and whatever
        the key holds now, until :meth:`replace` swaps it in.

        Raises:
            ObjectExistsError, ObjectLockedError, StorageFullError, InvalidArgumentError.
        """
        if what.size < 0:
            raise InvalidArgumentError(f"size of {ref.key!r} must not be negative, got {what.size}")
        lv, shortcut = self._levels.get(level) or self._level(ref.key, level)
        if shortcut is not None and not shadow:
            done = shortcut(self._put_ctx, ref, what if what.src is None else what._replace(src=None), self.give_up)
            if done is not None:
                return done
        lv.prepare(ref.key)  # what waits on another process, before the stripe lock (see StorageLevel.prepare)
        while True:
            held = self._supply.take_entry(ref.key)
            try:
                return self._reserve_locked(ref, held, what, lv, shadow)
            except EntryStolen:
                continue  # another client holds that entry now

    def _reserve_locked(self, ref: KeyRef, held: tuple[int, int], what: Contents, lv: StorageLevel,
                        shadow: bool) -> Reservation:
        """:meth:`reserve` in Python under the stripe lock, on entry ``held`` = (index, generation)."""
        try:
            with self._stripes[ref.stripe]:
                return self.reserve_held(ref, held, what, lv, shadow)
        except (EntryStolen, ShmStoreError):  # nothing changed (see reserve_held)
            raise
        except BaseException:  # from anywhere (asynchronous): see give_up
            self.give_up(*held)
            raise

    def reserve_held(self, ref: KeyRef, held: tuple[int, int], what: Contents, lv: StorageLevel,
                     shadow: bool) -> Reservation:
        """:meth:`reserve`'s step with the stripe lock of ``ref`` held by the caller (a batch holds it for
        a group of keys), on entry ``held`` = (index, generation); an asynchronous exception leaves the
        caller to ``give_up(*held)`` once the lock is released.

        Raises:
            EntryStolen: another client holds that entry now (nothing changed).
            ShmStoreError: on purpose (exists, being written, full): nothing changed, the entry is back in
                this client's batch.
        """
        buf, lay, supply = self._buf, self._lay, self._supply
        (idx, gen), key, kb, stripe, level = held, ref.key, ref.kb, ref.stripe, int(lv.level)
        stored = L.align(max(what.size, 1))  # extents are exact multiples of the alignment
        eoff = lay.entry(idx)
        rec = placed = 0
        placed_ok = False
        try:
            _, other_off, other = find_entry(buf, lay, ref.bucket, ref.h, self.sid, kb)
            if other is not None and not shadow:
                if L.entry(buf, other_off).state == L.WRITING:
                    raise being_written_error(key)
                raise exists_error(key)
            if not owns_entry(buf, eoff, self.slot, gen):
                raise EntryStolen
            ctime = time.time()
            flags = L.FLAG_SHADOW if shadow else 0
            head = {"size": stored, "nbytes": what.nbytes, "atime": _monotonic(), "ctime": ctime,
                    "hash": ref.h, "gen": gen, "writer": self.slot, "nblobs": what.nblobs, "keylen": len(kb),
                    "session": self.sid, "state": L.WRITING, "kind": what.kind, "level": level, "flags": flags}

            def write_entry(off: int, rec: int, flags_: int) -> None:
                self._write_entry(eoff, dict(head, offset=off, extent=rec, flags=flags | flags_), what.meta, kb)
            off, rec, placed = lv.place(key, idx, gen, stored, self._put_ctx, write_entry)
            placed_ok = True
            L.add_stripe_stats(buf, lay.stripe_stats(stripe), level, stored, 1)
            if not shadow:
                self._table.link(idx, ref.bucket)
        except EntryStolen:
            raise
        # raised on purpose: nothing linked, the placed space (if any) named by nobody
        except ShmStoreError:
            if placed_ok:
                lv.unplace(idx, rec, placed)
            supply.entries.append((idx, gen))  # still reserved for us
            raise
        return Reservation(idx, gen, off, stored, ctime, stripe)

    def _write_entry(self, eoff: int, head: dict[str, Any], meta: bytes | None, kb: bytes) -> None:
        buf = self._buf
        L.ENTRY_HEAD.pack(buf, eoff, **head)
        if meta is not None:
            L.set_entry_array(buf, eoff, meta)
        L.set_entry_key(buf, eoff, kb)

    def seal(self, idx: int, stripe: int | None = None) -> None:
        """Make a reserved entry visible (the lock orders the data before the state)."""
        if stripe is None:
            stripe = self._table.stripe_of(idx)
        if self._fast is not None:
            state = self._meta_addr + L.entry_state_offset(self._lay.entry(idx))
            rc = self._fast.set_byte(self._stripe_addrs[stripe], state, L.SEALED)
            if rc == 0:
                return
        with self._stripes[stripe]:
            L.ENTRY_HEAD.set(self._buf, self._lay.entry(idx), "state", L.SEALED)  # ``writer`` matters only writing

    def replace(self, ref: KeyRef, idx: int, stripe: int) -> float:
        """Seal overwrite entry ``idx`` in place of whatever the key of ``ref`` holds, in one chain store: its
        creation time (``ObjectInfo.created``), which :meth:`replace_held` sets.

        The old object is hidden and freed like a delete: views of it stay
        valid until dropped. A get never finds the key missing meanwhile; a
        process killed at any step leaves either object answering, never
        neither (see :meth:`Table.replace`).

        Raises:
            ObjectLockedError: a plain put of the key is being written (ours is dropped).
        """
        with self._stripes[stripe]:
            return self.replace_held(ref, idx)

    def replace_held(self, ref: KeyRef, idx: int) -> float:
        """:meth:`replace` with the stripe lock of ``ref`` held by the caller (a batch holds it for a group).

        The creation time is set here, under the lock, later than the replaced object's: an overwrite
        reserved before another one that is swapped in first replaces it second, and the object a key holds
        on a node is always the one created last (the cluster's directory tells a node's objects apart by
        it: see ``mpi/directory.py``).

        Raises:
            ObjectLockedError: a plain put of the key is being written (ours is dropped).
        """
        buf, lay, table, b = self._buf, self._lay, self._table, ref.bucket
        eoff = lay.entry(idx)
        old, old_off, found = find_entry(buf, lay, b, ref.h, self.sid, ref.kb)
        e = None if found is None else L.entry(buf, old_off)
        if e is not None and e.state == L.WRITING:
            self.node.release(idx, supply=self._supply)
            raise being_written_error(ref.key)
        ctime = time.time() if e is None else max(time.time(), e.ctime + _TICK)
        L.ENTRY_HEAD.set(buf, eoff, "ctime", ctime)
        L.ENTRY_HEAD.set(buf, eoff, "flags", L.ENTRY_HEAD.get(buf, eoff, "flags") & ~L.FLAG_SHADOW)
        L.ENTRY_HEAD.set(buf, eoff, "state", L.SEALED)
        if e is None:
            table.link(idx, b)
            return ctime
        table.replace(old, idx, b)
        if e.state == L.SEALED:  # (a deleted one still linked: a delete was killed half way)
            table.mark_deleted(old)
        if not table.pin_count(old) and not e.flags & L.FLAG_MOVING:  # else: last pin / mover
            self.node.release(old, supply=self._supply)
        return ctime

    def give_up(self, idx: int, gen: int, blocking: bool = True) -> bool:
        """Drop entry ``idx`` (generation ``gen``) of a put of this client cut short by an exception, whatever
        step it reached: reserved (back to this client's batch, or freed with the space it names), being
        written (out of its chain, freed), or neither (a repair or another client has it now: nothing to do).

        The exception may be asynchronous and come at any instruction, even right after a step the
        caller did not see finish (a C call's result it never stored): so this reads where the entry
        is instead of trusting the caller's notion.

        With ``blocking=False`` (a finalizer: a writer dropped unsealed, which the garbage collector may
        run inside a locked section of this very thread) it waits for no lock: where one it needs is
        taken, maybe by this thread, it changes nothing and returns False (the caller defers it to this
        process's next verb). Blocking there would wait for itself for the whole lock timeout, and
        then leave the entry half dropped.

        Returns:
            False where it changed nothing for want of a lock (``blocking=False`` only), else True.
        """
        if self.inherited:
            return True
        lock = self.node.stripe_of(idx)
        if blocking:
            with lock:
                return self._give_up_locked(idx, gen, True)
        if not lock.acquire(blocking=False):
            return False
        # as the context manager does, in this frame: nothing can come between the acquire and the try
        try:
            return self._give_up_locked(idx, gen, False)
        except BaseException as exc:
            lock.abandon(exc)
            raise
        finally:
            lock.release()

    def _give_up_locked(self, idx: int, gen: int, blocking: bool) -> bool:
        """:meth:`give_up` with the entry's stripe lock held."""
        buf, eoff, table = self._buf, self._lay.entry(idx), self._table
        e = L.entry(buf, eoff)
        if e.gen != gen or e.writer != self.slot or e.state not in (L.RESERVED, L.WRITING):
            return True
        if e.state == L.RESERVED and not e.extent:
            self._supply.entries.append((idx, gen))
            return True
        b = table.bucket_of(idx)
        linked = e.state == L.WRITING and table.unlink(idx, b)
        try:
            done = self.node.release(idx, blocking, supply=self._supply)  # False: the ALLOC lock is taken
        # the ALLOC lock stayed taken for its timeout: raised on purpose, so the stripe's repair will not run, and the
        # entry must be whole again
        except ShmStoreError:
            if linked:
                table.link(idx, b)
            raise
        if not done and linked:
            table.link(idx, b)  # as it was (a chain's order means nothing)
        return done

    def abort(self, idx: int) -> None:
        """Drop a reserved entry and give its space back (also one :meth:`set_aside` before)."""
        with self.node.stripe_of(idx):
            self._table.unlink(idx, self._table.bucket_of(idx))
            self.node.release(idx, supply=self._supply)

    def set_aside(self, idx: int) -> None:
        """Hide a ``writing`` entry from its key but keep its space: the key is free again (a later put or
        fetch of it goes ahead) while something may still write into the space (a receive MPI could not
        cancel). The entry stays this client's, as an overwrite's is before it is swapped in (a shadow:
        in no chain); :meth:`abort` frees it, and so does this client's death."""
        buf, eoff = self._buf, self._lay.entry(idx)
        with self.node.stripe_of(idx):
            if L.ENTRY_HEAD.get(buf, eoff, "state") != L.WRITING or L.ENTRY_HEAD.get(buf, eoff, "writer") != self.slot:
                return
            self._table.unlink(idx, self._table.bucket_of(idx))
            L.ENTRY_HEAD.set(buf, eoff, "flags", L.ENTRY_HEAD.get(buf, eoff, "flags") | L.FLAG_SHADOW)


class Incoming:
    """A new object being filled (see :meth:`Puts.ingest`): its reserved entry, invisible until sealed, and
    the level's sink for its bytes (:attr:`sink`; :meth:`buffer` where it is memory to fill in place).

    :meth:`seal` makes it visible, :meth:`drop` gives the entry and its space back: one of them, once.
    Where something may still write into the space after a failure (a receive MPI could not cancel),
    :meth:`set_aside` frees the key first and keeps the space until :meth:`drop`. Not thread-safe.
    """

    __slots__ = ("puts", "key", "level", "reservation", "sink", "_give_up")

    def __init__(self, puts: Puts, key: str, level: Level, reservation: Reservation, sink: Sink,
                 give_up: Callable[[int, int, bool], object]) -> None:
        self.puts, self.key, self.level, self.reservation, self.sink = puts, key, level, reservation, sink
        self._give_up = give_up

    def buffer(self) -> Any:
        """A writable uint8 array over the whole object (the arena), or None where the level has none."""
        return self.sink.buffer()

    def seal(self) -> None:
        """Complete the bytes (the sink's close) and make the object visible.

        Raises:
            StorageFullError, SpillError, PermissionDeniedError: the level could not complete them (nothing
                is sealed: :meth:`drop` it).
        """
        self.sink.close()
        self.puts.seal(self.reservation.idx, self.reservation.stripe)

    def drop(self, blocking: bool = True) -> None:
        """Drop what was written and give the entry back; never raises for the sink (``blocking=False``: a
        finalizer, which waits for no lock)."""
        self.sink.abort()
        self._give_up(self.reservation.idx, self.reservation.gen, blocking)

    def set_aside(self) -> None:
        """Free the key but keep the space (see :meth:`Puts.set_aside`); :meth:`drop` gives it back later."""
        self.sink.abort()
        self.puts.set_aside(self.reservation.idx)
