"""The MEMORY arena's allocator: extents in segregated free lists.

The arena is cut into extents, each described by an EXTENT record in the
metadata segment and linked to its physical neighbours. Free extents sit in
64 bins by ``floor(log2(size))``; a bitmap says which bins are non-empty.
Allocation takes the first fitting extent of the request's own bin, else any
extent of the next non-empty bin (which always fits), and splits off the
rest. Freeing coalesces with free neighbours. Freed space is reused before
fresh space: the untouched tail of the arena is one big extent in a high bin,
reached only when no smaller freed extent fits.

Not process-safe by itself: every method must be called with the store's
ALLOC lock held. If a holder dies mid-update, :meth:`rebuild` recreates the
whole state from the object table.
"""
from __future__ import annotations

from typing import Iterable

from . import layout as L

__all__ = ["Allocator"]


class Allocator:
    """Extent allocator over one arena; state lives in the metadata buffer.

    Owns nothing: the buffer belongs to the metadata segment. Callers hold
    the ALLOC lock (process-safe and thread-safe only through it).
    """

    def __init__(self, buf, layout: L.Layout, capacity: int) -> None:
        self._buf = buf
        self._layout = layout
        self.capacity = capacity & ~(L.ALIGN - 1)

    # ---- records ---------------------------------------------------------
    def _read(self, rec: int) -> L.Extent:
        return L.unpack_extent(self._buf, self._layout.extent(rec))

    def _write(self, rec: int, x: L.Extent) -> None:
        L.pack_extent(self._buf, self._layout.extent(rec), x)

    def _new_record(self) -> int:
        next_unused, free_head = L.extent_cursor(self._buf)
        if free_head:
            nxt = self._read(free_head).next_free
            L.set_extent_cursor(self._buf, next_unused, nxt)
            return free_head
        if next_unused >= self._layout.nextents:
            raise RuntimeError("extent records exhausted")  # cannot happen: <= 2 per object + 1
        L.set_extent_cursor(self._buf, next_unused + 1, free_head)
        return next_unused + 1

    def _drop_record(self, rec: int) -> None:
        next_unused, free_head = L.extent_cursor(self._buf)
        self._write(rec, L.Extent(0, 0, 0, 0, 0, free_head, L.EXT_UNUSED, 0))
        L.set_extent_cursor(self._buf, next_unused, rec)

    # ---- bins ------------------------------------------------------------
    def _bin_insert(self, rec: int, x: L.Extent) -> None:
        k = x.size.bit_length() - 1
        head = L.bin_head(self._buf, k)
        self._write(rec, x._replace(prev_free=0, next_free=head, flags=L.EXT_FREE, owner=0))
        if head:
            self._write(head, self._read(head)._replace(prev_free=rec))
        L.set_bin_head(self._buf, k, rec)
        L.set_bin_mask(self._buf, L.bin_mask(self._buf) | (1 << k))

    def _bin_remove(self, rec: int, x: L.Extent) -> None:
        k = x.size.bit_length() - 1
        if x.prev_free:
            self._write(x.prev_free, self._read(x.prev_free)._replace(next_free=x.next_free))
        else:
            L.set_bin_head(self._buf, k, x.next_free)
            if not x.next_free:
                L.set_bin_mask(self._buf, L.bin_mask(self._buf) & ~(1 << k))
        if x.next_free:
            self._write(x.next_free, self._read(x.next_free)._replace(prev_free=x.prev_free))

    def _find(self, size: int) -> int:
        k = size.bit_length() - 1
        rec, steps = L.bin_head(self._buf, k), 0
        while rec and steps < 64:
            x = self._read(rec)
            if x.size >= size:
                return rec
            rec, steps = x.next_free, steps + 1
        mask = L.bin_mask(self._buf) >> (k + 1)
        if not mask:
            return 0
        return L.bin_head(self._buf, k + 1 + ((mask & -mask).bit_length() - 1))

    # ---- public ----------------------------------------------------------
    def init(self) -> None:
        """Start with the whole arena as one free extent (creator only)."""
        L.set_extent_cursor(self._buf, 0, 0)
        L.clear_bins(self._buf)
        L.set_bin_mask(self._buf, 0)
        rec = self._new_record()
        self._bin_insert(rec, L.Extent(0, self.capacity, 0, 0, 0, 0, L.EXT_FREE, 0))

    def alloc(self, size: int, owner: int) -> tuple[int, int]:
        """Allocate ``size`` bytes (rounded up to 64) for entry ``owner`` (1-based).

        Returns:
            (extent record, arena offset), or (0, 0) when no extent fits.
        """
        size = L.align(max(size, 1))
        rec = self._find(size)
        if not rec:
            return 0, 0
        x = self._read(rec)
        self._bin_remove(rec, x)
        if x.size - size >= L.ALIGN:
            rest = self._new_record()
            self._bin_insert(rest, L.Extent(x.offset + size, x.size - size, rec, x.next_phys, 0, 0, L.EXT_FREE, 0))
            if x.next_phys:
                self._write(x.next_phys, self._read(x.next_phys)._replace(prev_phys=rest))
            x = x._replace(size=size, next_phys=rest)
        self._write(rec, x._replace(prev_free=0, next_free=0, flags=L.EXT_USED, owner=owner))
        end = x.offset + x.size
        if end > L.frontier(self._buf):
            L.set_frontier(self._buf, end)
        return rec, x.offset

    def size_of(self, rec: int) -> int:
        return self._read(rec).size

    def free(self, rec: int) -> int:
        """Free extent ``rec``, coalescing with free neighbours; returns its size."""
        x = self._read(rec)
        if x.flags != L.EXT_USED:
            raise RuntimeError(f"double free of extent {rec}")
        size = x.size
        if x.prev_phys:
            p = self._read(x.prev_phys)
            if p.flags == L.EXT_FREE:
                self._bin_remove(x.prev_phys, p)
                prev = x.prev_phys
                self._drop_record(rec)
                rec, x = prev, p._replace(size=p.size + x.size, next_phys=x.next_phys)
                if x.next_phys:
                    self._write(x.next_phys, self._read(x.next_phys)._replace(prev_phys=rec))
        if x.next_phys:
            n = self._read(x.next_phys)
            if n.flags == L.EXT_FREE:
                self._bin_remove(x.next_phys, n)
                self._drop_record(x.next_phys)
                x = x._replace(size=x.size + n.size, next_phys=n.next_phys)
                if n.next_phys:
                    self._write(n.next_phys, self._read(n.next_phys)._replace(prev_phys=rec))
        self._bin_insert(rec, x)
        return size

    def rebuild(self, live: Iterable[tuple[int, int, int]]) -> dict[int, int]:
        """Recreate all allocator state from the live ``(offset, size, owner)`` extents.

        Used after a process died holding the ALLOC lock. Returns the new
        extent record of each owner.
        """
        L.set_extent_cursor(self._buf, 0, 0)
        L.clear_bins(self._buf)
        L.set_bin_mask(self._buf, 0)
        owners: dict[int, int] = {}
        pos, prev = 0, 0
        frontier = 0
        for offset, size, owner in sorted(live):
            if offset > pos:
                prev = self._link(prev, L.Extent(pos, offset - pos, prev, 0, 0, 0, L.EXT_FREE, 0))
            prev = self._link(prev, L.Extent(offset, size, prev, 0, 0, 0, L.EXT_USED, owner))
            owners[owner] = prev
            pos = offset + size
            frontier = pos
        if pos < self.capacity:
            self._link(prev, L.Extent(pos, self.capacity - pos, prev, 0, 0, 0, L.EXT_FREE, 0))
        L.set_frontier(self._buf, max(frontier, L.frontier(self._buf)))
        return owners

    def _link(self, prev: int, x: L.Extent) -> int:
        rec = self._new_record()
        if x.flags == L.EXT_FREE:
            self._bin_insert(rec, x)
        else:
            self._write(rec, x)
        if prev:
            self._write(prev, self._read(prev)._replace(next_phys=rec))
        return rec

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, size) of every free extent, for checks and status."""
        out = []
        mask = L.bin_mask(self._buf)
        for k in range(L.NBINS):
            if mask >> k & 1:
                rec = L.bin_head(self._buf, k)
                while rec:
                    x = self._read(rec)
                    out.append((x.offset, x.size))
                    rec = x.next_free
        return sorted(out)
