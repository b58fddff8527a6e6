"""Moving objects between MEMORY and DISK (run by the spill process only).

A move, step by step:

1. under the entry's stripe lock: check it is sealed, unpinned and not
   moving, charge the target level, set ``FLAG_MOVING``;
2. with no lock held: copy the bytes (arena -> ``<idx>.<gen>.tmp`` -> rename,
   or file -> freshly allocated arena extent, recorded in the entry);
3. under the stripe lock again: if nobody pinned or deleted it meanwhile,
   switch the entry to the new level and free the old copy; otherwise drop
   the new copy and leave the object where it was.

Readers never wait for a move (they read the old copy, and their pin makes
the move give up); deleters mark a moving entry ``deleted`` and step 3 frees
it. A move that fails leaves the object where it was, readable. If the spill
process is killed mid-move, its replacement's :meth:`Mover.recover` rolls
every half-done move back before serving anything.
"""
from __future__ import annotations

import os
import time

import numpy as np

from .disk import SpillDir
from .kernel import layout as L
from .kernel.node import NodeStore
from .policy import spill_candidates, watermark_excess
from .units import format_size

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
        self.buf = node.meta.mm
        self.lay = node.layout
        self.disk: SpillDir = node.disk

    # ---- helpers -----------------------------------------------------------
    def key_of(self, idx: int) -> str:
        e = L.entry_raw(self.buf, self.lay.entry(idx))
        return L.entry_key(self.buf, self.lay.entry(idx), e[L.E_KEYLEN]).decode(errors="replace")

    def _state(self, **changes) -> None:
        s = L.unpack_spill_state(self.buf)
        L.pack_spill_state(self.buf, s._replace(**changes))

    def _check_movable(self, idx: int, gen: int, level: int) -> tuple:
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
        with self.node.alloc_lock:
            L.set_disk_reserved(self.buf, max(0, L.disk_reserved(self.buf) - nbytes))

    # ---- MEMORY -> DISK -------------------------------------------------------
    def spill(self, idx: int, gen: int) -> int:
        """Move entry ``idx`` from MEMORY to DISK; returns the bytes moved (0 if it gave up)."""
        node, buf, lay = self.node, self.buf, self.lay
        lock = node.stripe_of(idx)
        with lock:
            e = self._check_movable(idx, gen, L.LEVEL_MEMORY)
            with node.alloc_lock:
                self._disk_charge(e[L.E_SIZE])
            self._set_flags(idx, e[L.E_FLAGS] | L.FLAG_MOVING)
        size, off = e[L.E_SIZE], e[L.E_OFFSET]
        self._state(moving=idx + 1, moving_to=L.LEVEL_DISK, progress=0, total=size)
        try:
            arena = memoryview(node.arena.mm)[off: off + size]
            try:
                self.disk.write(idx, gen, [(0, arena)], size, progress=lambda n: self._state(progress=n))
            finally:
                arena.release()
        except OSError as exc:
            with lock:
                self._set_flags(idx, L.entry_flags(buf, lay.entry(idx)) & ~L.FLAG_MOVING)
                node.free_if_unpinned(idx)
            self._disk_refund(size)
            self._state(moving=0, failures=L.unpack_spill_state(buf).failures + 1)
            raise MoveError(L.ERR_IO, f"cannot spill {self.key_of(idx)!r} ({format_size(size)}) to "
                                      f"{self.disk.path}: {exc.strerror or exc}") from exc
        with lock:
            return self._finish_spill(idx, e)

    def _finish_spill(self, idx: int, e: tuple) -> int:
        node, buf, lay = self.node, self.buf, self.lay
        eoff = lay.entry(idx)
        now = L.entry_raw(buf, eoff)
        self._state(moving=0)
        size = e[L.E_SIZE]
        if now[L.E_STATE] != L.SEALED or node.table.pin_count(idx):  # deleted or read meanwhile: give up
            self.disk.remove(idx, e[L.E_GEN])
            self._disk_refund(size)
            self._set_flags(idx, now[L.E_FLAGS] & ~L.FLAG_MOVING)
            node.free_if_unpinned(idx)
            return 0
        soff = lay.stripe_stats(node.table.stripe_of(idx))
        L.add_stripe_stats(buf, soff, L.LEVEL_MEMORY, -size, -1)
        L.add_stripe_stats(buf, soff, L.LEVEL_DISK, size, 1)
        with node.alloc_lock:
            if not e[L.E_FLAGS] & L.FLAG_IN_CHUNK:
                node.alloc.free(e[L.E_EXTENT])
        L.ENTRY_HEAD.pack_into(buf, eoff, *self._moved(now, 0, 0, L.LEVEL_DISK))
        self._state(spilled=L.unpack_spill_state(buf).spilled + size)
        return size

    @staticmethod
    def _moved(e: tuple, offset: int, extent: int, level: int) -> tuple:
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
                self._set_flags(idx, L.entry_flags(buf, lay.entry(idx)) & ~L.FLAG_MOVING)
                node.free_if_unpinned(idx)
            raise
        with lock:
            L.set_entry_extent(buf, lay.entry(idx), rec)  # so a rollback can free it
        self._state(moving=idx + 1, moving_to=L.LEVEL_MEMORY, progress=0, total=size)
        try:
            node.arena.populate(off, size)
            dst = np.ndarray((size,), np.uint8, node.arena.mm, off)
            self.disk.read_into(idx, gen, dst, progress=lambda n: self._state(progress=n))
        except OSError as exc:
            self._abort_restore(idx, rec)
            raise MoveError(L.ERR_IO, f"cannot restore {self.key_of(idx)!r} ({format_size(size)}) from "
                                      f"{self.disk.path}: {exc.strerror or exc}") from exc
        with lock:
            now = L.entry_raw(buf, lay.entry(idx))
            self._state(moving=0)
            if now[L.E_STATE] != L.SEALED or node.table.pin_count(idx):
                self._abort_restore(idx, rec, locked=True)
                return 0
            soff = lay.stripe_stats(node.table.stripe_of(idx))
            L.add_stripe_stats(buf, soff, L.LEVEL_DISK, -size, -1)
            L.add_stripe_stats(buf, soff, L.LEVEL_MEMORY, size, 1)
            L.ENTRY_HEAD.pack_into(buf, lay.entry(idx), *self._moved(now, off, rec, L.LEVEL_MEMORY))
        self._disk_refund(size)
        self.disk.remove(idx, gen)
        self._state(restored=L.unpack_spill_state(buf).restored + size)
        return size

    def _allocate(self, idx: int, size: int) -> tuple[int, int]:
        node = self.node
        for attempt in range(2):
            with node.alloc_lock:
                rec, off = node.alloc.alloc(size, idx + 1)
                if not rec and node.reclaim_retired_locked():
                    rec, off = node.alloc.alloc(size, idx + 1)
            if rec:
                return rec, off
            if attempt == 0:
                self.make_room(size, exclude=idx)
        raise MoveError(L.ERR_FULL, f"no room in memory for {self.key_of(idx)!r} ({format_size(size)})")

    def _abort_restore(self, idx: int, rec: int, locked: bool = False) -> None:
        node, buf, lay = self.node, self.buf, self.lay
        self._state(moving=0)
        if not locked:
            with node.stripe_of(idx):
                return self._abort_restore(idx, rec, locked=True)
        with node.alloc_lock:
            node.alloc.free(rec)
        eoff = lay.entry(idx)
        L.set_entry_extent(buf, eoff, 0)
        self._set_flags(idx, L.entry_flags(buf, eoff) & ~L.FLAG_MOVING)
        node.free_if_unpinned(idx)

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

    def relieve(self, budget: float = 0.2, interrupt=lambda: False) -> int:
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
        moving = np.flatnonzero((t["state"] != L.FREE) & ((t["flags"] & L.FLAG_MOVING) != 0))
        for idx in moving:
            idx = int(idx)
            with node.stripe_of(idx):
                e = L.entry_raw(buf, lay.entry(idx))
                if e[L.E_LEVEL] == L.LEVEL_MEMORY:
                    self.disk.remove(idx, e[L.E_GEN])
                elif e[L.E_EXTENT]:
                    with node.alloc_lock:
                        node.alloc.free(e[L.E_EXTENT])
                    L.set_entry_extent(buf, lay.entry(idx), 0)
                self._set_flags(idx, e[L.E_FLAGS] & ~L.FLAG_MOVING)
                node.free_if_unpinned(idx)
        self._state(moving=0)
        with node.alloc_lock:  # recount the disk quota from what is on disk now
            disk = (t["state"] != L.FREE) & (t["state"] != L.RESERVED) & (t["level"] == L.LEVEL_DISK)
            L.set_disk_reserved(buf, int(t["size"][disk].sum()))
            known = {f"{i}.{t['gen'][i]}" for i in np.flatnonzero(disk)}
        for name in self.disk.names():
            if name not in known and not name.endswith(".tmp"):
                self._remove_stray(name)
        return len(moving)

    def _remove_stray(self, name: str) -> None:
        """Remove a file no DISK entry names, re-checking under the entry's lock (a put may be racing)."""
        try:
            idx, gen = (int(x) for x in name.split("."))
        except ValueError:
            return
        if not 0 <= idx < self.lay.max_objects:
            return
        with self.node.stripe_of(idx):
            e = L.entry_raw(self.buf, self.lay.entry(idx))
            if e[L.E_STATE] not in (L.FREE, L.RESERVED) and e[L.E_GEN] == gen and e[L.E_LEVEL] == L.LEVEL_DISK:
                return
            try:
                os.unlink(os.path.join(self.disk.path, name))
            except OSError:
                pass
