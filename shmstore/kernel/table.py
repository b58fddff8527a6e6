"""The object table: hash chains of ENTRY records, pins, entry reuse.

Keys hash (crc32, seeded with the session id) to a bucket; buckets are
grouped into ``nstripes`` stripes, each guarded by its own lock, so processes
working on unrelated keys rarely meet on a lock. A chain is linked and
unlinked with single 4-byte stores after the entry is fully written, so a
process killed mid-update never leaves a broken chain.

Pins: each client process has a bitmap with one bit per entry; the entry's
``pins`` field counts the processes whose bit is set. Within a process,
:class:`Table` callers keep their own counts (views, readers, explicit pins)
and only the first pin and the last unpin touch shared memory. If a process
dies between setting its bit and bumping ``pins``, :meth:`repair_pins`
recomputes the counts from the bitmaps.

Lock order: stripe lock, then ALLOC lock. Never the other way round.
"""
from __future__ import annotations

import zlib

import numpy as np

from . import layout as L
from .alloc import Allocator

__all__ = ["Table"]


class Table:
    """Operations on the entry table of one metadata segment.

    Owns nothing (the buffer belongs to the metadata segment). Methods say
    which lock the caller must hold; the table itself takes none.
    """

    def __init__(self, buf, layout: L.Layout, alloc: Allocator) -> None:
        self.buf = buf
        self.layout = layout
        self.alloc = alloc
        self._bucket_mask = layout.nbuckets - 1
        self._stripe_mask = layout.nstripes - 1

    # ---- hashing ---------------------------------------------------------
    def locate(self, session: int, key: bytes) -> tuple[int, int, int]:
        """(hash, bucket, stripe) of a key."""
        h = zlib.crc32(key, session)
        b = h & self._bucket_mask
        return h, b, b & self._stripe_mask

    def stripe_of(self, idx: int) -> int:
        return L.entry_hash(self.buf, self.layout.entry(idx)) & self._bucket_mask & self._stripe_mask

    # ---- chains (stripe lock held) --------------------------------------
    def find(self, h: int, b: int, session: int, key: bytes) -> int:
        """Entry index of ``key`` in bucket ``b``, or -1."""
        buf, lay = self.buf, self.layout
        rec = L.bucket_head(buf, lay.bucket(b))
        klen = len(key)
        while rec:
            eoff = lay.entry(rec - 1)
            eh, nxt, elen, esess = L.entry_probe(buf, eoff)
            if eh == h and elen == klen and esess == session and L.entry_key(buf, eoff, klen) == key:
                return rec - 1
            rec = nxt
        return -1

    def link(self, idx: int, b: int) -> None:
        """Push entry ``idx`` (fully written) on bucket ``b``'s chain."""
        head_off = self.layout.bucket(b)
        L.set_entry_next(self.buf, self.layout.entry(idx), L.bucket_head(self.buf, head_off))
        L.set_bucket_head(self.buf, head_off, idx + 1)  # the publishing store

    def unlink(self, idx: int, b: int) -> None:
        """Remove entry ``idx`` from bucket ``b``'s chain (no-op if absent)."""
        buf, lay = self.buf, self.layout
        target = idx + 1
        head_off = lay.bucket(b)
        rec = L.bucket_head(buf, head_off)
        nxt = L.entry_next(buf, lay.entry(idx))
        if rec == target:
            L.set_bucket_head(buf, head_off, nxt)
            return
        while rec:
            eoff = lay.entry(rec - 1)
            cur = L.entry_next(buf, eoff)
            if cur == target:
                L.set_entry_next(buf, eoff, nxt)
                return
            rec = cur

    def bucket_of(self, idx: int) -> int:
        return L.entry_hash(self.buf, self.layout.entry(idx)) & self._bucket_mask

    # ---- entries (ALLOC lock held) ---------------------------------------
    def new_entry(self) -> int:
        """Pop a free entry index, or -1 when the table is full."""
        next_unused, free_head = L.entry_cursor(self.buf)
        if free_head:
            L.set_entry_cursor(self.buf, next_unused, L.entry_next(self.buf, self.layout.entry(free_head - 1)))
            return free_head - 1
        if next_unused >= self.layout.max_objects:
            return -1
        L.set_entry_cursor(self.buf, next_unused + 1, 0)
        return next_unused

    def release_entry(self, idx: int) -> None:
        """Free entry ``idx`` and its arena extent; bump its generation."""
        buf, eoff = self.buf, self.layout.entry(idx)
        e = L.unpack_entry(buf, eoff)
        if e.extent:
            self.alloc.free(e.extent)
        if e.state != L.FREE:
            L.set_used(buf, e.level, L.used(buf, e.level) - e.size)
            L.set_nobjects(buf, L.nobjects(buf) - 1)
        next_unused, free_head = L.entry_cursor(buf)
        L.pack_entry(buf, eoff, L.EntryHead(0, 0, 0, 0.0, 0.0, e.hash, free_head, (e.gen + 1) & 0xFFFFFFFF,
                                            0, -1, 0, 0, 0, 0, L.FREE, 0, 0, 0))
        L.set_entry_cursor(buf, next_unused, idx + 1)

    # ---- pins (stripe lock of the entry held) ----------------------------
    def pin_shared(self, slot: int, idx: int) -> None:
        """Set ``slot``'s pin bit on ``idx`` and count it (first local pin)."""
        byte, mask = self.layout.pinbit(slot, idx)
        buf = self.buf
        if buf[byte] & mask:
            return
        buf[byte] = buf[byte] | mask
        eoff = self.layout.entry(idx)
        L.set_entry_pins(buf, eoff, L.entry_pins(buf, eoff) + 1)

    def unpin_shared(self, slot: int, idx: int) -> int:
        """Clear ``slot``'s pin bit on ``idx``; returns the remaining pin count."""
        byte, mask = self.layout.pinbit(slot, idx)
        buf = self.buf
        eoff = self.layout.entry(idx)
        pins = L.entry_pins(buf, eoff)
        if buf[byte] & mask:
            buf[byte] = buf[byte] & ~mask
            pins = max(0, pins - 1)
            L.set_entry_pins(buf, eoff, pins)
        return pins

    def pinned_by(self, slot: int) -> np.ndarray:
        """Entry indices whose pin bit ``slot`` has set."""
        bits = np.unpackbits(L.pinmap(self.buf, self.layout, slot), bitorder="little")
        return np.flatnonzero(bits[: self.layout.max_objects])

    def repair_pins(self, stripe: int) -> None:
        """Recompute the pin counts of ``stripe``'s entries from the client bitmaps."""
        lay = self.layout
        maps = np.ndarray((lay.max_clients, lay.bitmap_bytes), np.uint8, buffer=self.buf, offset=lay.pinmaps)
        counts = np.zeros(lay.max_objects, np.uint32)
        for slot in np.flatnonzero(maps.any(axis=1)):
            counts += np.unpackbits(maps[slot], bitorder="little")[: lay.max_objects]
        table = L.entry_table(self.buf, lay)
        mine = (table["hash"] & self._bucket_mask & self._stripe_mask) == stripe
        table["pins"][mine] = counts[mine]
