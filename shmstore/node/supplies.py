"""A client's private supplies: free entries in batches, chunks for small objects.

Without them every put would take the store-wide ALLOC lock twice (an entry,
an extent) and two processes putting small objects would queue on it. With
them a put takes the ALLOC lock once per ``ENTRY_BATCH`` puts (to refill its
entries) and once per chunk (to take a fresh one); in between it only takes
the key's stripe lock.

Crash safety: batched entries are marked ``reserved`` with the client's slot
and the current chunk is recorded in the client's record, so the janitor
gives both back when the client dies.

Entries are named by (index, generation): a reserved entry may be taken
from this batch by another client whose table ran out (:meth:`ClientSupply.steal`),
which gives it a new generation. So every write this client makes to an
entry of its batch first checks, under a lock the thief also holds, that the
entry is still ``reserved`` for this slot with the same generation (the
stripe lock in the insert, the ALLOC lock when placing a large object); a
stolen entry is dropped and another one taken.

A small object's bytes are cut from the current chunk and its entry written
while this client's ``chunk_lock`` is held, so the chunk cannot be retired
(and then freed, as no entry points at it yet) by another thread in between.
"""
from __future__ import annotations

import errno
import threading
from array import array
from typing import Any

from ..errors import StorageFullError
from ..meta import layout as L
from ..meta.lock import holding
from .nodestore import NodeStore

__all__ = ["ClientSupply", "ENTRY_BATCH", "retire_chunk"]

ENTRY_BATCH = 32
_NO_CUT = array("q", (0, 0, 0))


