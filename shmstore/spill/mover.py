"""Moving objects between MEMORY and DISK (run by the spill process only).

A move, step by step:

1. under the entry's stripe lock: check it is sealed, unpinned and not
   moving; set ``FLAG_MOVING`` (a spill charges the DISK quota in the same
   ALLOC section);
2. with no lock held: copy the bytes (arena -> ``<idx>.<gen>.tmp`` -> rename,
   or file -> freshly allocated arena extent, which the entry names at once);
3. under the stripe lock again: if nobody pinned or deleted it meanwhile,
   switch the entry to the new level and free the old copy; otherwise drop
   the new copy and leave the object where it was.

Readers never wait for a move (they read the old copy, and their pin makes
the move give up); deleters mark a moving entry ``deleted`` and step 3 frees
it. A move that fails leaves the object where it was, readable.

Crash safety: every change of the DISK quota happens in one ALLOC section
with the entry change it pays for, so the counter always equals
``repair.disk_charged`` of the table; the entry is switched before the old
copy is freed, and files are removed before the entries that name them are
freed. If the spill process is killed mid-move, its replacement's
:meth:`Mover.recover` rolls every half-done move back before serving
anything; a killed client's half-done sections are repaired by whoever next
takes the lock it held (``kernel/repair.py``).
"""
from __future__ import annotations

from typing import Any, Callable

import time

import numpy as np

from ..levels.disk import SpillDir
from ..errors import SpillError
from ..kernel import layout as L
from ..kernel.node import NodeStore
from ..kernel.repair import disk_charged
from ..units import format_size
from .policy import spill_candidates, watermark_excess

__all__ = ["Mover", "MoveError"]


