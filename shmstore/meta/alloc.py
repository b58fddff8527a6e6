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
free space around the used extents that are still valid, keeping their
record numbers: other processes hold record numbers of extents they own (a
put between placing and linking its entry, a restore in progress), so a
rebuild must never renumber a valid extent.

Ownership is two-way, which is what makes "valid" decidable after a crash:
a used extent names its owner (entry ``i + 1``, or ``-(slot + 1)`` for a
client's chunk) and the owner names the extent (the entry's ``extent``
field, the client's chunk record), both written in one ALLOC-locked
section. An extent whose owner does not name it back was being allocated
or freed by the process that died, and nobody else knows its number.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import LayoutError
from . import layout as L

__all__ = ["Allocator"]


class Allocator:
    """Extent allocator over one arena; state lives in the metadata buffer.

    Owns nothing: the buffer belongs to the metadata segment. Callers hold
    the ALLOC lock (process-safe and thread-safe only through it).
    """

    def __init__(self, buf: Any, layout: L.Layout, capacity: int, gpu: int = -1) -> None:
        self._buf = buf
        self._layout = layout
        self.capacity = capacity & ~(L.ALIGN - 1)
        # -1: the MEMORY arena; else GPU arena ``gpu`` (same records, bins of its own)
        self.gpu = gpu
        self.base = 0 if gpu < 0 else L.gpu_base(gpu)
        self._bins, self._mask = L.bins_offsets(layout, gpu)
        self._I32, self._U64 = struct.Struct("<i"), struct.Struct("<Q")

    # ---- this arena's bins -------------------------------------------------
    def _bin_head(self, k: int) -> int:
        head: int = self._I32.unpack_from(self._buf, self._bins + 4 * k)[0]
        return head

    def _set_bin_head(self, k: int, rec: int) -> None:
        self._buf[self._bins + 4 * k: self._bins + 4 * k + 4] = self._I32.pack(rec)

    def bin_mask(self) -> int:
        mask: int = self._U64.unpack_from(self._buf, self._mask)[0]
        return mask

    def _set_bin_mask(self, mask: int) -> None:
        self._buf[self._mask: self._mask + 8] = self._U64.pack(mask)

    def _clear_bins(self) -> None:
        self._buf[self._bins: self._bins + 4 * L.NBINS] = bytes(4 * L.NBINS)
        self._set_bin_mask(0)

    def bin_head(self, k: int) -> int:
        return self._bin_head(k)

    # ---- records ---------------------------------------------------------
    def _new_record(self) -> int:
        buf = self._buf
        next_unused, free_head = L.extent_cursor(buf)
        if free_head:
            L.set_extent_cursor(buf, next_unused, L.extent_raw(buf, self._layout.extent(free_head))[5])
            return free_head
        if next_unused >= self._layout.nextents:  # cannot happen: see Layout.nextents
            raise LayoutError(f"all {self._layout.nextents} extent records are in use")
        L.set_extent_cursor(buf, next_unused + 1, free_head)
        return next_unused + 1

    def _drop_record(self, rec: int) -> None:
        next_unused, free_head = L.extent_cursor(self._buf)
        L.extent_write(self._buf, self._layout.extent(rec), 0, 0, 0, 0, 0, free_head, L.EXT_UNUSED, 0)
        L.set_extent_cursor(self._buf, next_unused, rec)

    # ---- bins ------------------------------------------------------------
    def _bin_insert(self, rec: int, offset: int, size: int, prev_phys: int, next_phys: int) -> None:
        """Write ``rec`` as a free extent and push it on its bin."""
        buf, lay = self._buf, self._layout
        k = size.bit_length() - 1
        head = self._bin_head(k)
        L.extent_write(buf, lay.extent(rec), offset, size, prev_phys, next_phys, 0, head, L.EXT_FREE, 0)
        if head:
            L.EXTENT.set(buf, lay.extent(head), "prev_free", rec)
        self._set_bin_head(k, rec)
        self._set_bin_mask(self.bin_mask() | (1 << k))

    def _bin_remove(self, size: int, prev_free: int, next_free: int) -> None:
        """Unlink a free extent (given its size and bin links) from its bin."""
        buf, lay = self._buf, self._layout
        k = size.bit_length() - 1
        if prev_free:
            L.EXTENT.set(buf, lay.extent(prev_free), "next_free", next_free)
        else:
            self._set_bin_head(k, next_free)
            if not next_free:
                self._set_bin_mask(self.bin_mask() & ~(1 << k))
        if next_free:
            L.EXTENT.set(buf, lay.extent(next_free), "prev_free", prev_free)

    def _find(self, size: int) -> int:
        buf, lay = self._buf, self._layout
        k = size.bit_length() - 1
        rec, steps = self._bin_head(k), 0
        while rec and steps < 64:
            x = L.extent_raw(buf, lay.extent(rec))
            if x[1] >= size:
                return rec
            rec, steps = x[5], steps + 1
        mask = self.bin_mask() >> (k + 1)
        if not mask:
            return 0
        return self._bin_head(k + 1 + ((mask & -mask).bit_length() - 1))

    def _find_highest(self, size: int, budget: int = 256) -> int:
        """The fitting free extent highest in the arena (looking at ``budget`` extents at most)."""
        buf, lay = self._buf, self._layout
        mask = self.bin_mask() >> (size.bit_length() - 1)
        k, best, best_off = size.bit_length() - 1, 0, -1
        while mask and budget > 0:
            if mask & 1:
                rec = self._bin_head(k)
                while rec and budget > 0:
                    x = L.extent_raw(buf, lay.extent(rec))
                    if x[1] >= size and x[0] > best_off:
                        best, best_off = rec, x[0]
                    rec, budget = x[5], budget - 1
            mask, k = mask >> 1, k + 1
        return best

    # ---- public ----------------------------------------------------------
    def init(self) -> None:
        """Start with the whole arena as one free extent (creator only)."""
        L.set_extent_cursor(self._buf, 0, 0)
        self._clear_bins()
        self._bin_insert(self._new_record(), 0, self.capacity, 0, 0)

    def init_arena(self) -> None:
        """Start GPU arena ``gpu`` as one free extent (ALLOC lock held; its records come from the shared pool)."""
        self._clear_bins()
        self._bin_insert(self._new_record(), self.base, self.capacity, 0, 0)

    def alloc(self, size: int, owner: int, flags: int = L.EXT_USED) -> tuple[int, int]:
        """Allocate ``size`` bytes (rounded up to 64) for entry ``owner`` (1-based).

        ``flags`` is EXT_USED for one object, EXT_CHUNK for a client's chunk
        (then ``owner`` is ``-(slot+1)``).

        A fitting free extent is cut: an object from its front, a chunk from
        its end, so that long-lived chunks gather at the top of the arena and
        do not split the space large objects need (with one chunk in the
        middle of a 16 MiB arena, an empty store could not take 13 MiB). The
        allocation gets a new record and the free rest keeps the old one, in
        the same bin unless it shrank below it, so carving objects off the
        big untouched space touches two records and no bin list. Only
        front cuts move the frontier (which prefaulting follows).

        Returns:
            (extent record, arena offset), or (0, 0) when no extent fits.
        """
        size = (max(size, 1) + L.ALIGN - 1) & ~(L.ALIGN - 1)
        rec = self._find_highest(size) if flags == L.EXT_CHUNK else self._find(size)
        if not rec:
            return 0, 0
        buf, lay = self._buf, self._layout
        xoff = lay.extent(rec)
        offset, xsize, prev_phys, next_phys, prev_free, next_free, _, _ = L.extent_raw(buf, xoff)
        rest = xsize - size
        if rest < L.ALIGN:  # take it whole
            self._bin_remove(xsize, prev_free, next_free)
            L.extent_write(buf, xoff, offset, xsize, prev_phys, next_phys, 0, 0, flags, owner)
            used_rec, start = rec, offset
            if self.gpu < 0 and flags != L.EXT_CHUNK and offset + xsize > L.ALLOC.get(buf, "frontier"):  # high hole
                L.ALLOC.set(buf, "frontier", offset + xsize)
        elif flags == L.EXT_CHUNK:  # from the end: the free rest keeps the front
            used_rec, start = self._new_record(), offset + rest
            L.extent_write(buf, lay.extent(used_rec), start, size, rec, next_phys, 0, 0, flags, owner)
            if next_phys:
                L.EXTENT.set(buf, lay.extent(next_phys), "prev_phys", used_rec)
            self._shrink(rec, offset, (xsize, rest), (prev_phys, used_rec), (prev_free, next_free))
        else:  # from the front: the free rest keeps the end
            used_rec, start = self._new_record(), offset
            L.extent_write(buf, lay.extent(used_rec), offset, size, prev_phys, rec, 0, 0, flags, owner)
            if prev_phys:
                L.EXTENT.set(buf, lay.extent(prev_phys), "next_phys", used_rec)
            self._shrink(rec, offset + size, (xsize, rest), (used_rec, next_phys), (prev_free, next_free))
            if self.gpu < 0 and start + size > L.ALLOC.get(buf, "frontier"):
                L.ALLOC.set(buf, "frontier", start + size)
        return used_rec, start

    def _shrink(self, rec: int, offset: int, sizes: tuple[int, int], phys: tuple[int, int],
                free: tuple[int, int]) -> None:
        """Rewrite free extent ``rec`` smaller (``sizes`` = (old, new)) at ``offset``, between its physical
        neighbours ``phys`` = (previous, next), moving it out of its bin (linked ``free`` = (previous, next))
        to another only if it must."""
        (old_size, size), (prev_phys, next_phys), (prev_free, next_free) = sizes, phys, free
        if size.bit_length() == old_size.bit_length():  # same bin: in place
            L.extent_write(self._buf, self._layout.extent(rec), offset, size, prev_phys, next_phys, prev_free,
                           next_free, L.EXT_FREE, 0)
        else:
            self._bin_remove(old_size, prev_free, next_free)
            self._bin_insert(rec, offset, size, prev_phys, next_phys)

    def size_of(self, rec: int) -> int:
        size: int = L.extent_raw(self._buf, self._layout.extent(rec))[1]
        return size

    def set_flags(self, rec: int, flags: int) -> None:
        """Change a used extent's kind (chunk -> retired chunk)."""
        x = list(L.extent_raw(self._buf, self._layout.extent(rec)))
        x[6] = flags
        L.extent_write(self._buf, self._layout.extent(rec), *x)

    def free_owned(self, rec: int, owner: int) -> int:
        """Free extent ``rec`` if it is in use by ``owner``; returns its size, 0 if it was not.

        A process that died between freeing an extent and clearing its owner's
        reference leaves that reference behind; this is the only free that
        may meet one, so it checks instead of trusting it.
        """
        if not 0 < rec <= self._layout.nextents:
            return 0
        x = L.extent_raw(self._buf, self._layout.extent(rec))
        if x[6] not in (L.EXT_USED, L.EXT_CHUNK, L.EXT_RETIRED) or x[7] != owner:
            return 0
        return self.free(rec)

    def arena_of(self, offset: int) -> Allocator:
        """The allocator of the arena holding ``offset``: this one, or another sharing its records."""
        if self.base <= offset < self.base + self.capacity:
            return self
        if offset >= 1 << L.GPU_BASE_SHIFT:
            d = (offset >> L.GPU_BASE_SHIFT) - 1
            return Allocator(self._buf, self._layout, L.unpack_gpu(self._buf, self._layout, d).capacity, gpu=d)
        return Allocator(self._buf, self._layout, L.unpack_header(self._buf).capacity)

    def free(self, rec: int) -> int:
        """Free extent ``rec``, coalescing with free neighbours; returns its size.

        An extent of another arena is freed into that arena's bins.

        Raises:
            LayoutError: ``rec`` is not in use (a bug: the allocator is left as it was).
        """
        buf, lay = self._buf, self._layout
        offset, size, prev_phys, next_phys, _, _, flags, _ = L.extent_raw(buf, lay.extent(rec))
        arena = self.arena_of(offset)
        if arena is not self:
            return arena.free(rec)
        if flags in (L.EXT_UNUSED, L.EXT_FREE):
            raise LayoutError(f"free of extent {rec} that is not in use (flags {flags})")
        freed: int = size
        if prev_phys:
            p = L.extent_raw(buf, lay.extent(prev_phys))
            if p[6] == L.EXT_FREE:
                self._bin_remove(p[1], p[4], p[5])
                self._drop_record(rec)
                rec, offset, size, prev_phys = prev_phys, p[0], p[1] + size, p[2]
        if next_phys:
            n = L.extent_raw(buf, lay.extent(next_phys))
            if n[6] == L.EXT_FREE:
                self._bin_remove(n[1], n[4], n[5])
                self._drop_record(next_phys)
                size, next_phys = size + n[1], n[3]
        if next_phys:
            L.EXTENT.set(buf, lay.extent(next_phys), "prev_phys", rec)
        self._bin_insert(rec, offset, size, prev_phys, next_phys)
        return freed

    def rebuild(self, keep: Iterable[int], others: Iterable[Allocator] = ()) -> None:
        """Recreate the free space around the used extents ``keep`` (record numbers), keeping them.

        ``others`` are the GPU arenas sharing this allocator's records: they
        are rebuilt too. Every other record becomes free or unused; the gaps
        between kept extents become free extents in their arena's bins. Used
        after a process died holding the ALLOC lock (see the module notes).

        Raises:
            LayoutError: two kept extents overlap (the table is corrupt).
        """
        buf, lay = self._buf, self._layout
        ext = L.extent_table(buf, lay)
        kept = sorted((int(ext["offset"][r - 1]), int(ext["size"][r - 1]), r) for r in set(keep))
        next_unused, _ = L.extent_cursor(buf)
        spare = np.setdiff1d(np.arange(1, next_unused + 1), [r for _, _, r in kept])
        ext[spare - 1] = np.zeros(1, ext.dtype)  # EXT_UNUSED, every field 0
        plans: list[tuple[Allocator, list[tuple[int, int, int]]]] = []
        for arena in [self, *others]:
            lo, hi = arena.base, arena.base + arena.capacity
            spans: list[tuple[int, int, int]] = []  # (offset, size, record or 0 for a free gap)
            pos = lo
            for offset, size, r in kept:
                if not lo <= offset < hi:
                    continue
                if offset < pos:
                    raise LayoutError(f"extents overlap at arena offset {offset} (record {r})")
                if offset > pos:
                    spans.append((pos, offset - pos, 0))
                spans.append((offset, size, r))
                pos = offset + size
            if pos < hi:
                spans.append((pos, hi - pos, 0))
            plans.append((arena, spans))
        ngaps = sum(1 for _, spans in plans for _, _, r in spans if not r)
        gaps = list(spare[:ngaps]) + list(range(next_unused + 1, next_unused + 1 + ngaps - len(spare[:ngaps])))
        spare = spare[ngaps:]
        L.set_extent_cursor(buf, max(next_unused, max(gaps, default=0)), int(spare[0]) if len(spare) else 0)
        ext["next_free"][spare[:-1] - 1] = spare[1:]  # the unused records' free list, lowest first
        gaps.reverse()
        for arena, spans in plans:
            arena._clear_bins()
            recs = [r or int(gaps.pop()) for _, _, r in spans]
            for i, (offset, size, r) in enumerate(spans):
                prev_phys = recs[i - 1] if i else 0
                next_phys = recs[i + 1] if i + 1 < len(recs) else 0
                if r:
                    x = list(L.extent_raw(buf, lay.extent(r)))
                    x[2], x[3], x[4], x[5] = prev_phys, next_phys, 0, 0
                    L.extent_write(buf, lay.extent(r), *x)
                else:
                    arena._bin_insert(recs[i], offset, size, prev_phys, next_phys)
        ends = [off + size for off, size, r in kept
                if off < self.capacity and L.extent_raw(buf, lay.extent(r))[6] == L.EXT_USED]
        L.ALLOC.set(buf, "frontier", max(ends + [L.ALLOC.get(buf, "frontier")]))  # front cuts only: see alloc()

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, size) of every free extent, for checks and status."""
        buf, lay = self._buf, self._layout
        out = []
        mask = self.bin_mask()
        for k in range(L.NBINS):
            if mask >> k & 1:
                rec = self._bin_head(k)
                while rec:
                    x = L.extent_raw(buf, lay.extent(rec))
                    out.append((x[0], x[1]))
                    rec = x[5]
        return sorted(out)