class ClientSupply:
    """Entries and chunk space set aside for one client slot.

    Owned by the client's Kernel; what it holds is given back at close (see :meth:`forget`).
    Thread-safe (its own locks; never taken by finalizers).
    """

    def __init__(self, node: NodeStore, slot: int) -> None:
        self.node = node
        self.slot = slot
        self.entries: list[tuple[int, int]] = []   # reserved (index, generation); finalizers may append
        self._refill_lock = threading.Lock()
        self.chunk_lock = threading.Lock()  # held from a cut of the chunk until its entry is written
        self._coff = node.layout.client(slot)
        # the current chunk: its start, bump pointer and end (int64s that the C put_small moves on too)
        self.cut = array("q", (0, 0, 0))
        self.small_max = node.small_max

    def take_entry(self, key: str) -> tuple[int, int]:
        """A reserved (index, generation) for a new object.

        Raises:
            StorageFullError: the object table is full (``max_objects``).
        """
        try:
            return self.entries.pop()
        except IndexError:
            pass
        with self._refill_lock:
            if not self.entries:
                self._refill(key)
            return self.entries.pop()

    def _refill(self, key: str) -> None:
        node, buf, lay = self.node, self.node.buf, self.node.layout
        with node.alloc_lock:
            for _ in range(ENTRY_BATCH):
                idx = node.table.new_entry()
                if idx < 0:
                    break
                eoff = lay.entry(idx)
                _reserve(buf, eoff, self.slot)
                self.entries.append((idx, L.ENTRY_HEAD.get(buf, eoff, "gen")))
        if not self.entries:
            self.steal()
        if not self.entries:
            raise StorageFullError(f"cannot place {key!r}: the object table holds its maximum of "
                                   f"{lay.max_objects} objects (raise max_objects= / SHMSTORE_MAX_OBJECTS "
                                   f"when creating the store)", key)  # no level: spilling does not help

    def steal(self) -> int:
        """Take idle reserved entries from other clients' batches (the table is full); returns how many.

        Holds every stripe lock and the ALLOC lock meanwhile: every write a
        client makes to an entry of its batch happens under one of them after
        checking the entry is still its own (see the module notes). Takes
        half of what others hold, at least one, never an entry with space
        placed for it (a large put between placing and linking it).
        """
        return holding([*self.node.stripes, self.node.alloc_lock], self._steal_locked)

    def _steal_locked(self) -> int:
        buf, lay = self.node.buf, self.node.layout
        t = L.entry_table(buf, lay)
        idle = ((t["state"] == L.RESERVED) & (t["writer"] != self.slot) & (t["extent"] == 0)
                & (t["flags"] == 0)).nonzero()[0]
        taken = idle[: max(1, len(idle) // 2)]
        for idx in taken:
            eoff = lay.entry(int(idx))
            gen = (L.ENTRY_HEAD.get(buf, eoff, "gen") + 1) & 0xFFFFFFFF
            L.ENTRY_HEAD.set(buf, eoff, "gen", gen)
            _reserve(buf, eoff, self.slot)
            self.entries.append((int(idx), gen))
        return len(taken)

    def carve(self, size: int) -> tuple[int, int]:
        """Cut ``size`` bytes (64-aligned) off the current chunk, taking a new one if needed.

        The caller holds ``chunk_lock`` and writes the object's entry before
        releasing it.

        Returns:
            (chunk extent record, arena offset), or (0, 0) when no chunk can be had.
        """
        cut = self.cut
        if cut[1] + size > cut[2] and not self.new_chunk():
            return 0, 0
        off = cut[1]
        cut[1] = off + size
        return L.client_chunk(self.node.buf, self._coff)[0], off

    def new_chunk(self) -> bool:
        """Retire the current chunk and take a fresh one (``chunk_lock`` held); False when none can be had."""
        node, buf = self.node, self.node.buf
        with node.alloc_lock:
            self._retire_locked()
            rec, off = node.alloc.alloc(node.chunk_size, -(self.slot + 1), L.EXT_CHUNK)
            if not rec:
                node.reclaim_retired_locked()
                rec, off = node.alloc.alloc(node.chunk_size, -(self.slot + 1), L.EXT_CHUNK)
                if not rec:
                    return False
            L.set_client_chunk(buf, self._coff, rec, off, node.chunk_size)
        # chunks lie at the top of the arena, past what prefaulting reached: fault the whole chunk in
        # once here rather than on each small put (a full /dev/shm: no chunk, the caller reports it)
        if node.arena.populate(off, node.chunk_size) not in (0, errno.EINVAL):
            with node.alloc_lock:
                retire_chunk(node, self.slot)
            return False
        self.cut[:] = array("q", (off, off, off + node.chunk_size))
        return True

    def covers(self, off: int, size: int) -> bool:
        """True if ``[off, off+size)`` lies in this client's current chunk (faulted in already)."""
        return self.cut[0] <= off and off + size <= self.cut[2]

    def _retire_locked(self) -> None:
        """Retire the current chunk (ALLOC lock held); the janitor frees it once unused."""
        retire_chunk(self.node, self.slot)
        self.cut[:] = _NO_CUT

    def retire_current(self) -> bool:
        """Retire the current chunk now, and free it where no object lies in it any more: a large object
        found no room on the level, and this client's chunk (taken wherever there was room at the time, maybe
        mid-arena) may be what splits the free space. The next small put takes a fresh one. True if there
        was a chunk."""
        with self.chunk_lock:  # (the C put_small cuts from it under this lock too)
            if not self.cut[2]:
                return False
            node = self.node
            with node.alloc_lock:
                self._retire_locked()
                node.reclaim_retired_locked()
            return True

    def forget(self) -> None:
        """Drop the private lists (at close; :func:`~shmstore.node.janitor.release_all` gives back
        what the store records as this slot's, which is everything these lists held and more)."""
        with self.chunk_lock:
            self.entries.clear()
            self.cut[:] = _NO_CUT


def retire_chunk(node: NodeStore, slot: int) -> None:
    """Retire client ``slot``'s current chunk, if any (ALLOC lock held)."""
    buf = node.buf
    coff = node.layout.client(slot)
    rec = L.client_chunk(buf, coff)[0]
    if rec:
        node.alloc.set_flags(rec, L.EXT_RETIRED)
        L.ALLOC.set(buf, "retired", L.ALLOC.get(buf, "retired") + 1)
        L.set_client_chunk(buf, coff, 0, 0, 0)


def _reserve(buf: Any, eoff: int, slot: int) -> None:
    """Mark a free entry as held in client ``slot``'s batch (the writer first: ``state`` publishes)."""
    L.ENTRY_HEAD.set(buf, eoff, "writer", slot)
    L.ENTRY_HEAD.set(buf, eoff, "state", L.RESERVED)