class MoveError(Exception):
    """A move that could not be done (private: turned into a request error, never escapes)."""

    def __init__(self, kind: int, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Mover:
    """Moves objects of one node store between levels; one per spill process, not thread-safe."""

    def __init__(self, node: NodeStore) -> None:
        self.node = node
        self.buf = node.buf
        self.lay = node.layout
        self.disk: SpillDir = node.disk

    # ---- helpers -----------------------------------------------------------
    def key_of(self, idx: int) -> str:
        e = L.entry_raw(self.buf, self.lay.entry(idx))
        return L.entry_key(self.buf, self.lay.entry(idx), e[L.E_KEYLEN]).decode(errors="replace")

    def _state(self, **changes: Any) -> None:
        """Update fields of the spill state, one store each (clients read it without a lock)."""
        for name, value in changes.items():
            L.SPILL_STATE.set(self.buf, L.SPILL_OFFSET, name, value)

    def _check_movable(self, idx: int, gen: int, level: int) -> tuple[Any, ...]:
        e = L.entry_raw(self.buf, self.lay.entry(idx))
        if e[L.E_STATE] != L.SEALED or e[L.E_GEN] != gen:
            raise MoveError(L.ERR_MISSING, f"object (entry {idx}) is gone")
        if e[L.E_LEVEL] != level:
            raise MoveError(L.ERR_MISSING, f"{self.key_of(idx)!r} is not on level {level} any more")
        if e[L.E_FLAGS] & L.FLAG_MOVING:
            raise MoveError(L.ERR_LOCKED, f"{self.key_of(idx)!r} is being moved already")
        if self.node.table.pin_count(idx):
            raise MoveError(L.ERR_LOCKED, f"{self.key_of(idx)!r} is pinned (a view, reader or pin holds it)")
        return e

    def _set_flags(self, idx: int, flags: int) -> None:
        L.set_entry_flags(self.buf, self.lay.entry(idx), flags)

    def _disk_charge(self, nbytes: int) -> None:
        """Charge ``nbytes`` to the DISK quota (ALLOC lock held), or MoveError."""
        cap = L.unpack_spill_state(self.buf).disk_capacity
        used = L.disk_reserved(self.buf)
        if used + nbytes > cap:
            raise MoveError(L.ERR_FULL, f"the disk level is full: {format_size(cap - used)} free of "
                                        f"{format_size(cap)} (raise disk_capacity= / SHMSTORE_DISK_CAPACITY)")
        L.set_disk_reserved(self.buf, used + nbytes)

    def _disk_refund(self, nbytes: int) -> None:
        """Give ``nbytes`` back to the DISK quota (ALLOC lock held)."""
        L.set_disk_reserved(self.buf, max(0, L.disk_reserved(self.buf) - nbytes))

    def _clear_moving(self, idx: int) -> None:
        self._set_flags(idx, L.entry_flags(self.buf, self.lay.entry(idx)) & ~L.FLAG_MOVING)

    # ---- MEMORY -> DISK -------------------------------------------------------
    def spill(self, idx: int, gen: int) -> int:
        """Move entry ``idx`` from MEMORY to DISK; returns the bytes moved (0 if it gave up)."""
        node = self.node
        lock = node.stripe_of(idx)
        with lock:
            e = self._check_movable(idx, gen, L.LEVEL_MEMORY)
            with node.alloc_lock:
                self._disk_charge(e[L.E_SIZE])
                self._set_flags(idx, e[L.E_FLAGS] | L.FLAG_MOVING)
        size, off = e[L.E_SIZE], e[L.E_OFFSET]
        self._state(moving=idx + 1, moving_to=L.LEVEL_DISK, progress=0, total=size)
        try:
            arena = memoryview(node.arena_mm)[off: off + size]
            try:
                self.disk.write(idx, gen, [(0, arena)], size, progress=lambda n: self._state(progress=n))
            finally:
                arena.release()
        except OSError as exc:
            with lock:
                self._give_up_spill(idx, gen, size)
            self._state(moving=0, failures=L.unpack_spill_state(self.buf).failures + 1)
            raise MoveError(L.ERR_IO, f"cannot spill {self.key_of(idx)!r} ({format_size(size)}) to "
                                      f"{self.disk.path}: {exc.strerror or exc}") from exc
        with lock:
            return self._finish_spill(idx, e)

    def _give_up_spill(self, idx: int, gen: int, size: int) -> None:
        """Drop the disk copy of a spill and leave the object in memory (stripe lock held)."""
        self.disk.remove(idx, gen)  # first: a crash leaves a moving entry, which recover() rolls back
        with self.node.alloc_lock:
            self._disk_refund(size)
            self._clear_moving(idx)
        self.node.free_if_unpinned(idx)  # deleted meanwhile: free it now

    def _finish_spill(self, idx: int, e: tuple[Any, ...]) -> int:
        node, buf, lay = self.node, self.buf, self.lay
        eoff = lay.entry(idx)
        now = L.entry_raw(buf, eoff)
        self._state(moving=0)
        size = e[L.E_SIZE]
        if now[L.E_STATE] != L.SEALED or node.table.pin_count(idx):  # deleted or read meanwhile: give up
            self._give_up_spill(idx, e[L.E_GEN], size)
            return 0
        with node.alloc_lock:  # the entry names its new copy before the old one is freed
            L.pack_entry(buf, eoff, self._moved(now, 0, 0, L.LEVEL_DISK))
            if not now[L.E_FLAGS] & L.FLAG_IN_CHUNK:
                node.alloc.free_owned(now[L.E_EXTENT], idx + 1)
        soff = lay.stripe_stats(node.table.stripe_of(idx))
        L.add_stripe_stats(buf, soff, L.LEVEL_MEMORY, -size, -1)
        L.add_stripe_stats(buf, soff, L.LEVEL_DISK, size, 1)
        self._state(spilled=L.unpack_spill_state(buf).spilled + size)
        return int(size)

    @staticmethod
    def _moved(e: tuple[Any, ...], offset: int, extent: int, level: int) -> tuple[Any, ...]:
        f = list(e)
        f[L.E_OFFSET], f[L.E_EXTENT], f[L.E_LEVEL] = offset, extent, level
        if level == L.LEVEL_MEMORY:
            f[L.E_ATIME] = time.monotonic()  # brought back because it is wanted: not the next victim
        f[L.E_FLAGS] = e[L.E_FLAGS] & ~(L.FLAG_MOVING | L.FLAG_IN_CHUNK)
        return tuple(f)

    # ---- DISK -> MEMORY -------------------------------------------------------
    def restore(self, idx: int, gen: int) -> int:
        """Move entry ``idx`` from DISK back to MEMORY, making room if needed; returns the bytes moved."""
        node, buf, lay = self.node, self.buf, self.lay
        lock = node.stripe_of(idx)
        with lock:
            e = self._check_movable(idx, gen, L.LEVEL_DISK)
            self._set_flags(idx, e[L.E_FLAGS] | L.FLAG_MOVING)
        size = e[L.E_SIZE]
        try:
            rec, off = self._allocate(idx, size)
        except MoveError:
            with lock:
                self._clear_moving(idx)
                node.free_if_unpinned(idx)
            raise
        self._state(moving=idx + 1, moving_to=L.LEVEL_MEMORY, progress=0, total=size)
        try:
            node.arena.populate(off, size)
            dst = np.ndarray((size,), np.uint8, node.arena_mm, off)
            self.disk.read_into(idx, gen, dst, progress=lambda n: self._state(progress=n))
        except (OSError, SpillError) as exc:
            with lock:
                self._abort_restore(idx, rec)
            raise MoveError(L.ERR_IO, f"cannot restore {self.key_of(idx)!r} ({format_size(size)}) from "
                                      f"{self.disk.path}: {exc}") from exc
        with lock:
            now = L.entry_raw(buf, lay.entry(idx))
            self._state(moving=0)
            if now[L.E_STATE] != L.SEALED or node.table.pin_count(idx):
                self._abort_restore(idx, rec)
                return 0
            with node.alloc_lock:
                L.pack_entry(buf, lay.entry(idx), self._moved(now, off, rec, L.LEVEL_MEMORY))
                self._disk_refund(size)
            soff = lay.stripe_stats(node.table.stripe_of(idx))
            L.add_stripe_stats(buf, soff, L.LEVEL_DISK, -size, -1)
            L.add_stripe_stats(buf, soff, L.LEVEL_MEMORY, size, 1)
            self.disk.remove(idx, gen)  # a crash before this leaves a stray file: recover() removes it
        self._state(restored=L.unpack_spill_state(buf).restored + size)
        return int(size)

    def _allocate(self, idx: int, size: int) -> tuple[int, int]:
        """An arena extent for restoring entry ``idx``, which names it at once (see alloc.py)."""
        node, eoff = self.node, self.lay.entry(idx)
        for attempt in range(2):
            with node.alloc_lock:
                rec, off = node.alloc.alloc(size, idx + 1)
                if not rec and node.reclaim_retired_locked():
                    rec, off = node.alloc.alloc(size, idx + 1)
                if rec:
                    L.set_entry_extent(self.buf, eoff, rec)
                    return rec, off
            if attempt == 0:
                self.make_room(size, exclude=idx)
        raise MoveError(L.ERR_FULL, f"no room in memory for {self.key_of(idx)!r} ({format_size(size)})")

    def _abort_restore(self, idx: int, rec: int) -> None:
        """Drop the memory copy of a restore and leave the object on disk (stripe lock held)."""
        self._state(moving=0)
        with self.node.alloc_lock:
            L.set_entry_extent(self.buf, self.lay.entry(idx), 0)
            self.node.alloc.free_owned(rec, idx + 1)
            self._clear_moving(idx)
        self.node.free_if_unpinned(idx)

    # ---- policy-driven moves ---------------------------------------------------
    def largest_free(self) -> int:
        with self.node.alloc_lock:
            self.node.reclaim_retired_locked()
            free = self.node.alloc.free_extents()
        return max((size for _, size in free), default=0)

    def make_room(self, nbytes: int, exclude: int = -1) -> int:
        """Spill least recently used objects until ``nbytes`` fit in one piece; returns bytes spilled.

        Raises:
            MoveError: not enough spillable data (ERR_FULL) or a spill failed (ERR_IO).
        """
        spilled = 0
        while self.largest_free() < nbytes:
            entries = L.entry_table(self.buf, self.lay)
            cands = spill_candidates(entries, self.node.table.pin_counts(), exclude, whole_extents_first=True)
            if not len(cands):
                cap = self.node.capacity
                raise MoveError(L.ERR_FULL, f"cannot make {format_size(nbytes)} of room in memory: the rest of "
                                            f"its {format_size(cap)} is pinned, being written or fragmented "
                                            f"(raise capacity= / SHMSTORE_CAPACITY)")
            for idx in cands:
                spilled += self._spill_quietly(int(idx))
                if self.largest_free() >= nbytes:
                    return spilled
        return spilled

    def _spill_quietly(self, idx: int) -> int:
        gen = L.entry_gen(self.buf, self.lay.entry(idx))
        try:
            return self.spill(idx, gen)
        except MoveError as exc:
            if exc.kind in (L.ERR_LOCKED, L.ERR_MISSING):
                return 0  # read, pinned or deleted since the snapshot: take the next one
            raise

    def relieve(self, budget: float = 0.2, interrupt: Callable[[], bool] = lambda: False) -> int:
        """Spill LRU objects while MEMORY is above the high watermark, down to the low one.

        Stops after ``budget`` seconds or when ``interrupt()`` says requests wait.
        """
        s = L.unpack_spill_state(self.buf)
        need = watermark_excess(self.node.used(L.LEVEL_MEMORY), self.node.capacity, s.high, s.low)
        if not need:
            return 0
        deadline, moved = time.monotonic() + budget, 0
        entries = L.entry_table(self.buf, self.lay)
        for idx in spill_candidates(entries, self.node.table.pin_counts()):
            if moved >= need or time.monotonic() > deadline or interrupt():
                break
            moved += self._spill_quietly(int(idx))
        return moved

    # ---- recovery ---------------------------------------------------------------
    def recover(self) -> int:
        """Roll back the moves a killed spill process left half done; drop stray files.

        Returns how many moves were rolled back.
        """
        node, buf, lay = self.node, self.buf, self.lay
        t = L.entry_table(buf, lay)
        moving = np.flatnonzero((t["state"] != L.FREE) & (t["state"] != L.RESERVED)
                                & ((t["flags"] & L.FLAG_MOVING) != 0))
        for idx in moving.tolist():
            with node.stripe_of(idx):
                e = L.entry_raw(buf, lay.entry(idx))
                if not e[L.E_FLAGS] & L.FLAG_MOVING:
                    continue
                if e[L.E_LEVEL] == L.LEVEL_MEMORY:  # a spill: its disk copy goes, its charge too
                    self._give_up_spill(idx, e[L.E_GEN], e[L.E_SIZE])
                else:  # a restore: its memory copy goes
                    self._abort_restore(idx, e[L.E_EXTENT])
        self._state(moving=0)
        with node.alloc_lock:  # the counter is derived state: make sure it is exact
            L.set_disk_reserved(buf, disk_charged(buf, lay))
        for name in self.disk.names():
            self._remove_stray(name)
        return len(moving)

    def _remove_stray(self, name: str) -> None:
        """Remove a file no entry explains, re-checking under the entry's lock (a put may be racing).

        ``<idx>.<gen>`` belongs to a DISK entry; ``<idx>.<gen>.tmp`` to one
        being written to disk by a client (a writer, a put on DISK).
        """
        parts = name.split(".")
        try:
            idx, gen = int(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            return  # not ours: leave it
        if len(parts) > 3 or (len(parts) == 3 and parts[2] != "tmp") or not 0 <= idx < self.lay.max_objects:
            return
        with self.node.stripe_of(idx):
            e = L.entry_raw(self.buf, self.lay.entry(idx))
            if e[L.E_STATE] not in (L.FREE, L.RESERVED) and e[L.E_GEN] == gen and e[L.E_LEVEL] == L.LEVEL_DISK:
                if len(parts) == 2 or e[L.E_STATE] == L.WRITING:
                    return
            self.disk.unlink(name)
