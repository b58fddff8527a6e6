"""The DISK level: one file per object in the store's spill directory (:mod:`shmstore.levels.spillfiles`),
counted against a quota.

Files are scratch, not persistence (see the spill directory's notes for naming, safety and how two
stores of one name share a directory). This module adds what makes the directory a level: the quota
counter, kept equal to what the table charges; the translation of file errors into the store's errors;
and the level's own checks and recovery (files no entry explains).
"""
from __future__ import annotations

import errno
import os
from typing import Any, Callable

import numpy as np

from ..errors import PermissionDeniedError, SpillError, StorageFullError
from ..meta import layout as L
from ..meta.keyref import Contents, KeyRef, Reservation
from ..node import serialize
from ..node.protocols import LevelHost, PutContext
from ..node.serialize import Encoded
from ..units import format_size
from ..values import Level
from .device import is_device_array, to_host
from .spillfiles import SpillFiles, of_store

__all__ = ["DiskLevel", "FileSink", "disk_error"]


# ---- the level -------------------------------------------------------------------------

def disk_error(key: str, size: int, path: str, exc: OSError) -> Exception:
    """The error for a failed write of ``key`` to the spill directory."""
    if isinstance(exc, PermissionDeniedError):  # a refused spill directory: its message says it all
        return PermissionDeniedError(f"cannot write {key!r} ({format_size(size)}) to disk: {exc}")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(f"cannot place {key!r} ({format_size(size)}) on disk: {path} is full "
                                f"(free space there, or point SHMSTORE_SPILL_DIR elsewhere)", key, Level.DISK, size)
    return SpillError(f"cannot write {key!r} ({format_size(size)}) to {path}: {exc.strerror or exc}", key)


