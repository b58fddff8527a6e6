"""Where each section of a node store's metadata segment starts (:class:`Layout`).

each aligned to 64 bytes (``Layout`` computes the offsets from the header)::

    offset   size                 what
    0        4096                 HEADER (identity, fixed at creation) at 0, ALLOC_STATE at
                                  256, SPILL_STATE at 1024, the spill directory's path
                                  (1024 bytes, NUL padded) at 2048, TRANSFER_STATS at 3072
    4096     MAX_SESSIONS * 64    SESSION names; id 0 is ""
    ...      nlocks * 64          process-shared robust mutexes: ADMIN, ALLOC, then
                                  one per key stripe
    ...      max_clients * 256    CLIENT records (attached processes), each with its
                                  REQUEST to the spill process at byte 64
    ...      nstripes * 64        STRIPE_STATS: used bytes per level, object count and
                                  deleted-but-pinned count of the entries hashed to
                                  each stripe (under its lock)
    ...      nbuckets * 4         BUCKET records: hash chain heads
    ...      max_objects * 448    ENTRY records (the object table): ENTRY_HEAD at 0,
                                  ENTRY_ARRAY at 80, the key (UTF-8) at 168
    ...      nextents * 40        EXTENT records (the arena allocator)
    ...      max_clients * N      pin bytes: byte i of client c's row is 1 while c pins
                                  entry i (N = max_objects rounded up to 64)
    ...      NMIGRATIONS * 416    MIGRATION map: transfers into this node in flight
                                  (or just failed), one per key (under the ADMIN lock)
    ...      MAX_GPUS * 512       GPU_ARENA records: one device allocation per GPU, its
                                  IPC handle and its allocator bins (under the ALLOC lock)

Small objects are carved from per-client chunks without the ALLOC lock: a
client takes a chunk (one extent) under the lock, records it in its CLIENT
record, and cuts objects off it with a private bump pointer; their entries
point at the chunk's extent with flag 2. A full chunk is retired; the
janitor frees retired chunks no entry points at any more. Free entries are
likewise handed out to clients in batches (state 4).

Pins are bytes, not counts: each client writes only its own row (one
store sets or clears a pin, no read-modify-write), sets a byte only under
the entry's stripe lock, and may clear it without a lock. Whoever frees or
moves an entry checks the entry's column under the stripe lock.

Pickled objects in the arena start with OBJECT_HEADER, then nblobs BLOB
records, then the pickle stream, then the blobs at 64-byte aligned offsets.

"""
from __future__ import annotations

from typing import Any

from .fields import (
    BUCKET,
    CLIENT,
    ENTRY_SIZE,
    EXTENT,
    GPU_ARENA,
    HEADER_SIZE,
    LOCK_FIRST_STRIPE,
    LOCK_STRIDE,
    MAX_GPUS,
    MAX_SESSIONS,
    MIGRATION,
    MIN_CHUNK,
    NMIGRATIONS,
    PAGE,
    SESSION,
    STRIPE_SHIFT,
    STRIPE_STATS,
    align,
)

__all__ = ["Layout", "page_align"]


def page_align(n: int) -> int:
    """Round ``n`` up to a page."""
    return (n + PAGE - 1) & ~(PAGE - 1)


class Layout:
    """Offsets of every section of a metadata segment, computed from its sizes."""

    def __init__(self, max_objects: int, max_clients: int, nstripes: int, capacity: int = 0) -> None:
        self.max_objects = max_objects
        self.max_clients = max_clients
        self.nstripes = nstripes
        self.nbuckets = 1 << max(4, (max_objects - 1).bit_length())
        # used extents: one per object at most, a current chunk per client, retired chunks
        # (each at least MIN_CHUNK); free extents: at most one more than used ones
        self.nextents = 2 * (max_objects + max_clients + capacity // MIN_CHUNK) + 2 + 2 * MAX_GPUS
        self.nlocks = LOCK_FIRST_STRIPE + nstripes
        self.pinrow = align(max_objects)
        self.sessions = HEADER_SIZE
        self.locks = align(self.sessions + MAX_SESSIONS * SESSION.size)
        self.clients = align(self.locks + self.nlocks * LOCK_STRIDE)
        self.stats = align(self.clients + max_clients * CLIENT.size)
        self.buckets = align(self.stats + nstripes * STRIPE_STATS.size)
        self.entries = align(self.buckets + self.nbuckets * BUCKET.size)
        self.extents = align(self.entries + max_objects * ENTRY_SIZE)
        self.pinmaps = align(self.extents + self.nextents * EXTENT.size)
        self.migrations = align(self.pinmaps + max_clients * self.pinrow)
        self.gpus = align(self.migrations + NMIGRATIONS * MIGRATION.size)
        self.size = page_align(self.gpus + MAX_GPUS * GPU_ARENA.size)

    @classmethod
    def from_header(cls, h: Any) -> Layout:
        return cls(h.max_objects, h.max_clients, h.nstripes, h.capacity)

    def lock_offset(self, index: int) -> int:
        return self.locks + index * LOCK_STRIDE

    def stripe_lock(self, stripe: int) -> int:
        return LOCK_FIRST_STRIPE + stripe

    def entry(self, idx: int) -> int:
        """Offset of entry ``idx`` (0-based)."""
        return self.entries + idx * ENTRY_SIZE

    def bucket(self, b: int) -> int:
        return self.buckets + BUCKET.size * b

    def stripe_of_bucket(self, b: Any) -> Any:
        """The stripe of bucket ``b`` (an int, or an array of them): runs of ``1 << STRIPE_SHIFT`` buckets (one
        cache line of heads) belong to one stripe, the stripes in turn. ``refs.key_ref`` computes the same
        inline on the hot path, and ``_fast.c`` from ``fast_path_layout``."""
        return (b >> STRIPE_SHIFT) & (self.nstripes - 1)

    def extent(self, rec: int) -> int:
        """Offset of extent record ``rec`` (1-based)."""
        return self.extents + (rec - 1) * EXTENT.size

    def client(self, slot: int) -> int:
        return self.clients + slot * CLIENT.size

    def stripe_stats(self, stripe: int) -> int:
        return self.stats + stripe * STRIPE_STATS.size

    def session(self, sid: int) -> int:
        return self.sessions + sid * SESSION.size

    def pinbyte(self, slot: int, idx: int) -> int:
        """Offset of client ``slot``'s pin byte for entry ``idx``."""
        return self.pinmaps + slot * self.pinrow + idx

    def migration(self, slot: int) -> int:
        return self.migrations + slot * MIGRATION.size

    def gpu(self, d: int) -> int:
        return self.gpus + d * GPU_ARENA.size
