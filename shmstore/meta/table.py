"""The object table: hash chains of ENTRY records, pins, entry reuse.

Keys hash (crc32, seeded with the session id) to a bucket; buckets are
grouped into ``nstripes`` stripes, each guarded by its own lock, so processes
working on unrelated keys rarely meet on a lock. A chain is linked and
unlinked with single 4-byte stores after the entry is fully written, so a
process killed mid-update never leaves a broken chain.

Pins: each client process has a row of pin bytes, one per entry. It sets a
byte only while holding the entry's stripe lock (so whoever frees or moves
the entry, checking the column under that lock, sees it) and clears it with a
plain store, without a lock. A process keeps its own counts of views,
readers and explicit pins; only the first pin and the last unpin touch
shared memory. The one race of the lock-free clear, step by step: a deleter
holding the lock sees our byte still set and marks the entry ``deleted``
instead of freeing it; we clear the byte and read the state before the
``deleted`` store reaches us. Nobody frees the entry then, so the janitor
sweeps ``deleted`` entries nobody pins (:func:`janitor.sweep_deleted`).
Nothing is ever freed under a pin.

Lock order: stripe lock, then ALLOC lock. Never the other way round.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import layout as L
from .alloc import Allocator
from .keyref import key_ref
from .lock import Orderly

__all__ = ["Table", "EntryStolen", "owns_entry", "find_entry"]


class EntryStolen(Orderly):
    """A batch entry was taken by a client whose table ran out: take another (private, never escapes)."""


def owns_entry(buf: Any, eoff: int, slot: int, gen: int) -> bool:
    """True if the entry at ``eoff`` is reserved for client ``slot`` with generation ``gen``."""
    e = L.entry(buf, eoff)
    return e.state == L.RESERVED and e.writer == slot and e.gen == gen


_BUCKET_HEAD = L.BUCKET.field("head")


def find_entry(buf: Any, layout: L.Layout, b: int, h: int, session: int,
               key: bytes) -> tuple[int, int, tuple[Any, ...] | None]:
    """Walk bucket ``b``'s chain for ``key``: (index, entry offset, raw ENTRY_HEAD tuple) or (-1, 0, None).

    The raw tuple (indexed with ``layout.E_*``) because the kernel's hot paths call this; the stripe lock
    of ``b`` is held.
    """
    rec = _BUCKET_HEAD.unpack_from(buf, layout.bucket(b))[0]
    base, klen, kstart = layout.entries, len(key), L.ENTRY_KEY_OFFSET
    unpack, h_, n_, kl_, s_ = L.entry_raw, L.E_HASH, L.E_NEXT, L.E_KEYLEN, L.E_SESSION
    while rec:
        eoff = base + (rec - 1) * L.ENTRY_SIZE
        e = unpack(buf, eoff)
        if e[h_] == h and e[kl_] == klen and e[s_] == session and buf[eoff + kstart: eoff + kstart + klen] == key:
            return rec - 1, eoff, e
        rec = e[n_]
    return -1, 0, None


class Table:
    """Operations on the entry table of one metadata segment.

    Owns nothing (the buffer belongs to the metadata segment). Methods say
    which lock the caller must hold; the table itself takes none.
    """

    def __init__(self, buf: Any, layout: L.Layout, alloc: Allocator) -> None:
        self.buf = buf
        self.layout = layout
        self.alloc = alloc
        self._bucket_mask = layout.nbuckets - 1
        self._stripe_mask = layout.nstripes - 1
        self._pins = L.pin_table(buf, layout)

    # ---- hashing ---------------------------------------------------------
    def locate(self, session: int, key: bytes) -> tuple[int, int, int]:
        """(hash, bucket, stripe) of a key (its UTF-8 bytes ``key``) in ``session`` (see :func:`key_ref`)."""
        ref = key_ref(key.decode(), key, session, self._bucket_mask, self._stripe_mask)
        return ref.h, ref.bucket, ref.stripe

    def stripe_of(self, idx: int) -> int:
        h: int = L.ENTRY_HEAD.get(self.buf, self.layout.entry(idx), "hash")
        stripe: int = self.layout.stripe_of_bucket(h & self._bucket_mask)
        return stripe

    def stripe_mask(self, stripe: int, t: np.ndarray) -> np.ndarray:
        """Boolean mask of the entries of ``t`` (an entry table view) whose key hashes to ``stripe``."""
        mask: np.ndarray = self.layout.stripe_of_bucket(t["hash"] & self._bucket_mask) == stripe
        return mask

    def buckets_of(self, stripe: int) -> list[int]:
        """The buckets of ``stripe``: runs of ``1 << STRIPE_SHIFT`` (one cache line of heads each)."""
        run, lay = 1 << L.STRIPE_SHIFT, self.layout
        return [b for first in range(stripe * run, lay.nbuckets, lay.nstripes * run)
                for b in range(first, min(first + run, lay.nbuckets))]

    def repair_stats(self, stripe: int) -> None:
        """Recompute one stripe's usage from its entries (stripe lock held)."""
        t = L.entry_table(self.buf, self.layout)
        live = ((t["state"] == L.WRITING) | (t["state"] == L.SEALED) | (t["state"] == L.DELETED))
        mine = live & self.stripe_mask(stripe, t)
        used = [int(t["size"][mine & (t["level"] == lv)].sum()) for lv in range(3)]
        deleted = int((mine & (t["state"] == L.DELETED)).sum())
        L.STRIPE_STATS.pack(self.buf, self.layout.stripe_stats(stripe), used=used, objects=int(mine.sum()),
                            deleted=deleted)

    def prune_chains(self, stripe: int) -> np.ndarray:
        """Unlink from the stripe's chains whatever is not a live entry of that bucket (stripe lock held).

        Returns the indices of the entries left linked. A chain is cut where
        it would loop.
        """
        buf, lay = self.buf, self.layout
        linked: list[int] = []
        seen: set[int] = set()
        for b in self.buckets_of(stripe):
            prev_off, rec = lay.bucket(b), L.BUCKET.get(buf, lay.bucket(b), "head")
            while rec:
                idx = rec - 1
                if not 0 <= idx < lay.max_objects or idx in seen:  # garbage or a loop: cut here
                    self._set_link(prev_off, b, 0)
                    break
                seen.add(idx)
                eoff = lay.entry(idx)
                e = L.entry(buf, eoff)
                if e.state in (L.WRITING, L.SEALED) and e.hash & self._bucket_mask == b:
                    linked.append(idx)
                    prev_off = eoff
                else:
                    self._set_link(prev_off, b, e.next)  # drop it, keep the rest
                rec = e.next
        return np.array(sorted(linked), dtype=np.int64)

    def _set_link(self, prev_off: int, b: int, rec: int) -> None:
        """Point a bucket head (``prev_off`` is the bucket's offset) or an entry's ``next`` at ``rec``."""
        if prev_off == self.layout.bucket(b):
            L.BUCKET.set(self.buf, prev_off, "head", rec)
        else:
            L.ENTRY_HEAD.set(self.buf, prev_off, "next", rec)

    # ---- chains (stripe lock held) --------------------------------------
    def link(self, idx: int, b: int) -> None:
        """Push entry ``idx`` (fully written) on bucket ``b``'s chain."""
        head_off = self.layout.bucket(b)
        L.ENTRY_HEAD.set(self.buf, self.layout.entry(idx), "next", L.BUCKET.get(self.buf, head_off, "head"))
        L.BUCKET.set(self.buf, head_off, "head", idx + 1)  # the publishing store

    def replace(self, old: int, idx: int, b: int) -> None:
        """Put entry ``idx`` (fully written) where ``old`` is in bucket ``b``'s chain, in one store.

        Killed before that store, ``idx`` is a ghost (the stripe's repair
        drops it) and ``old`` still answers; after it, ``idx`` answers and
        ``old`` is the ghost. Never both, never neither.
        """
        buf, lay = self.buf, self.layout
        L.ENTRY_HEAD.set(buf, lay.entry(idx), "next", L.ENTRY_HEAD.get(buf, lay.entry(old), "next"))
        head_off = lay.bucket(b)
        rec = L.BUCKET.get(buf, head_off, "head")
        if rec == old + 1:
            L.BUCKET.set(buf, head_off, "head", idx + 1)  # the publishing store
            return
        while rec:
            eoff = lay.entry(rec - 1)
            cur = L.ENTRY_HEAD.get(buf, eoff, "next")
            if cur == old + 1:
                L.ENTRY_HEAD.set(buf, eoff, "next", idx + 1)  # the publishing store
                return
            rec = cur
        raise AssertionError(f"entry {old} is not in bucket {b}'s chain")

    def unlink(self, idx: int, b: int) -> bool:
        """Remove entry ``idx`` from bucket ``b``'s chain; False (a no-op) if it is not in it."""
        buf, lay = self.buf, self.layout
        target = idx + 1
        head_off = lay.bucket(b)
        rec = L.BUCKET.get(buf, head_off, "head")
        nxt = L.ENTRY_HEAD.get(buf, lay.entry(idx), "next")
        if rec == target:
            L.BUCKET.set(buf, head_off, "head", nxt)
            return True
        while rec:
            eoff = lay.entry(rec - 1)
            cur = L.ENTRY_HEAD.get(buf, eoff, "next")
            if cur == target:
                L.ENTRY_HEAD.set(buf, eoff, "next", nxt)
                return True
            rec = cur
        return False

    def bucket_of(self, idx: int) -> int:
        h: int = L.ENTRY_HEAD.get(self.buf, self.layout.entry(idx), "hash")
        return h & self._bucket_mask

    # ---- entries ----------------------------------------------------------------
    def new_entry(self) -> int:
        """Pop a free entry index, or -1 when the table is full (ALLOC lock held)."""
        next_unused, free_head = L.entry_cursor(self.buf)
        if free_head:
            nxt = L.ENTRY_HEAD.get(self.buf, self.layout.entry(free_head - 1), "next")
            L.set_entry_cursor(self.buf, next_unused, nxt)
            return free_head - 1
        if next_unused >= self.layout.max_objects:
            return -1
        L.set_entry_cursor(self.buf, next_unused + 1, 0)
        return next_unused

    def count(self, idx: int, sign: int) -> None:
        """Add (sign=1) or remove (sign=-1) entry ``idx`` from its stripe's usage (stripe lock held)."""
        e = L.entry(self.buf, self.layout.entry(idx))
        soff = self.layout.stripe_stats(self.stripe_of(idx))
        L.add_stripe_stats(self.buf, soff, e.level, sign * e.size, sign)
        if sign < 0 and e.state == L.DELETED:
            L.add_stripe_deleted(self.buf, soff, -1)

    def mark_deleted(self, idx: int) -> None:
        """Hide a pinned entry until its last pin goes (stripe lock held)."""
        L.ENTRY_HEAD.set(self.buf, self.layout.entry(idx), "state", L.DELETED)
        L.add_stripe_deleted(self.buf, self.layout.stripe_stats(self.stripe_of(idx)), 1)

    def deleted_pending(self) -> int:
        """Deleted entries still waiting for their last pin, store-wide."""
        return int(L.stats_table(self.buf, self.layout)["deleted"].sum())

    def keep_entry(self, idx: int, slot: int) -> int:
        """Free an entry carved from a chunk into client ``slot``'s batch (stripe lock held).

        Its bytes need no freeing: the chunk goes back whole once no entry
        points at it. Takes no ALLOC lock. Returns the entry's new generation.
        """
        self.count(idx, -1)
        eoff = self.layout.entry(idx)
        e = L.entry(self.buf, eoff)
        gen = (e.gen + 1) & 0xFFFFFFFF
        L.ENTRY_HEAD.pack(self.buf, eoff, hash=e.hash, gen=gen, writer=slot, state=L.RESERVED)
        return gen

    def release_entry(self, idx: int, free_extent: bool = True) -> None:
        """Free entry ``idx`` onto the global lists, and its own extent unless its level freed its space
        (stripe + ALLOC locks held)."""
        buf, eoff = self.buf, self.layout.entry(idx)
        e = L.entry(buf, eoff)
        state = e.state
        if state in (L.WRITING, L.SEALED, L.DELETED):
            self.count(idx, -1)
        if free_extent and e.extent and not e.flags & L.FLAG_IN_CHUNK:
            self.alloc.free_owned(e.extent, idx + 1)
        self.push_free(idx, e.hash)

    def push_free(self, idx: int, h: int) -> None:
        """Put entry ``idx`` on the global free list, a new generation (ALLOC lock held).

        The new generation makes every (index, generation) pair naming the
        entry so far stale: a client's batch, a spill file name, a view's pin.
        """
        next_unused, free_head = L.entry_cursor(self.buf)
        eoff = self.layout.entry(idx)
        gen = (L.ENTRY_HEAD.get(self.buf, eoff, "gen") + 1) & 0xFFFFFFFF
        L.ENTRY_HEAD.pack(self.buf, eoff, hash=h, next=free_head, gen=gen, writer=-1, state=L.FREE)
        L.set_entry_cursor(self.buf, next_unused, idx + 1)

    # ---- pins ----------------------------------------------------------------
    def unpin(self, slot: int, idx: int) -> None:
        """Clear ``slot``'s pin byte on ``idx`` (no lock needed: see the module notes)."""
        self.buf[self.layout.pinbyte(slot, idx)] = 0

    def pin_count(self, idx: int) -> int:
        """Number of client processes pinning ``idx`` (rows of slots never taken hold no pins)."""
        return int(np.count_nonzero(self._pins[:L.ALLOC.get(self.buf, "slots_high"), idx]))

    def pin_counts(self, n: int) -> np.ndarray:
        """Pinning processes of each of the first ``n`` entries (pass ``len`` of the entry table view it
        goes with; summed over the client slots ever taken)."""
        counts: np.ndarray = np.count_nonzero(self._pins[:L.ALLOC.get(self.buf, "slots_high"), :n], axis=0)
        return counts

    def pinned_by(self, slot: int) -> np.ndarray:
        """Entry indices that client ``slot`` pins (only entries ever handed out can be pinned)."""
        return np.flatnonzero(self._pins[slot, :L.entry_cursor(self.buf)[0]])

    def clear_pins(self, slot: int) -> None:
        self._pins[slot, :L.entry_cursor(self.buf)[0]] = 0
