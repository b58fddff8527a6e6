"""A client's private supplies: free entries in batches, chunks for small objects.

Without them every put would take the store-wide ALLOC lock twice (an entry,
an extent) and two processes putting small objects would queue on it. With
them a put takes the ALLOC lock once per ``ENTRY_BATCH`` puts (to refill its
entries) and once per chunk (to take a fresh one); in between it only takes
the key's stripe lock.

Crash safety: batched entries are marked ``reserved`` with the client's slot
and the current chunk is recorded in the client's record, so the janitor
gives both back when the client dies, and an allocator rebuild keeps them.
"""
from __future__ import annotations

import threading

from ..errors import StorageFullError
from . import layout as L
from .node import NodeStore

__all__ = ["ClientCache", "ENTRY_BATCH"]

ENTRY_BATCH = 32


class ClientCache:
    """Entries and chunk space set aside for one client slot.

    Owned by the client's Kernel; ``give_back`` returns everything (at close).
    Thread-safe (its own lock; never taken by finalizers).
    """

    def __init__(self, node: NodeStore, slot: int) -> None:
        self.node = node
        self.slot = slot
        self.entries: list[int] = []   # reserved entry indices (finalizers may append)
        self._lock = threading.Lock()
        self._coff = node.layout.client(slot)
        self._pos = self._end = 0      # bump pointer in the current chunk
        self.small_max = node.small_max

    def take_entry(self, key: str) -> int:
        """A reserved entry index for a new object.

        Raises:
            StorageFullError: the object table is full (``max_objects``).
        """
        try:
            return self.entries.pop()
        except IndexError:
            pass
        with self._lock:
            if not self.entries:
                self._refill(key)
            return self.entries.pop()

    def _refill(self, key: str) -> None:
        node, buf, lay = self.node, self.node.meta.mm, self.node.layout
        with node.alloc_lock:
            for _ in range(ENTRY_BATCH):
                idx = node.table.new_entry()
                if idx < 0:
                    break
                L.reserve_entry(buf, lay.entry(idx), self.slot)
                self.entries.append(idx)
        if not self.entries:
            raise StorageFullError(f"cannot place {key!r}: the object table holds its maximum of "
                                   f"{lay.max_objects} objects (raise max_objects= / SHMSTORE_MAX_OBJECTS "
                                   f"when creating the store)", key)  # no level: spilling does not help

    def carve(self, size: int) -> tuple[int, int]:
        """Cut ``size`` bytes (64-aligned) off the current chunk, taking a new one if needed.

        Returns:
            (chunk extent record, arena offset), or (0, 0) when no chunk can be had.
        """
        with self._lock:
            if self._pos + size > self._end and not self._new_chunk():
                return 0, 0
            off = self._pos
            self._pos = off + size
            # the record number changes if an allocator rebuild ran meanwhile
            return L.client_chunk(self.node.meta.mm, self._coff)[0], off

    def _new_chunk(self) -> bool:
        node, buf = self.node, self.node.meta.mm
        with node.alloc_lock:
            self._retire_locked()
            rec, off = node.alloc.alloc(node.chunk_size, -(self.slot + 1), L.EXT_CHUNK)
            if not rec:
                node.reclaim_retired_locked()
                rec, off = node.alloc.alloc(node.chunk_size, -(self.slot + 1), L.EXT_CHUNK)
                if not rec:
                    return False
            L.set_client_chunk(buf, self._coff, rec, off, node.chunk_size)
        self._pos, self._end = off, off + node.chunk_size
        return True

    def _retire_locked(self) -> None:
        """Retire the current chunk (ALLOC lock held); the janitor frees it once unused."""
        retire_chunk(self.node, self.slot)
        self._pos = self._end = 0

    def give_back(self) -> None:
        """Return reserved entries and retire the chunk (at close)."""
        with self._lock, self.node.alloc_lock:
            self._retire_locked()
            buf, lay = self.node.meta.mm, self.node.layout
            while self.entries:
                idx = self.entries.pop()
                eoff = lay.entry(idx)
                if L.entry_state(buf, eoff) == L.RESERVED:
                    self.node.table.push_free(idx, 0, L.entry_gen(buf, eoff))


def retire_chunk(node: NodeStore, slot: int) -> None:
    """Retire client ``slot``'s current chunk, if any (ALLOC lock held)."""
    buf = node.meta.mm
    coff = node.layout.client(slot)
    rec = L.client_chunk(buf, coff)[0]
    if rec:
        node.alloc.set_flags(rec, L.EXT_RETIRED)
        L.set_retired_chunks(buf, L.retired_chunks(buf) + 1)
        L.set_client_chunk(buf, coff, 0, 0, 0)
