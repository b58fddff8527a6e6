"""The MEMORY level: the node store's shared-memory arena, cut by its extent allocator.

Small objects are cut from the putting client's current chunk
(``node/supplies.py``), others get an extent of their own, which the entry
names in the ALLOC-locked section that allocates it (two-way ownership:
``meta/alloc.py``). The C fast path (``meta/_fast.c``) is a shortcut of
:meth:`MemoryLevel.place` plus :meth:`MemoryLevel.write` for small values.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Literal

import numpy as np

from ..errors import StorageFullError
from ..meta import layout as L
from ..meta.fastpath import codes
from ..meta.keyref import Contents, KeyRef, Reservation, being_written_error, exists_error
from ..meta.table import EntryStolen, owns_entry
from ..node import serialize
from ..node.protocols import LevelHost, PutContext
from ..units import format_size
from ..values import Level
from .device import is_device_array, to_host

if TYPE_CHECKING:
    from ..node.serialize import Encoded

__all__ = ["MemoryLevel", "ArenaSink"]

_MEMORY = int(Level.MEMORY)
_new = tuple.__new__


def _declined(client: PutContext, ref: KeyRef, rc: int) -> None:
    """What a C insert or put_small that changed nothing answered ``rc`` calls for: the key's error raised, or
    nothing (a busy stripe lock, or one a dead holder left, which the call repaired and released).

    Raises:
        ObjectLockedError: the key is being written. ObjectExistsError: it is present.
    """
    if rc == codes.BEING_WRITTEN:
        raise being_written_error(ref.key)
    elif rc == codes.EXISTS:
        raise exists_error(ref.key)


class MemoryLevel:
    """The shm arena of one node store (see :class:`~shmstore.node.protocols.MovableLevel`).

    Built from the store's :class:`~shmstore.node.protocols.LevelHost` and
    owned by it; owns nothing of its own (the arena is the store's).
    Process-safe through the store's locks; thread-safe.
    """

    level = Level.MEMORY
    spill_to: Level | None = Level.DISK
    setting = "capacity= / SHMSTORE_CAPACITY"

    def __init__(self, host: LevelHost) -> None:
        self.host = host

    def available(self) -> str | None:
        return None

    def total(self) -> int:
        return int(self.host.capacity)

    def watermarks(self) -> tuple[float, float]:
        """(high, low) fractions of the capacity that the spill policy keeps usage between."""
        s = L.unpack_spill_state(self.host.buf)
        return s.high, s.low

    # ---- space ---------------------------------------------------------------------
    def prepare(self, key: str) -> None:
        pass  # the arena is there from the store's creation

    def place(self, key: str, idx: int, gen: int, size: int, client: PutContext,
              write_entry: Callable[[int, int, int], None]) -> tuple[int, int, int]:
        supply = client.supply
        if size <= supply.small_max:
            with supply.chunk_lock:  # until the entry names the chunk (see node/supplies.py)
                rec, off = supply.carve(size)
                if rec:
                    write_entry(off, rec, L.FLAG_IN_CHUNK)
                    return off, rec, L.FLAG_IN_CHUNK
        rec, off = self.alloc_extent(key, idx, gen, size, client.slot)
        write_entry(off, rec, 0)
        return off, rec, 0

    def alloc_extent(self, key: str, idx: int, gen: int, size: int, slot: int) -> tuple[int, int]:
        """An extent of its own for reserved entry ``idx``, which names it at once.

        Raises:
            StorageFullError: no extent fits. EntryStolen: the entry is not ``slot``'s any more.
        """
        node, eoff = self.host, self.host.layout.entry(idx)
        with node.alloc_lock:
            if not owns_entry(node.buf, eoff, slot, gen):
                raise EntryStolen
            rec, off = self._alloc_locked(size, idx)
            if rec:
                L.ENTRY_HEAD.set(node.buf, eoff, "extent", rec)
                return rec, off
        raise self.full(key, size)

    def _alloc_locked(self, size: int, idx: int) -> tuple[int, int]:
        node = self.host
        rec, off = node.alloc.alloc(size, idx + 1)
        if not rec and node.reclaim_retired_locked():
            rec, off = node.alloc.alloc(size, idx + 1)
        return rec, off

    def full(self, key: str | None, size: int) -> StorageFullError:
        """The error for ``key`` of ``size`` bytes not fitting in memory."""
        used, cap = self.host.used(L.LEVEL_MEMORY), self.host.capacity
        hint = "" if cap - used < size else ", in pieces too small"
        return StorageFullError(
            f"cannot place {key!r} ({format_size(size)}) in memory: {format_size(cap - used)} free of "
            f"{format_size(cap)}{hint} (raise {self.setting}, or allow Level.DISK)", key, Level.MEMORY, size,
            cap - used)

    def largest_free(self) -> int:
        """The largest piece of free space (what one object can take)."""
        node = self.host
        with node.alloc_lock:
            node.reclaim_retired_locked()
            free = node.alloc.free_extents()
        return max((size for _, size in free), default=0)

    # ---- the shortcut for small values: the C fast path (meta/_fast.c) -----------------------------
    def try_put(self, client: PutContext, ref: KeyRef, what: Encoded | Contents,
                give_up: Callable[[int, int], object], held: bool = False, seal: bool = True,
                entry: tuple[int, int] | None = None) -> Reservation | None:
        """:meth:`place` plus :meth:`write` and the entry's insert in one locked C call: with ``what.src``
        (a contiguous array or bytes value of at most a chunk's cut, or a fetched copy) its bytes are copied
        and the entry sealed, a whole put; without, the entry is reserved (state ``writing``).

        With ``held`` the caller holds the key's stripe lock (a batch, for a
        group of keys): the C call neither takes nor releases it, and the
        entry to use is ``entry`` (taken before the lock: a refill may steal,
        which takes every stripe lock), left to the caller where this returns
        None; with ``seal=False`` copied bytes are left ``writing``, for the
        caller to seal.

        Returns None (nothing changed) to leave it to the general way:
        no C extension, a value the C call cannot copy, no room (so that
        way reports the right error), or a busy stripe lock. ``give_up``
        drops the entry where an exception cuts this short.

        Raises:
            ObjectExistsError: the key is present. ObjectLockedError: it is being written.
            EntryStolen: (only with ``entry``) another client holds that entry now; nothing changed.
        """
        supply, src, ops = client.supply, what.src, client.ops
        if ops is None:
            return None
        if src is not None and what.kind != L.KIND_RAW and (  # raw bytes are one contiguous buffer (encode)
                what.kind == L.KIND_PICKLE or what.device
                or (isinstance(src, np.ndarray) and not (src.flags.c_contiguous or src.flags.f_contiguous))):
            return None
        if src is not None and what.size > supply.small_max:
            return None
        if entry is not None:  # EntryStolen goes to the caller, which takes another outside the lock
            return self._place_and_insert(client, ref, entry, what, give_up, (held, seal))
        if src is not None and seal and not held and ops.ctx is not None:
            done = self._put_small(client, ref, what)
            if done is not False:
                return done
        while True:
            entry = supply.take_entry(ref.key)
            try:
                done = self._place_and_insert(client, ref, entry, what, give_up, (held, seal))
            except EntryStolen:
                continue  # another client holds that entry now
            if done is None:
                supply.entries.append(entry)  # the general way takes an entry of its own
            return done

    def _put_small(self, client: PutContext, ref: KeyRef,
                   what: Encoded | Contents) -> Reservation | None | Literal[False]:
        """The whole of :meth:`try_put` for a value to copy and seal at once, in one C call (``put_small``: a
        cut of the chunk, the copy, the entry's insert) under the chunk lock: its Reservation; None as
        try_put's; False where this C call cannot do it (a value for a chunk of its own, no chunk to be had,
        an older build), for the steps one by one.

        Raises:
            ObjectExistsError, ObjectLockedError, StorageFullError (the object table is full).
        """
        supply, ops, fresh = client.supply, client.ops, False
        if ops is None:
            return False
        while True:
            # a batch more (StorageFullError: the table is full), outside the chunk lock
            if not supply.entries:
                supply.entries.append(supply.take_entry(ref.key))
            with supply.chunk_lock:
                r = ops.put_small(ref, what, supply.entries, supply.cut)
                # once: a fresh chunk holds any small value
                if r == codes.NO_CUT and not fresh and supply.new_chunk():
                    fresh = True
                    continue
            if type(r) is tuple:
                done: Reservation = _new(Reservation, r)
                return done
            if r == codes.NO_ENTRY:
                continue
            _declined(client, ref, r)
            return None if r == codes.BUSY or r == codes.OWNER_DEAD else False

    def _place_and_insert(self, client: PutContext, ref: KeyRef, held: tuple[int, int], what: Encoded | Contents,
                          give_up: Callable[[int, int], object],
                          mode: tuple[bool, bool] = (False, True)) -> Reservation | None:
        """Place ``what`` for entry ``held`` = (index, generation), in a cut of the client's chunk or an extent
        of its own, then insert the entry (see :meth:`_insert`).

        Raises:
            EntryStolen: the entry is not ours any more (nothing changed).
        """
        supply, stored = client.supply, L.align(max(what.size, 1))
        if stored <= supply.small_max:
            with supply.chunk_lock:  # until the entry names the chunk (see node/supplies.py)
                rec, off = supply.carve(stored)
                if rec:
                    return self._insert(client, ref, held, what, (off, rec, L.FLAG_IN_CHUNK, stored), give_up, mode)
        try:
            rec, off = self.alloc_extent(ref.key, held[0], held[1], stored, client.slot)
        except StorageFullError:
            return None
        return self._insert(client, ref, held, what, (off, rec, 0, stored), give_up, mode)

    def _insert(self, client: PutContext, ref: KeyRef, held: tuple[int, int], what: Encoded | Contents,
                space: tuple[int, int, int, int], give_up: Callable[[int, int], object],
                mode: tuple[bool, bool] = (False, True)) -> Reservation | None:
        """The locked C call: the entry of ``held`` written and linked (copied and sealed with ``what.src``)
        in ``space`` = (offset, extent, flags, bytes taken); undone where it did not happen. ``mode`` = (the
        caller holds the stripe lock, seal copied bytes): see :meth:`try_put`."""
        (idx, gen), (off, rec, flags, stored), ops = held, space, client.ops
        if ops is None:
            return None
        try:
            data = what.src
            if data is not None and off + what.size > client.prefault.populated and not flags & L.FLAG_IN_CHUNK:
                client.prefault.ensure(off, what.size, ref.key)
            rc, ctime = ops.insert(ref, held, space, what, L.SEALED if data is not None and mode[1] else L.WRITING,
                                   mode[0])
            if rc == 0:  # in the try: an asynchronous exception before the caller holds it must undo the entry
                done: Reservation = _new(Reservation, (idx, gen, off, stored, ctime, ref.stripe))  # no Python __new__
                return done
        # maybe after the C call did it all (asynchronous): see Puts.give_up (a sealed entry stays; a written one
        # goes, with the extent of its own it names)
        except BaseException:
            give_up(idx, gen)
            raise
        self.unplace(idx, rec, flags)
        if rc == codes.STOLEN:
            raise EntryStolen
        if rc == codes.BEING_WRITTEN or rc == codes.EXISTS:
            client.supply.entries.append(held)  # unused: back to the batch
        _declined(client, ref, rc)
        return None

    def unplace(self, idx: int, extent: int, flags: int) -> None:
        if not flags & L.FLAG_IN_CHUNK:  # a cut of a chunk stays unused until the chunk goes
            unplace_extent(self.host, idx, extent)

    def drop(self, idx: int, e: L.Entry) -> None:
        pass  # the bytes live in the arena: freeing the extent is all

    def remove_files(self) -> int:
        return 0  # nothing outside the arena

    def free_locked(self, idx: int, e: L.Entry) -> None:
        if e.extent and not e.flags & L.FLAG_IN_CHUNK:
            self.host.alloc.free_owned(e.extent, idx + 1)

    # ---- bytes ---------------------------------------------------------------------
    def write(self, idx: int, gen: int, offset: int, flags: int, enc: serialize.Encoded, key: str) -> None:
        prefault = self.host.prefault
        if offset + enc.size > prefault.populated and not flags & L.FLAG_IN_CHUNK:  # chunks are faulted in
            prefault.ensure(offset, enc.size, key)
        serialize.write(enc, self.host.arena_mm, offset)

    def sink(self, idx: int, gen: int, offset: int, size: int, key: str) -> ArenaSink:
        node = self.host
        if offset + size > node.prefault.populated \
                and not L.ENTRY_HEAD.get(node.buf, node.layout.entry(idx), "flags") & L.FLAG_IN_CHUNK:  # chunk: faulted
            node.prefault.ensure(offset, size, key)
        return ArenaSink(np.ndarray((size,), np.uint8, self.host.arena_mm, offset))

    def view(self, idx: int, gen: int, offset: int, nbytes: int) -> tuple[Any, int]:
        return self.host.arena_ro, offset

    # ---- moves onto this level -----------------------------------------------------------
    def charge_move_locked(self, idx: int, e: L.Entry) -> None:
        pass  # space is placed by space_for_move (room may have to be made first)

    def space_for_move(self, idx: int, size: int) -> tuple[int, int]:
        node, eoff = self.host, self.host.layout.entry(idx)
        with node.alloc_lock:
            rec, off = self._alloc_locked(size, idx)
            if rec:
                L.ENTRY_HEAD.set(node.buf, eoff, "target_extent", rec)
                return off, rec
        raise self.full(None, size)

    def write_move(self, idx: int, gen: int, offset: int, src: Any, size: int,
                   progress: Callable[[int], None]) -> None:
        self.host.arena.populate(offset, size)
        dst = np.ndarray((size,), np.uint8, self.host.arena_mm, offset)
        if is_device_array(src):  # down from the GPU level
            to_host(dst, src)
            progress(size)
        else:
            copy_in_steps(dst, src, progress)

    def abort_move(self, idx: int, e: L.Entry) -> None:
        abort_arena_move(self.host, idx)

    # ---- checks and recovery: the allocator's (check.py, repair.py) cover the arena itself ---------
    def check(self, t: np.ndarray) -> list[str]:
        return check_arena_objects(self.host, self.level, t, "in memory")

    def recount_locked(self, t: np.ndarray) -> None:
        pass  # no counter of its own: the allocator is rebuilt by the ALLOC repair

    def remove_orphans(self) -> int:
        return 0

    def drop_lost(self) -> int:
        return 0  # the arena outlives every process

    def close(self) -> None:
        pass


def check_arena_objects(host: LevelHost, level: int, t: np.ndarray, where: str) -> list[str]:
    """What is wrong with where the objects of arena level ``level`` lie, per the entry table copy ``t`` (every
    lock held): each inside an extent of its own (or a cut of a chunk), and no two of them, nor a move's new
    copy onto the level, overlapping."""
    ext = L.extent_table(host.buf, host.layout)
    n, _ = L.extent_cursor(host.buf)
    live = np.isin(t["state"], (L.WRITING, L.SEALED, L.DELETED))
    problems: list[str] = []
    spans = []
    for idx in np.flatnonzero(live & (t["level"] == level)).tolist():
        e = t[idx]
        rec, off, size = int(e["extent"]), int(e["offset"]), int(e["size"])
        if not 0 < rec <= n:
            problems.append(f"entry {idx}: {where} but names no extent ({rec})")
            continue
        x = ext[rec - 1]
        chunked = bool(e["flags"] & L.FLAG_IN_CHUNK)
        kind_ok = x["flags"] in (L.EXT_CHUNK, L.EXT_RETIRED) if chunked else (
            x["flags"] == L.EXT_USED and x["owner"] == idx + 1)
        if not kind_ok or not (x["offset"] <= off and off + size <= x["offset"] + x["size"]):
            problems.append(f"entry {idx}: its bytes [{off}, {off + size}) are not inside its extent {rec} "
                            f"(kind {x['flags']}, owner {x['owner']}, [{x['offset']}, {x['offset'] + x['size']}))")
        spans.append((off, off + size, idx))
    moving = live & ((t["flags"] & L.FLAG_MOVING) != 0) & (t["target"] == level) & (t["target_extent"] != 0)
    for idx in np.flatnonzero(moving).tolist():  # the new copy of a move in flight (check.py: it is its own)
        rec = int(t["target_extent"][idx])
        if 0 < rec <= n and ext["flags"][rec - 1] == L.EXT_USED and ext["owner"][rec - 1] == idx + 1:
            spans.append((int(ext["offset"][rec - 1]), int(ext["offset"][rec - 1] + ext["size"][rec - 1]), idx))
    spans.sort()
    for (_, a1, i), (b0, b1, j) in zip(spans, spans[1:]):
        if b0 < a1:
            problems.append(f"entries {i} and {j} overlap in the arena at [{b0}, {min(a1, b1)})")
    return problems


def unplace_extent(node: LevelHost, idx: int, extent: int) -> None:
    """Give back the extent placed for entry ``idx`` whose entry was not made (any arena level)."""
    if not extent:
        return
    eoff = node.layout.entry(idx)
    with node.alloc_lock:
        if L.ENTRY_HEAD.get(node.buf, eoff, "extent") == extent:
            L.ENTRY_HEAD.set(node.buf, eoff, "extent", 0)
        node.alloc.free_owned(extent, idx + 1)  # records are shared: freed into their own arena


def abort_arena_move(node: LevelHost, idx: int) -> None:
    """Roll back a move onto an arena level: free the extent it placed, stop the move (stripe lock held)."""
    eoff = node.layout.entry(idx)
    with node.alloc_lock:
        rec = L.ENTRY_HEAD.get(node.buf, eoff, "target_extent")
        L.ENTRY_HEAD.set(node.buf, eoff, "target_extent", 0)
        if rec:
            node.alloc.free_owned(rec, idx + 1)
        L.ENTRY_HEAD.set(node.buf, eoff, "flags", L.ENTRY_HEAD.get(node.buf, eoff, "flags") & ~L.FLAG_MOVING)


def copy_in_steps(dst: np.ndarray, src: Any, progress: Callable[[int], None], step: int = 64 << 20) -> None:
    """Copy the bytes of ``src`` into the uint8 array ``dst`` in steps, reporting progress."""
    size = dst.nbytes
    srcv = np.frombuffer(src, np.uint8, size) if size else dst[:0]
    for pos in range(0, size, step):
        n = min(step, size - pos)
        dst[pos: pos + n] = srcv[pos: pos + n]
        progress(pos + n)


class ArenaSink:
    """A writer's target in an arena mapped here: filled in place."""

    def __init__(self, dst: np.ndarray) -> None:
        self._dst: np.ndarray | None = dst

    def write(self, data: Any, pos: int) -> None:
        if self._dst is not None:
            src = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)  # bytes-like too
            self._dst[pos: pos + len(src)] = src

    def buffer(self) -> np.ndarray | None:
        return self._dst

    def close(self) -> None:
        self._dst = None

    def abort(self) -> None:
        self._dst = None
