"""Moving objects between levels (run by the spill process only): MEMORY to DISK and back, GPU to MEMORY.

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
with the entry change it pays for, so the counter always equals what the
table charges (``DiskLevel.charged``); the entry is switched before the old
copy is freed, and files are removed before the entries that name them are
freed. If the spill process is killed mid-move, its replacement's
:meth:`Mover.recover` rolls every half-done move back before serving
anything; a killed client's half-done sections are repaired by whoever next
takes the lock it held (``node/repair.py``).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from ..errors import SpillError, StorageFullError
from ..levels import Level
from ..meta import layout as L
from ..node.nodestore import NodeStore
from ..node.protocols import MovableLevel
from ..units import format_size
from .policy import arena_used, spill_candidates, watermark_excess

__all__ = ["Mover", "MoveError"]

log = logging.getLogger("shmstore.spill")


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

    # ---- helpers -----------------------------------------------------------
    def key_of(self, idx: int) -> str:
        eoff = self.lay.entry(idx)
        return L.entry_key(self.buf, eoff, L.entry(self.buf, eoff).keylen).decode(errors="replace")

    def _state(self, **changes: Any) -> None:
        """Update fields of the spill state, one store each (clients read it without a lock)."""
        for name, value in changes.items():
            L.SPILL_STATE.set(self.buf, L.SPILL_OFFSET, name, value)

    def _check_movable(self, idx: int, gen: int, level: int | None) -> L.Entry:
        e = L.entry(self.buf, self.lay.entry(idx))
        if e.state != L.SEALED or e.gen != gen:
            raise MoveError(L.ERR_MISSING, f"object (entry {idx}) is gone")
        if level is not None and e.level != level:
            raise MoveError(L.ERR_MISSING, f"{self.key_of(idx)!r} is not on level {level} any more")
        if e.flags & L.FLAG_MOVING:
            raise MoveError(L.ERR_LOCKED, f"{self.key_of(idx)!r} is being moved already")
        if self.node.table.pin_count(idx):
            raise MoveError(L.ERR_LOCKED, f"{self.key_of(idx)!r} is pinned (a view, reader or pin holds it)")
        return e

    def _set_flags(self, idx: int, flags: int) -> None:
        L.ENTRY_HEAD.set(self.buf, self.lay.entry(idx), "flags", flags)

    # ---- one move, any two levels ---------------------------------------------------------
    def spill(self, idx: int, gen: int) -> int:
        """Move entry ``idx`` from MEMORY to DISK (see :meth:`move`)."""
        return self.move(idx, gen, Level.DISK, expect=Level.MEMORY)

    def restore(self, idx: int, gen: int) -> int:
        """Move entry ``idx`` from DISK to MEMORY (see :meth:`move`)."""
        return self.move(idx, gen, Level.MEMORY, expect=Level.DISK)

    def move(self, idx: int, gen: int, to: Level, expect: Level | None = None) -> int:
        """Move entry ``idx`` to level ``to`` (from ``expect``, if given); returns the bytes moved.

        0 when it gave up because the object was read, pinned or deleted
        meanwhile (it stays where it was). Room is made on ``to`` first if
        needed, by spilling that level's own least recently used objects.

        Raises:
            MoveError: gone, not on ``expect``, pinned, no room, or an I/O error (nothing changed).
        """
        node, buf, lay = self.node, self.buf, self.lay
        dst = node.levels[to]
        why = dst.available()
        if why:
            raise MoveError(L.ERR_FULL, f"cannot move to {to}: {why}")
        lock, eoff = node.stripe_of(idx), lay.entry(idx)
        with lock:
            e = self._check_movable(idx, gen, expect)
            if e.level == to:
                return 0
            with node.alloc_lock:  # a level that counts space up front is charged with the flag set
                try:
                    dst.charge_move_locked(idx, e)
                except StorageFullError as exc:
                    raise MoveError(L.ERR_FULL, str(exc)) from None
                L.ENTRY_HEAD.set(buf, eoff, "target", int(to))  # before the flag: a moving entry always names it
                self._set_flags(idx, e.flags | L.FLAG_MOVING)
        src, size = node.levels[Level(e.level)], e.size
        try:
            off, rec = self._space_for(dst, idx, size)
        except MoveError:
            with lock:
                self._give_up(idx)
            raise
        # a device level placing the copy: a CUDA error (a RuntimeError), no CuPy
        except Exception as exc:
            with lock:
                self._give_up(idx)
            raise self._failed(idx, size, src.level, to, exc) from exc
        self._state(moving=idx + 1, moving_to=int(to), progress=0, total=size)
        try:
            self._copy(src, dst, idx, gen, e.offset, off, size)
        # a file's OSError; from a device copy anything (CUDA errors, AttributeError)
        except Exception as exc:
            with lock:
                self._give_up(idx)  # the target's copy and extent go, the object stays, readable
            self._state(moving=0, failures=L.unpack_spill_state(buf).failures + 1)
            raise self._failed(idx, size, src.level, to, exc) from exc
        with lock:
            now = L.entry(buf, eoff)
            self._state(moving=0)
            if now.state != L.SEALED or node.table.pin_count(idx):  # deleted or read meanwhile
                self._give_up(idx)
                return 0
            with node.alloc_lock:  # the entry names its new copy before the old one is freed
                L.pack_entry(buf, eoff, self._moved(now, off, rec, int(to)))
                src.free_locked(idx, now)
            soff = lay.stripe_stats(node.table.stripe_of(idx))
            L.add_stripe_stats(buf, soff, now.level, -size, -1)
            L.add_stripe_stats(buf, soff, int(to), size, 1)
            src.drop(idx, now)  # a crash before this leaves a stray file: recover() removes it
        s = L.unpack_spill_state(buf)
        self._state(**({"spilled": s.spilled + size} if to > src.level else {"restored": s.restored + size}))
        return int(size)

    def _failed(self, idx: int, size: int, src: Level, to: Level, exc: Exception) -> MoveError:
        """The error of a move that failed with ``exc`` and was given up (logged with its traceback where it is
        not an I/O error: a device's error says little on one line)."""
        verb = "spill" if to > src else "restore"
        why = getattr(exc, "strerror", None) if isinstance(exc, OSError) else None
        if not isinstance(exc, (OSError, SpillError)):
            why = f"{type(exc).__name__}: {exc}"
            cfg = self.node.cfg
            log.error("%s@%s: %s of %r (entry %d) failed; the object stays on %s", cfg.name, cfg.node, verb,
                      self.key_of(idx), idx, src, exc_info=exc)
        return MoveError(L.ERR_IO, f"cannot {verb} {self.key_of(idx)!r} ({format_size(size)}) from {src} to {to}: "
                                   f"{why or exc} (the object stays on {src})")

    def _give_up(self, idx: int) -> None:
        """Roll back the move of ``idx``: the target's copy and charge go, the object stays (stripe lock held)."""
        e = L.entry(self.buf, self.lay.entry(idx))
        if e.flags & L.FLAG_MOVING:
            self.node.levels[Level(e.target)].abort_move(idx, e)
        self.node.free_if_unpinned(idx)  # deleted meanwhile: free it now

    def _space_for(self, dst: MovableLevel, idx: int, size: int) -> tuple[int, int]:
        """A placement on ``dst`` for entry ``idx``, making room there once if it has none."""
        for attempt in range(2):
            try:
                return dst.space_for_move(idx, size)
            except StorageFullError as exc:
                if attempt or dst.spill_to is None:
                    raise MoveError(L.ERR_FULL, f"no room on {dst.level} for {self.key_of(idx)!r} "
                                                f"({format_size(size)}): {exc}") from None
            self.make_room(size, exclude=idx, level=dst.level)
        raise AssertionError("unreachable")

    def _copy(self, src: MovableLevel, dst: MovableLevel, idx: int, gen: int, src_off: int, dst_off: int,
              size: int) -> None:
        buf, off = src.view(idx, gen, src_off, size)
        if buf is None or not size:  # an empty object: nothing to copy, no pointer handed on
            dst.write_move(idx, gen, dst_off, b"", 0, lambda n: None)
            return
        if hasattr(buf, "__cuda_array_interface__"):  # a device array over the object's bytes
            dst.write_move(idx, gen, dst_off, buf[off: off + size], size, lambda n: self._state(progress=n))
            return
        view, copied = memoryview(buf)[off: off + size], False
        try:
            dst.write_move(idx, gen, dst_off, view, size, lambda n: self._state(progress=n))
            copied = True
        finally:
            try:
                view.release()
                if hasattr(buf, "close") and not isinstance(buf, memoryview):
                    buf.close()  # a mapping of the source made for this move
            except BufferError:
                if copied:
                    raise
                # the failed copy's traceback still holds views of the source: its mapping goes when they do
                # (raising here would hide the copy's own error behind "exported pointers exist")

    @staticmethod
    def _moved(e: L.Entry, offset: int, extent: int, level: int) -> L.Entry:
        atime = time.monotonic() if level < e.level else e.atime  # brought up because wanted: not the next victim
        return e._replace(offset=offset, extent=extent, level=level, target_extent=0, target=0, atime=atime,
                          flags=e.flags & ~(L.FLAG_MOVING | L.FLAG_IN_CHUNK))

    # ---- policy-driven moves ---------------------------------------------------
    def largest_free(self, level: Level = Level.MEMORY) -> int:
        """The largest object that fits on ``level`` now."""
        return self.node.levels[level].largest_free()

    def make_room(self, nbytes: int, exclude: int = -1, level: Level = Level.MEMORY) -> int:
        """Spill ``level``'s least recently used objects down until ``nbytes`` fit in one piece.

        Returns the bytes spilled.

        Raises:
            MoveError: not enough spillable data (ERR_FULL) or a spill failed (ERR_IO).
        """
        lv = self.node.levels[level]
        if lv.spill_to is None:
            raise MoveError(L.ERR_FULL, f"{level} has no level below it to make room on")
        spilled = 0
        while self.largest_free(level) < nbytes:
            entries = L.entry_table(self.buf, self.lay)
            cands = spill_candidates(entries, self.node.table.pin_counts(len(entries)), exclude,
                                     whole_extents_first=True, level=int(level))
            if not len(cands):
                raise MoveError(L.ERR_FULL, f"cannot make {format_size(nbytes)} of room on {level}: the rest of "
                                            f"its {format_size(lv.total())} is pinned, being written or fragmented "
                                            f"(raise {lv.setting})")
            for idx in cands:
                spilled += self._spill_quietly(int(idx), lv.spill_to)
                if self.largest_free(level) >= nbytes:
                    return spilled
        return spilled

    def _spill_quietly(self, idx: int, to: Level = Level.DISK) -> int:
        gen = L.ENTRY_HEAD.get(self.buf, self.lay.entry(idx), "gen")
        try:
            return self.move(idx, gen, to)
        except MoveError as exc:
            if exc.kind in (L.ERR_LOCKED, L.ERR_MISSING):
                return 0  # read, pinned or deleted since the snapshot: take the next one
            raise

    def relieve(self, budget: float = 0.2, interrupt: Callable[[], bool] = lambda: False) -> int:
        """Spill LRU objects off every level above its high watermark, down to its low one.

        Stops after ``budget`` seconds or when ``interrupt()`` says requests wait.
        """
        deadline, moved = time.monotonic() + budget, 0
        for level, lv in sorted(self.node.levels.items()):  # fastest first: what it spills may fill the next
            if lv.spill_to is None:
                continue
            entries = L.entry_table(self.buf, self.lay)
            parts = self._parts(level, lv, entries)
            if not parts or lv.available():  # a device level with no arena made: nothing to weigh, no CUDA
                continue
            high, low = lv.watermarks()
            for used, total, within in parts:
                need = watermark_excess(used, total, high, low)
                if not need:
                    continue
                done = 0
                pins = self.node.table.pin_counts(len(entries))
                for idx in spill_candidates(entries, pins, level=int(level), within=within):
                    if done >= need or time.monotonic() > deadline or interrupt():
                        break
                    done += self._spill_quietly(int(idx), lv.spill_to)
                moved += done
        return moved

    def _parts(self, level: Level, lv: MovableLevel,
               entries: np.ndarray) -> list[tuple[int, int, tuple[int, int] | None]]:
        """(used, capacity, offset range) of each part of ``level`` weighed on its own: every ready arena of
        a device level (each against its own capacity: devices differ), else the level as a whole."""
        device = self.node.devices.get(level)
        if device is None:
            return [(self.node.used(int(level)), lv.total(), None)]
        return [(arena_used(entries, int(level), lo, hi), cap, (lo, hi)) for _, lo, hi, cap in device.arenas()]

    # ---- recovery ---------------------------------------------------------------
    def recover(self) -> int:
        """Roll back the moves a killed spill process left half done; drop stray files (of this store's: a
        newer store under the same name keeps its files beside ours, see ``levels/spillfiles.py``).

        Returns how many moves were rolled back.
        """
        node, buf, lay = self.node, self.buf, self.lay
        t = L.entry_table(buf, lay)
        moving = np.flatnonzero((t["state"] != L.FREE) & (t["state"] != L.RESERVED)
                                & ((t["flags"] & L.FLAG_MOVING) != 0))
        for idx in moving.tolist():
            with node.stripe_of(idx):
                self._give_up(idx)
        self._state(moving=0)
        with node.alloc_lock:  # the counter is derived state: make sure it is exact
            t = L.entry_table(buf, lay)
            for level in node.levels.values():
                level.recount_locked(t)
        for level in node.levels.values():  # what no entry explains (DISK: files of a killed writer or mover)
            level.remove_orphans()
        return len(moving)
