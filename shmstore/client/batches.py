"""Batches: put, look up and delete many keys, taking each stripe's lock once per step, not once per key.

The keys of a batch are grouped by the stripe that guards their chains;
each group is done under one hold of its stripe lock. A put of many keys is
the put of one key done for a group at a time:

1. reserve: under each group's stripe lock, one invisible ``writing`` entry
   (with its space) per key, exactly as :meth:`Puts.reserve` makes one (the
   arena's C call, told the lock is held, also copies a small value there:
   a few hundred bytes to a chunk's cut, as a single small put does);
2. copy every other value with no lock held;
3. seal: under each group's stripe lock again, every entry of the group
   becomes visible (an overwrite swaps it for the old object).

Failure guarantees, per key as for a single put (never a half-written
object): a key that cannot be reserved (present, being written, no room)
stops the batch before anything is visible, every reservation is given
back and the error names the key. A process killed at any step leaves
each key either sealed whole or not there: its ``writing`` entries are
dropped by the janitor, a lock it held is repaired by the next holder (see
``repair.py``), as after a single put. An exception that comes
asynchronously (a second Ctrl-C: see ``interrupts.py``) gives back every
entry not yet sealed, once no lock is held.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

from ..errors import ObjectNotFoundError, SerializationError, ShmStoreError
from ..meta import layout as L
from ..meta.keyref import Contents, KeyRef, Reservation
from ..meta.table import EntryStolen, find_entry
from ..node import serialize
from ..values import Level, ObjectInfo
from .pins import Pins
from .puts import Puts
from .state import ClientState

__all__ = ["Batches", "by_stripe", "batch_error"]


def by_stripe(refs: Sequence[KeyRef]) -> dict[int, list[int]]:
    """The positions of ``refs`` grouped by stripe (each group in the batch's order)."""
    groups: dict[int, list[int]] = {}
    for i, ref in enumerate(refs):
        groups.setdefault(ref.stripe, []).append(i)
    return groups


def batch_error(exc: ShmStoreError, verb: str, n: int, done: list[str]) -> ShmStoreError:
    """``exc`` (about to be raised) told as the failure of batch ``verb`` of ``n`` keys after ``done``
    were done: its message starts with the verb and what was done, and ``exc.done`` lists those keys."""
    if getattr(exc, "done", None) is None:
        what = "none" if not done else \
            f"{len(done)} ({', '.join(map(repr, done[:3]))}{', ...' if len(done) > 3 else ''})"
        exc.args = (f"{verb} of {n} keys stopped, {what} done: {exc.args[0] if exc.args else exc}",) + exc.args[1:]
        vars(exc)["done"] = done
    return exc


def _encode(key: str, obj: Any) -> serialize.Encoded:
    """``serialize.encode(obj)``, a failure naming ``key`` (in a batch, which one failed matters)."""
    try:
        return serialize.encode(obj)
    except SerializationError as exc:
        exc.args = (f"cannot store {key!r}: {exc.args[0] if exc.args else exc}",) + exc.args[1:]
        vars(exc)["object_id"] = key
        raise


class Batches:
    """The batch verbs of a :class:`~shmstore.client.kernel.Kernel`, sharing its attachment, put side and pins.

    Owned by the kernel (``kernel.batches``). Process-safe through the
    store's locks; thread-safe like the kernel.
    """

    def __init__(self, state: ClientState, puts: Puts, pins: Pins,
                 not_found: Callable[[str, str], ObjectNotFoundError]) -> None:
        self._state, self._puts, self._pins, self._not_found = state, puts, pins, not_found
        self._buf, self._lay, self._table, self._stripes = state.buf, state.lay, state.table, state.stripes
        self.sid, self.session, self.node = state.sid, state.session, state.node

    # ---- put -----------------------------------------------------------------------
    def put_many(self, refs: Sequence[KeyRef], objs: Sequence[Any], level: int,
                 overwrite: bool = False) -> list[ObjectInfo]:
        """Store ``objs[i]`` under ``refs[i]``'s key (distinct keys) on ``level``: all, or none visible.

        Raises:
            ObjectExistsError, ObjectLockedError, StorageFullError (no room for the whole batch, at once),
            SerializationError, InvalidArgumentError: naming the key; nothing is stored.
        """
        encs = [_encode(ref.key, obj) for ref, obj in zip(refs, objs)]
        lv = self._puts.level_of(refs[0].key if refs else "", level)
        held: list[tuple[int, Reservation, bool]] = []
        try:
            for group in by_stripe(refs).values():
                self._reserve_group(refs, encs, group, lv, overwrite, held)
            flags = L.ENTRY_HEAD.get
            for i, r, copied in held:  # the copies, with no lock held
                if not copied:
                    lv.write(r.idx, r.gen, r.offset, flags(self._buf, self._lay.entry(r.idx), "flags"),
                             encs[i], refs[i].key)
            created = self._seal_all(refs, held, overwrite)
        except BaseException:
            for _, r, _ in held:  # a no-op for a sealed entry
                self._puts.give_up(r.idx, r.gen)
            raise
        infos: list[Any] = [None] * len(refs)
        for i, r, _ in held:
            e = encs[i]
            infos[i] = ObjectInfo(refs[i].key, e.nbytes, Level(level), False, True, e.nblobs,
                                  serialize.KIND_NAMES[e.kind], r.stored, 0, self.session, created.get(i, r.ctime))
        return infos

    def _reserve_group(self, refs: Sequence[KeyRef], encs: list[serialize.Encoded], group: list[int],
                       lv: Any, overwrite: bool, held: list[tuple[int, Reservation, bool]]) -> None:
        """Reserve the entries of one stripe's ``group`` under one hold of its lock (again for the rest of
        the group where an entry was stolen meanwhile: rare), appending (position, reservation, whether the
        bytes are copied already) to ``held``. A level's C shortcut (the arena's ``try_put``, told the lock is
        held) reserves, and copies a small value, in one call; the Python step (:meth:`Puts.reserve_held`)
        does the rest.

        Raises:
            ShmStoreError: a key cannot be reserved (named); its entry and the unused ones are back in this
                client's batch, the reservations made stay in ``held`` for the caller to give back.
        """
        supply, todo, state = self._state.supply, list(group), self._state
        try_put = None if overwrite or state.ops is None else lv.try_put
        cut_short: list[tuple[int, int]] = []  # entries a C call was cut short in: given up once unlocked
        lv.prepare(refs[group[0]].key)  # what waits on another process, before the stripe lock
        while todo:
            entries = self._take_entries([refs[i].key for i in todo])  # outside the lock: it may refill
            n, stolen = 0, False
            try:
                with self._stripes[refs[todo[0]].stripe]:
                    for i, entry in zip(todo, entries):
                        held.append(self._reserve_one(refs[i], encs[i], entry, lv, overwrite, try_put,
                                                      cut_short.append, i))
                        n += 1
            except EntryStolen:
                stolen = True  # entries[n] is another client's now: the rest of the group again
            except ShmStoreError:  # on purpose: entries[n] is back in the batch (see reserve_held)
                supply.entries.extend(entries[n + 1:])
                raise
            # asynchronous: entries[n] may be cut short anywhere (see Puts.give_up)
            except BaseException:
                for entry in entries[n:] + cut_short:
                    self._puts.give_up(*entry)
                raise
            supply.entries.extend(entries[n + 1:])  # never used
            todo = todo[n:] if stolen else []

    def _reserve_one(self, ref: KeyRef, e: serialize.Encoded, entry: tuple[int, int], lv: Any, overwrite: bool,
                     try_put: Any, give_up: Any, i: int) -> tuple[int, Reservation, bool]:
        """One key's reservation with its stripe lock held: (i, reservation, bytes copied already)."""
        what = Contents(e.kind, e.size, e.nbytes, e.nblobs, e.meta)
        if try_put is not None:
            if e.src is not None:
                r = try_put(self._state.put_context, ref, e, give_up, True, False, entry)  # copied, left writing
                if r is not None:
                    return (i, r, True)
            r = try_put(self._state.put_context, ref, what, give_up, True, False, entry)  # reserved
            if r is not None:
                return (i, r, False)
        return (i, self._puts.reserve_held(ref, entry, what, lv, overwrite), False)

    def _take_entries(self, keys: list[str]) -> list[tuple[int, int]]:
        """A reserved (index, generation) for each key (see ClientSupply.take_entry), or none.

        Raises:
            StorageFullError: the object table is full (``max_objects``); the ones taken go back.
        """
        supply, out = self._state.supply, []
        try:
            for key in keys:
                out.append(supply.take_entry(key))
        except BaseException:
            supply.entries.extend(out)
            raise
        return out

    def _seal_all(self, refs: Sequence[KeyRef], held: list[tuple[int, Reservation, bool]],
                  overwrite: bool) -> dict[int, float]:
        """Make every reserved entry visible, one hold of each stripe lock for its group; with ``overwrite``
        the creation time each got when swapped in (by position: see :meth:`Puts.replace_held`).

        Raises:
            ObjectLockedError: (overwrite) a plain put of a key is being written meanwhile; the entries
                sealed before it stay (a batch_error says which).
        """
        groups: dict[int, list[tuple[int, Reservation]]] = {}
        for i, r, _ in held:
            groups.setdefault(r.stripe, []).append((i, r))
        buf, lay, puts, state_at = self._buf, self._lay, self._puts, L.entry_state_offset
        done: list[str] = []
        created: dict[int, float] = {}
        for stripe, group in groups.items():
            with self._stripes[stripe]:
                for i, r in group:
                    if overwrite:
                        try:
                            created[i] = puts.replace_held(refs[i], r.idx)
                        except ShmStoreError as exc:
                            raise batch_error(exc, "put_many", len(refs), done) from None
                    else:  # the state byte alone (the lock orders the data before it)
                        buf[state_at(lay.entry(r.idx))] = L.SEALED
                    done.append(refs[i].key)
        return created

    # ---- get -----------------------------------------------------------------------
    def lookup_many(self, refs: Sequence[KeyRef]) -> list[tuple[int, int, L.Entry]]:
        """(index, entry offset, ENTRY_HEAD) of each key's sealed entry, each pinned for this process.

        Raises:
            ObjectNotFoundError: a key has no object (the first missing one in the batch's order, saying how
                many are missing); nothing stays pinned.
        """
        found: list[Any] = [None] * len(refs)
        missing: list[int] = []
        buf, lay, up = self._buf, self._lay, self._pins.up
        try:
            for stripe, group in by_stripe(refs).items():
                with self._stripes[stripe]:
                    for i in group:
                        ref = refs[i]
                        idx, eoff, raw = find_entry(buf, lay, ref.bucket, ref.h, self.sid, ref.kb)
                        e = None if raw is None else L.Entry._make(raw)
                        if e is None or e.state != L.SEALED:
                            missing.append(i)
                            continue
                        up(idx)
                        found[i] = (idx, eoff, e)
        except BaseException:
            self._unpin(found)
            raise
        if missing:
            self._unpin(found)
            first = min(missing)
            more = f" (get_many of {len(refs)} keys: {len(missing)} missing)" if len(missing) > 1 else ""
            raise self._not_found(refs[first].key, more)
        return found

    def _unpin(self, found: list[Any]) -> None:
        for f in found:
            if f is not None:
                self._pins.release(f[0], f[2].gen)

    # ---- delete --------------------------------------------------------------------
    def delete_many(self, refs: Sequence[KeyRef], missing_ok: bool = False) -> list[str]:
        """Hide every key of ``refs`` at once (space freed when their last pins go); the keys deleted.

        Raises:
            ObjectNotFoundError: a key has no object (unless ``missing_ok``); the batch stops there, the
                keys of the stripes done before it are deleted (``exc.done``).
        """
        done: list[str] = []
        for stripe, group in by_stripe(refs).items():
            with self._stripes[stripe]:
                for i in group:
                    ref = refs[i]
                    if self._delete_held(ref):
                        done.append(ref.key)
                    elif not missing_ok:
                        exc = ObjectNotFoundError(f"no object {ref.key!r} to delete", ref.key)
                        raise batch_error(exc, "delete_many", len(refs), done)
        return done

    def _delete_held(self, ref: KeyRef) -> bool:
        """Kernel.delete's step under the stripe lock: False where the key has no object."""
        buf, lay, table = self._buf, self._lay, self._table
        idx, eoff, found = find_entry(buf, lay, ref.bucket, ref.h, self.sid, ref.kb)
        e = None if found is None else L.entry(buf, eoff)
        if e is None or e.state != L.SEALED:
            return False
        # hidden first, then out of its chain (see Kernel.delete)
        table.mark_deleted(idx)
        table.unlink(idx, ref.bucket)
        if not table.pin_count(idx) and not e.flags & L.FLAG_MOVING:  # else: last pin / mover
            self.node.release(idx, supply=self._state.supply)
        return True