class DiskLevel:
    """The DISK level: one file per object in the store's spill directory, counted against a quota.

    Its space is a counter (``disk_reserved`` in the spill state) rather than
    an arena: every change of it happens in one ALLOC section with the entry
    change it pays for, so that it always equals what the table charges
    (:meth:`charged`; derived again by :meth:`recount_locked` when a holder
    of the ALLOC lock died). Built from the store's
    :class:`~shmstore.node.protocols.LevelHost` and owned by it; its files
    are the store's spill directory (``spillfiles.of_store``). Process-safe through the
    store's locks and file naming; thread-safe.
    """

    level = Level.DISK
    spill_to: Level | None = None
    setting = "disk_capacity= / SHMSTORE_DISK_CAPACITY when creating the store"

    def __init__(self, host: LevelHost) -> None:
        self.host = host
        self.files: SpillFiles = of_store(host)

    def available(self) -> str | None:
        return None

    def total(self) -> int:
        return int(L.unpack_spill_state(self.host.buf).disk_capacity)

    def watermarks(self) -> tuple[float, float]:
        return 1.0, 1.0  # nothing below it to spill to

    # ---- space ---------------------------------------------------------------------
    def _charge_locked(self, key: str | None, size: int) -> None:
        """Charge ``size`` bytes to the quota (ALLOC lock held), or StorageFullError."""
        buf = self.host.buf
        cap = L.unpack_spill_state(buf).disk_capacity
        used = L.ALLOC.get(buf, "disk_reserved")
        if used + size > cap:
            raise StorageFullError(
                f"cannot place {key!r} ({format_size(size)}) on disk: {format_size(cap - used)} free of "
                f"{format_size(cap)} in {self.files.root} (raise {self.setting}, or point SHMSTORE_SPILL_DIR at a "
                f"larger file system)", key, Level.DISK, size, cap - used)
        L.ALLOC.set(buf, "disk_reserved", used + size)

    def _refund_locked(self, size: int) -> None:
        L.ALLOC.set(self.host.buf, "disk_reserved", max(0, L.ALLOC.get(self.host.buf, "disk_reserved") - size))

    def prepare(self, key: str) -> None:
        pass  # a quota, charged under the ALLOC lock

    def place(self, key: str, idx: int, gen: int, size: int, client: PutContext,
              write_entry: Callable[[int, int, int], None]) -> tuple[int, int, int]:
        with self.host.alloc_lock:  # one section: the quota always equals what the table charges
            self._charge_locked(key, size)
            write_entry(0, 0, 0)
        return 0, 0, 0

    def try_put(self, client: PutContext, ref: KeyRef, what: Encoded | Contents,
                give_up: Callable[[int, int], object], held: bool = False, seal: bool = True,
                entry: tuple[int, int] | None = None) -> Reservation | None:
        return None  # no shortcut: a put on DISK goes the general way

    def unplace(self, idx: int, extent: int, flags: int) -> None:
        pass  # the entry carries the charge: it goes when the entry is freed

    def drop(self, idx: int, e: L.Entry) -> None:
        self.files.remove(idx, e.gen)

    def free_locked(self, idx: int, e: L.Entry) -> None:
        self._refund_locked(e.size)

    # ---- bytes ---------------------------------------------------------------------
    def write(self, idx: int, gen: int, offset: int, flags: int, enc: serialize.Encoded, key: str) -> None:
        try:
            self.files.write(idx, gen, serialize.parts(enc), L.align(max(enc.size, 1)))
        except OSError as exc:
            raise disk_error(key, enc.size, self.files.path, exc) from exc

    def sink(self, idx: int, gen: int, offset: int, size: int, key: str) -> FileSink:
        try:
            return FileSink(self.files, idx, gen, size, key)
        except OSError as exc:
            raise disk_error(key, size, self.files.path, exc) from exc

    def view(self, idx: int, gen: int, offset: int, nbytes: int) -> tuple[Any, int]:
        return self.files.map(idx, gen, nbytes), 0

    # ---- moves onto this level -----------------------------------------------------------
    def charge_move_locked(self, idx: int, e: L.Entry) -> None:
        self._charge_locked(None, e.size)

    def space_for_move(self, idx: int, size: int) -> tuple[int, int]:
        return 0, 0  # charged up front (charge_move_locked); the file is written whole

    def largest_free(self) -> int:
        return int(self.total() - self.host.used(int(Level.DISK)))

    def write_move(self, idx: int, gen: int, offset: int, src: Any, size: int,
                   progress: Callable[[int], None]) -> None:
        if is_device_array(src):  # straight down from the GPU level: staged on the host
            host = np.empty(size, np.uint8)
            to_host(host, src)
            src = host
        self.files.write(idx, gen, [(0, memoryview(src).cast("B")[:size])], size, progress=progress)

    def abort_move(self, idx: int, e: L.Entry) -> None:
        node, eoff = self.host, self.host.layout.entry(idx)
        self.files.remove(idx, e.gen)  # first: a crash leaves a moving entry, which recover() rolls back
        with node.alloc_lock:
            self._refund_locked(e.size)
            L.ENTRY_HEAD.set(node.buf, eoff, "flags", L.ENTRY_HEAD.get(node.buf, eoff, "flags") & ~L.FLAG_MOVING)

    # ---- checks and recovery -------------------------------------------------------------
    def charged(self, t: np.ndarray) -> int:
        """What the quota counter must hold according to the entry table ``t``: objects on disk plus moves
        onto it in flight (charged first)."""
        live = (t["state"] != L.FREE) & (t["state"] != L.RESERVED)
        spilling = (t["target"] == self.level) & ((t["flags"] & L.FLAG_MOVING) != 0)
        return int(t["size"][live & ((t["level"] == self.level) | spilling)].sum())

    def recount_locked(self, t: np.ndarray) -> None:
        L.ALLOC.set(self.host.buf, "disk_reserved", self.charged(t))

    def check(self, t: np.ndarray) -> list[str]:
        """The quota counter equals what the table charges; each object on disk has its file, and no file
        is there that no entry explains."""
        buf, lay = self.host.buf, self.host.layout
        problems: list[str] = []
        charged = self.charged(t)
        counter = L.ALLOC.get(buf, "disk_reserved")
        if counter != charged:
            problems.append(f"disk quota counter says {counter} B, the table charges {charged} B")
        names = set(self.files.names())
        allowed: set[str] = set()
        live = np.isin(t["state"], (L.WRITING, L.SEALED, L.DELETED))
        for idx in np.flatnonzero(live).tolist():
            e = t[idx]
            name = self.files.name(idx, int(e["gen"]))
            on_disk, moving = e["level"] == self.level, bool(e["flags"] & L.FLAG_MOVING)
            if on_disk and (e["offset"] or e["extent"]):
                problems.append(f"entry {idx}: on disk but names arena space")
            if on_disk and e["state"] != L.WRITING:
                if name not in names:
                    key = L.entry_key(buf, lay.entry(idx), int(e["keylen"])).decode(errors="replace")
                    problems.append(f"entry {idx} ({key!r}) is on disk but its file {name} is missing")
                elif self.files.size(name) < e["size"]:
                    problems.append(f"spill file {name} is shorter than entry {idx} ({e['size']} B)")
                allowed.add(name)
            elif on_disk or (moving and e["target"] == self.level):  # being written, or being spilled
                allowed.update((name, name + ".tmp"))
        problems.extend(f"spill file {name} belongs to no object" for name in sorted(names - allowed))
        return problems

    def remove_orphans(self) -> int:
        """Remove the files of this store no entry explains (of a killed writer or mover); returns how many.

        Only this store's: a newer store under the same name keeps its files beside ours (see
        ``levels/spillfiles.py``).
        """
        return sum(self._remove_stray(name) for name in self.files.names())

    def _remove_stray(self, name: str) -> bool:
        """Remove a file no entry explains, re-checking under the entry's lock (a put may be racing).

        ``<idx>.<gen>`` belongs to a DISK entry; ``<idx>.<gen>.tmp`` to one
        being written to disk by a client (a writer, a put on DISK).
        """
        parts = name.split(".")
        try:
            idx, gen = int(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            return False  # not ours: leave it
        lay = self.host.layout
        if len(parts) > 3 or (len(parts) == 3 and parts[2] != "tmp") or not 0 <= idx < lay.max_objects:
            return False
        with self.host.stripe_of(idx):
            e = L.entry(self.host.buf, lay.entry(idx))
            if e.state not in (L.FREE, L.RESERVED) and e.gen == gen and e.level == self.level:
                if len(parts) == 2 or e.state == L.WRITING:
                    return False
            self.files.unlink(name)
        return True

    def drop_lost(self) -> int:
        return 0  # files outlive every process

    def remove_files(self) -> int:
        return self.files.remove_all()

    def close(self) -> None:
        self.files.close()


class FileSink:
    """A writer's target on DISK: ``<idx>.<gen>.tmp``, renamed when complete."""

    def __init__(self, files: SpillFiles, idx: int, gen: int, size: int, key: str) -> None:
        self.files, self.idx, self.gen, self.size, self.key = files, idx, gen, size, key
        self._fd = files.create_tmp(idx, gen)

    def write(self, data: Any, pos: int) -> None:
        mv = memoryview(data).cast("B")
        try:
            while len(mv):
                k = os.pwrite(self._fd, mv, pos)
                mv, pos = mv[k:], pos + k
        except OSError as exc:
            raise disk_error(self.key, self.size, self.files.path, exc) from exc

    def buffer(self) -> None:
        return None

    def close(self) -> None:
        try:
            os.ftruncate(self._fd, L.align(max(self.size, 1)))
            fd, self._fd = self._fd, -1  # forgotten first: never closed twice
            os.close(fd)
            self.files.publish(self.idx, self.gen)
        except OSError as exc:
            raise disk_error(self.key, self.size, self.files.path, exc) from exc

    def abort(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1  # forgotten first: never closed twice
            os.close(fd)
        self.files.unlink(self.files.name(self.idx, self.gen) + ".tmp")
