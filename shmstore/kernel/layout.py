"""All binary layout of a node store: the metadata segment and object headers.

Nothing else in shmstore computes an offset into shared memory: the other
modules call the pack/unpack functions here, which are pure functions over a
buffer (``mmap``, ``memoryview`` or ``bytearray``) and an offset.

Metadata segment (``/shmstore-<uid>-<name>-<node>-meta``), sections in order,
each aligned to 64 bytes (``Layout`` computes the offsets from the header)::

    offset   size                 what
    0        4096                 HEADER (identity, fixed at creation) + ALLOC_STATE
                                  + SPILL_STATE + the spill directory's path
    4096     MAX_SESSIONS * 64    session names (SESSION records); id 0 is ""
    ...      nlocks * 64          process-shared robust mutexes: ADMIN, ALLOC,
                                  SPILL, then one per key stripe
    ...      max_clients * 256    CLIENT records (attached processes) with their
                                  REQUEST to the spill process
    ...      nstripes * 64        STRIPE_STATS: used bytes per level, object count and
                                  deleted-but-pinned count of the entries hashed to
                                  each stripe (under its lock)
    ...      nbuckets * 4         hash bucket heads (i32, 1-based entry index, 0 = none)
    ...      max_objects * 448    ENTRY records (the object table)
    ...      nextents * 40        EXTENT records (the arena allocator)
    ...      max_clients * N      pin bytes: byte i of client c's row is 1 while c pins
                                  entry i (N = max_objects rounded up to 64)
    ...      NMIGRATIONS * 416    MIGRATION map: transfers into this node in flight
                                  (or just failed), one per key (under the ADMIN lock)

HEADER (offset 0)::

    off  size type    field
    0    8    8s      magic b"SHMSTOR\\0"
    8    4    u32     layout_version (LAYOUT_VERSION)
    12   4    u32     state: 0 initialising, 1 ready, 2 destroying
    16   4    u32     flags: 1 persistent
    20   4    u32     uid of the owner
    24   4    i32     pid of the creator
    28   4    i32     pid of the spill process (0 none, -1 being started)
    32   8    u64     capacity of the MEMORY arena in bytes
    40   8    u64     size of this segment
    48   4    u32     max_objects
    52   4    u32     max_clients
    56   4    u32     nstripes
    60   4    u32     nbuckets
    64   8    f64     creation time (time.time())
    72   64   64s     store name (NUL padded)
    136  64   64s     node id (NUL padded)

ALLOC_STATE (offset 256, guarded by the ALLOC lock)::

    0    8    u64     bytes reserved on the DISK level (its quota counter)
    8    16   2*u64   reserved
    24   8    u64     number of retired chunks not yet reclaimed
    32   8    u64     arena frontier: end of the highest extent ever handed out
    40   4    u32     entries never used yet start here (0-based)
    44   4    i32     head of the free entry list (1-based, 0 none)
    48   4    u32     extents never used yet start here (0-based)
    52   4    i32     head of the free extent-record list (1-based)
    56   8    u64     bitmap of non-empty allocator bins
    64   256  64*i32  allocator bins: free extents with size in [2**k, 2**(k+1))

SPILL_STATE (offset 1024; watermarks fixed at creation, the rest written by
the spill process)::

    0    8    f64     high watermark (fraction of the MEMORY capacity)
    8    8    f64     low watermark
    16   8    u64     DISK capacity in bytes
    24   8    u64     bytes spilled to DISK so far
    32   8    u64     bytes restored to MEMORY so far
    40   4    i32     entry being moved (1-based, 0 none)
    44   4    i32     level it is moving to
    48   8    u64     bytes of that move done
    56   8    u64     bytes of that move in all
    64   8    u64     failed moves so far
    72   8    f64     last time the spill process went round its loop

SPILL_DIR (offset 2048, 1024 bytes): the spill directory (UTF-8, NUL padded);
DISK objects are files ``<index>.<generation>`` in it.

TRANSFER_STATS (offset 3072, under the ADMIN lock): transfers into this node,
bytes received, bytes sent, requests that joined a transfer already in
flight (4 x u64).

MIGRATION (416 bytes): state u32 (0 free, 1 in flight, 2 failed), session
u16, key length u16, pid i32 of the transferring process, pad, start time
(``/proc`` ticks) u64, time f64, error message 128s, key 256s.

ENTRY (object table record, ENTRY_SIZE bytes)::

    0    8    u64     offset of the data in its level (arena offset for MEMORY, 0 for DISK)
    8    8    u64     stored size in bytes (the same on every level)
    16   8    u64     logical size (what ObjectInfo.size reports)
    24   8    f64     last access (CLOCK_MONOTONIC, comparable across processes)
    32   8    f64     creation time
    40   4    u32     crc32 of (session, key)
    44   4    i32     next entry in the bucket chain (1-based, 0 end)
    48   4    u32     generation (bumped whenever the entry is reused)
    52   4    u32     reserved (pins live in the pin bytes)
    56   4    i32     client slot of the writer while WRITING (of the batch while RESERVED;
                      left stale once sealed)
    60   4    i32     extent record of the data (1-based, 0 none); on DISK, the
                      arena extent of a restore in progress; while RESERVED, the
                      extent placed for a put in flight (written under the ALLOC
                      lock, so that the extent and its owner name each other)
    64   4    u32     number of blobs
    68   2    u16     key length in bytes
    70   2    u16     session id
    72   1    u8      state: 0 free, 1 writing, 2 sealed (only ever while linked),
                      3 deleted (hidden; freed by its last pin), 4 reserved (in client
                      ``writer``'s batch of free entries)
    73   1    u8      kind: 0 raw bytes, 1 ndarray, 2 pickle5
    74   1    u8      level (Level value)
    75   1    u8      flags: 1 being moved, 2 carved from a chunk (``extent`` is the chunk)
    80   16   16s     ndarray dtype.str
    96   1    u8      ndarray ndim (<= 8)
    97   1    u8      ndarray order: 0 C, 1 F
    104  64   8*i64   ndarray shape
    168  256  bytes   key (UTF-8)

EXTENT (allocator record, 40 bytes)::

    0    8    u64     arena offset
    8    8    u64     size
    16   4    i32     physical predecessor (1-based, 0 none)
    20   4    i32     physical successor
    24   4    i32     previous in its free bin list
    28   4    i32     next in its free bin list
    32   4    i32     0 record unused, 1 free, 2 used by one object, 3 a client's
                      current chunk, 4 a retired chunk
    36   4    i32     owning entry (1-based) while used; -(slot+1) for a chunk

CLIENT (CLIENT_SIZE = 256 bytes)::

    0    4    i32     pid
    4    4    i32     state: 0 free, 1 attached
    8    8    u64     start time (``/proc/<pid>/stat`` field 22, tells a reused pid apart)
    16   8    f64     attach time
    24   4    i32     extent record of the client's current chunk (0 none)
    32   8    u64     arena offset of that chunk
    40   8    u64     its size
    64   160  REQUEST  what the client asked of the spill process:
         0    u32     kind: 0 none, 1 make room (nbytes in MEMORY), 2 move entry to level
         4    u32     sequence number (bumped by the client on every request)
         8    i32     entry index
         12   u32     entry generation
         16   u32     target level
         20   u32     status: 0 idle, 1 pending, 2 done, 3 failed
         24   u32     error kind when failed: 1 full, 2 I/O, 3 locked, 4 not found
         32   u64     bytes
         40   120s    error message (UTF-8)

Small objects are carved from per-client chunks without the ALLOC lock: a
client takes a chunk (one extent) under the lock, records it here, and cuts
objects off it with a private bump pointer; their entries point at the
chunk's extent with flag 2. A full chunk is retired; the janitor frees
retired chunks no entry points at any more. Free entries are likewise
handed out to clients in batches (state 4).

Pins are bytes, not counts: each client writes only its own row (one
store sets or clears a pin, no read-modify-write), sets a byte only under
the entry's stripe lock, and may clear it without a lock. Whoever frees or
moves an entry checks the entry's column under the stripe lock.

Pickled objects in the arena start with OBJECT_HEADER (nblobs u32, flags u32,
pickle length u64), then nblobs BLOB records (offset u64 from the object
start, length u64), then the pickle stream, then the blobs at 64-byte aligned
offsets.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

MAGIC = b"SHMSTOR\0"
LAYOUT_VERSION = 3
HEADER_SIZE = 4096
MAX_SESSIONS = 256
MAX_KEY = 255
MAX_NDIM = 8
ALIGN = 64
PAGE = 4096
NBINS = 64
MIN_CHUNK = 64 << 10  # smallest chunk of the arena handed to a client for small objects

# lock indices
LOCK_ADMIN, LOCK_ALLOC, LOCK_SPILL, LOCK_FIRST_STRIPE = 0, 1, 2, 3
LOCK_STRIDE = 64

# entry states and kinds
FREE, WRITING, SEALED, DELETED, RESERVED = 0, 1, 2, 3, 4
KIND_RAW, KIND_NDARRAY, KIND_PICKLE = 0, 1, 2
FLAG_MOVING, FLAG_IN_CHUNK = 1, 2
LEVEL_GPU, LEVEL_MEMORY, LEVEL_DISK = 0, 1, 2  # Level values, for code below the Level enum
LEVEL_NAMES = ("gpu", "memory", "disk")
STATE_NAMES = {FREE: "free", WRITING: "writing", SEALED: "sealed", DELETED: "deleted", RESERVED: "reserved"}
# header states and flags
STATE_INIT, STATE_READY, STATE_DESTROYING = 0, 1, 2
FLAG_PERSIST = 1
# extent record flags
EXT_UNUSED, EXT_FREE, EXT_USED, EXT_CHUNK, EXT_RETIRED = 0, 1, 2, 3, 4

HEADER = struct.Struct("<8sIIIIiiQQIIIId64s64s")
ALLOC_OFFSET = 256
ALLOC_STATE = struct.Struct("<3QQQIiIiQ")  # see the table; fields 0-2 reserved
BINS = struct.Struct(f"<{NBINS}i")
BINS_OFFSET = ALLOC_OFFSET + ALLOC_STATE.size
SPILL_OFFSET = 1024
TRANSFER_STATS = struct.Struct("<4Q")
TRANSFER_STATS_OFFSET = 3072
MIGRATION = struct.Struct("<IHHi4xQd128s256s")
MIGRATION_SIZE = 416
NMIGRATIONS = 128
MIG_FREE, MIG_FLIGHT, MIG_FAILED = 0, 1, 2
SPILL_STATE = struct.Struct("<ddQQQiiQQQd")
SPILL_DIR_OFFSET, SPILL_DIR_SIZE = 2048, 1024
SESSION = struct.Struct("<B63s")
SESSION_SIZE = 64
CLIENT = struct.Struct("<iiQd")
CLIENT_CHUNK = struct.Struct("<i4xQQ")
CLIENT_CHUNK_OFFSET = 24
CLIENT_SIZE = 256
REQUEST = struct.Struct("<IIiIIII4xQ120s")
REQUEST_OFFSET = 64
REQ_NONE, REQ_SPACE, REQ_MOVE = 0, 1, 2
RS_IDLE, RS_PENDING, RS_DONE, RS_FAILED = 0, 1, 2, 3
ERR_FULL, ERR_IO, ERR_LOCKED, ERR_MISSING = 1, 2, 3, 4
STRIPE_STATS = struct.Struct("<3qqq")
STRIPE_STATS_SIZE = 64
ENTRY_HEAD = struct.Struct("<QQQddIiIIiiIHHBBBB4x")
ENTRY_ARRAY = struct.Struct("<16sBB6x8q")
ENTRY_ARRAY_OFFSET = 80
ENTRY_KEY_OFFSET = 168
ENTRY_SIZE = 448
EXTENT = struct.Struct("<QQiiiiii")
OBJECT_HEADER = struct.Struct("<IIQ")
BLOB = struct.Struct("<QQ")

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
# entry field offsets (see the table above)
_E_ATIME, _E_HASH, _E_NEXT, _E_GEN, _E_PINS, _E_WRITER, _E_EXTENT = 24, 40, 44, 48, 52, 56, 60
_E_STATE, _E_LEVEL, _E_FLAGS = 72, 74, 75
_H_STATE, _H_FLAGS, _H_SPILL_PID = 12, 16, 28

# numpy view of the entry table, for vectorised scans (list, janitor, spill policy)
ENTRY_DTYPE = np.dtype({
    "names": ["offset", "size", "nbytes", "atime", "ctime", "hash", "next", "gen", "pins",
              "writer", "extent", "nblobs", "keylen", "session", "state", "kind", "level", "flags"],
    "formats": ["<u8", "<u8", "<u8", "<f8", "<f8", "<u4", "<i4", "<u4", "<u4",
                "<i4", "<i4", "<u4", "<u2", "<u2", "u1", "u1", "u1", "u1"],
    "offsets": [0, 8, 16, 24, 32, 40, 44, 48, 52, 56, 60, 64, 68, 70, 72, 73, 74, 75],
    "itemsize": ENTRY_SIZE,
})
CLIENT_DTYPE = np.dtype({"names": ["pid", "state", "start", "attached", "chunk", "chunk_offset", "chunk_size",
                                   "req_kind", "req_status"],
                         "formats": ["<i4", "<i4", "<u8", "<f8", "<i4", "<u8", "<u8", "<u4", "<u4"],
                         "offsets": [0, 4, 8, 16, 24, 32, 40, 64, 84], "itemsize": CLIENT_SIZE})
STATS_DTYPE = np.dtype({"names": ["used", "objects", "deleted"], "formats": [("<i8", 3), "<i8", "<i8"],
                        "offsets": [0, 24, 32], "itemsize": STRIPE_STATS_SIZE})
EXTENT_DTYPE = np.dtype({"names": ["offset", "size", "prev_phys", "next_phys", "prev_free", "next_free",
                                   "flags", "owner"],
                         "formats": ["<u8", "<u8", "<i4", "<i4", "<i4", "<i4", "<i4", "<i4"],
                         "offsets": [0, 8, 16, 20, 24, 28, 32, 36], "itemsize": 40})


def align(n: int) -> int:
    """Round ``n`` up to the arena alignment (64 bytes)."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def page_align(n: int) -> int:
    """Round ``n`` up to a page."""
    return (n + PAGE - 1) & ~(PAGE - 1)


class Header(NamedTuple):
    magic: bytes
    version: int
    state: int
    flags: int
    uid: int
    creator_pid: int
    spill_pid: int
    capacity: int
    meta_size: int
    max_objects: int
    max_clients: int
    nstripes: int
    nbuckets: int
    created: float
    name: str
    node: str


class Layout:
    """Offsets of every section of a metadata segment, computed from its sizes."""

    def __init__(self, max_objects: int, max_clients: int, nstripes: int, capacity: int = 0) -> None:
        self.max_objects = max_objects
        self.max_clients = max_clients
        self.nstripes = nstripes
        self.nbuckets = 1 << max(4, (max_objects - 1).bit_length())
        # used extents: one per object at most, a current chunk per client, retired chunks
        # (each at least MIN_CHUNK); free extents: at most one more than used ones
        self.nextents = 2 * (max_objects + max_clients + capacity // MIN_CHUNK) + 2
        self.nlocks = LOCK_FIRST_STRIPE + nstripes
        self.pinrow = align(max_objects)
        self.sessions = HEADER_SIZE
        self.locks = align(self.sessions + MAX_SESSIONS * SESSION_SIZE)
        self.clients = align(self.locks + self.nlocks * LOCK_STRIDE)
        self.stats = align(self.clients + max_clients * CLIENT_SIZE)
        self.buckets = align(self.stats + nstripes * STRIPE_STATS_SIZE)
        self.entries = align(self.buckets + self.nbuckets * 4)
        self.extents = align(self.entries + max_objects * ENTRY_SIZE)
        self.pinmaps = align(self.extents + self.nextents * EXTENT.size)
        self.migrations = align(self.pinmaps + max_clients * self.pinrow)
        self.size = page_align(self.migrations + NMIGRATIONS * MIGRATION_SIZE)

    @classmethod
    def from_header(cls, h: Header) -> "Layout":
        return cls(h.max_objects, h.max_clients, h.nstripes, h.capacity)

    def lock_offset(self, index: int) -> int:
        return self.locks + index * LOCK_STRIDE

    def stripe_lock(self, stripe: int) -> int:
        return LOCK_FIRST_STRIPE + stripe

    def entry(self, idx: int) -> int:
        """Offset of entry ``idx`` (0-based)."""
        return self.entries + idx * ENTRY_SIZE

    def bucket(self, b: int) -> int:
        return self.buckets + 4 * b

    def extent(self, rec: int) -> int:
        """Offset of extent record ``rec`` (1-based)."""
        return self.extents + (rec - 1) * EXTENT.size

    def client(self, slot: int) -> int:
        return self.clients + slot * CLIENT_SIZE

    def stripe_stats(self, stripe: int) -> int:
        return self.stats + stripe * STRIPE_STATS_SIZE

    def session(self, sid: int) -> int:
        return self.sessions + sid * SESSION_SIZE

    def pinbyte(self, slot: int, idx: int) -> int:
        """Offset of client ``slot``'s pin byte for entry ``idx``."""
        return self.pinmaps + slot * self.pinrow + idx


# ---- header -----------------------------------------------------------------

def pack_header(buf, h: Header) -> None:
    HEADER.pack_into(buf, 0, h.magic, h.version, h.state, h.flags, h.uid, h.creator_pid,
                     h.spill_pid, h.capacity, h.meta_size, h.max_objects, h.max_clients,
                     h.nstripes, h.nbuckets, h.created, h.name.encode(), h.node.encode())


def unpack_header(buf) -> Header:
    f = list(HEADER.unpack_from(buf, 0))
    f[14] = f[14].rstrip(b"\0").decode(errors="replace")
    f[15] = f[15].rstrip(b"\0").decode(errors="replace")
    return Header(*f)


class SpillState(NamedTuple):
    high: float
    low: float
    disk_capacity: int
    spilled: int
    restored: int
    moving: int
    moving_to: int
    progress: int
    total: int
    failures: int
    heartbeat: float


def unpack_spill_state(buf) -> SpillState:
    return SpillState._make(SPILL_STATE.unpack_from(buf, SPILL_OFFSET))


def pack_spill_state(buf, s: SpillState) -> None:
    SPILL_STATE.pack_into(buf, SPILL_OFFSET, *s)


def spill_dir(buf) -> str:
    return bytes(buf[SPILL_DIR_OFFSET: SPILL_DIR_OFFSET + SPILL_DIR_SIZE]).rstrip(b"\0").decode()


def set_spill_dir(buf, path: str) -> None:
    raw = path.encode()
    if len(raw) >= SPILL_DIR_SIZE:
        raise ValueError(f"spill directory path longer than {SPILL_DIR_SIZE - 1} bytes: {path!r}")
    buf[SPILL_DIR_OFFSET: SPILL_DIR_OFFSET + SPILL_DIR_SIZE] = raw.ljust(SPILL_DIR_SIZE, b"\0")


def disk_reserved(buf) -> int:
    return _U64.unpack_from(buf, ALLOC_OFFSET)[0]


def set_disk_reserved(buf, value: int) -> None:
    _U64.pack_into(buf, ALLOC_OFFSET, value)


class Request(NamedTuple):
    kind: int
    seq: int
    idx: int
    gen: int
    level: int
    status: int
    error: int
    nbytes: int
    message: str


def unpack_request(buf, coff: int) -> Request:
    f = list(REQUEST.unpack_from(buf, coff + REQUEST_OFFSET))
    f[8] = f[8].rstrip(b"\0").decode(errors="replace")
    return Request._make(f)


def pack_request(buf, coff: int, r: Request) -> None:
    REQUEST.pack_into(buf, coff + REQUEST_OFFSET, r.kind, r.seq, r.idx, r.gen, r.level, r.status, r.error,
                      r.nbytes, r.message.encode()[:120])


def unpack_transfer_stats(buf) -> tuple[int, int, int, int]:
    """(transfers, bytes received, bytes sent, deduplicated requests) of this node."""
    return TRANSFER_STATS.unpack_from(buf, TRANSFER_STATS_OFFSET)


def add_transfer_stats(buf, transfers: int = 0, received: int = 0, sent: int = 0, dedup: int = 0) -> None:
    t = TRANSFER_STATS.unpack_from(buf, TRANSFER_STATS_OFFSET)
    TRANSFER_STATS.pack_into(buf, TRANSFER_STATS_OFFSET, t[0] + transfers, t[1] + received, t[2] + sent, t[3] + dedup)


class Migration(NamedTuple):
    state: int
    session: int
    keylen: int
    pid: int
    start: int
    time: float
    error: str
    key: bytes


def unpack_migration(buf, layout: "Layout", slot: int) -> Migration:
    f = list(MIGRATION.unpack_from(buf, layout.migrations + slot * MIGRATION_SIZE))
    f[6] = f[6].rstrip(b"\0").decode(errors="replace")
    f[7] = f[7][: f[2]]
    return Migration._make(f)


def pack_migration(buf, layout: "Layout", slot: int, m: Migration) -> None:
    MIGRATION.pack_into(buf, layout.migrations + slot * MIGRATION_SIZE, m.state, m.session, len(m.key), m.pid,
                        m.start, m.time, m.error.encode()[:128], m.key)


def migration_states(buf, layout: "Layout") -> bytes:
    """The state of every migration slot, one byte each (the low byte of its ``state``)."""
    start = layout.migrations
    return bytes(buf[start: start + NMIGRATIONS * MIGRATION_SIZE: MIGRATION_SIZE])


def entry_array_bytes(buf, eoff: int) -> bytes:
    """The ENTRY_ARRAY bytes of an entry, as stored (to copy an ndarray entry elsewhere)."""
    return bytes(buf[eoff + ENTRY_ARRAY_OFFSET: eoff + ENTRY_ARRAY_OFFSET + ENTRY_ARRAY.size])


def header_state(buf) -> int:
    return _U32.unpack_from(buf, _H_STATE)[0]


def set_header_state(buf, state: int) -> None:
    _U32.pack_into(buf, _H_STATE, state)


def header_flags(buf) -> int:
    return _U32.unpack_from(buf, _H_FLAGS)[0]


def spill_pid(buf) -> int:
    return _I32.unpack_from(buf, _H_SPILL_PID)[0]


def set_spill_pid(buf, pid: int) -> None:
    _I32.pack_into(buf, _H_SPILL_PID, pid)


# ---- allocator state --------------------------------------------------------

def retired_chunks(buf) -> int:
    return _U64.unpack_from(buf, ALLOC_OFFSET + 24)[0]


def set_retired_chunks(buf, value: int) -> None:
    _U64.pack_into(buf, ALLOC_OFFSET + 24, value)


def frontier(buf) -> int:
    return _U64.unpack_from(buf, ALLOC_OFFSET + 32)[0]


def set_frontier(buf, value: int) -> None:
    _U64.pack_into(buf, ALLOC_OFFSET + 32, value)


_CURSOR = struct.Struct("<Ii")


def entry_cursor(buf) -> tuple[int, int]:
    """(first never-used entry, head of the free entry list)."""
    return _CURSOR.unpack_from(buf, ALLOC_OFFSET + 40)


def set_entry_cursor(buf, next_unused: int, free_head: int) -> None:
    _CURSOR.pack_into(buf, ALLOC_OFFSET + 40, next_unused, free_head)


def extent_cursor(buf) -> tuple[int, int]:
    """(first never-used extent record, head of the free record list)."""
    return _CURSOR.unpack_from(buf, ALLOC_OFFSET + 48)


def set_extent_cursor(buf, next_unused: int, free_head: int) -> None:
    _CURSOR.pack_into(buf, ALLOC_OFFSET + 48, next_unused, free_head)


_STATS_OBJECTS = 24  # offset of the object count in a STRIPE_STATS record


def add_stripe_stats(buf, soff: int, level: int, nbytes: int, objects: int) -> None:
    """Add to one stripe's used bytes on ``level`` and object count (stripe lock held).

    Two single-field stores: a struct with pad bytes would write zeros over
    the other levels' counters (``pack_into`` writes pads too).
    """
    uoff, coff = soff + 8 * level, soff + _STATS_OBJECTS
    _I64.pack_into(buf, uoff, _I64.unpack_from(buf, uoff)[0] + nbytes)
    _I64.pack_into(buf, coff, _I64.unpack_from(buf, coff)[0] + objects)


def add_stripe_deleted(buf, soff: int, n: int) -> None:
    """Count entries of a stripe that are deleted but still pinned."""
    _I64.pack_into(buf, soff + 32, _I64.unpack_from(buf, soff + 32)[0] + n)


def stats_table(buf, layout: "Layout") -> np.ndarray:
    return np.ndarray((layout.nstripes,), STATS_DTYPE, buffer=buf, offset=layout.stats)


def extent_table(buf, layout: "Layout") -> np.ndarray:
    return np.ndarray((layout.nextents,), EXTENT_DTYPE, buffer=buf, offset=layout.extents)


def bin_mask(buf) -> int:
    return _U64.unpack_from(buf, ALLOC_OFFSET + 56)[0]


def set_bin_mask(buf, mask: int) -> None:
    _U64.pack_into(buf, ALLOC_OFFSET + 56, mask)


def bin_head(buf, k: int) -> int:
    return _I32.unpack_from(buf, BINS_OFFSET + 4 * k)[0]


def set_bin_head(buf, k: int, rec: int) -> None:
    _I32.pack_into(buf, BINS_OFFSET + 4 * k, rec)


def clear_bins(buf) -> None:
    BINS.pack_into(buf, BINS_OFFSET, *([0] * NBINS))


# ---- entries ----------------------------------------------------------------

class EntryHead(NamedTuple):
    offset: int
    size: int
    nbytes: int
    atime: float
    ctime: float
    hash: int
    next: int
    gen: int
    pins: int
    writer: int
    extent: int
    nblobs: int
    keylen: int
    session: int
    state: int
    kind: int
    level: int
    flags: int


def unpack_entry(buf, eoff: int) -> EntryHead:
    return EntryHead._make(ENTRY_HEAD.unpack_from(buf, eoff))


def pack_entry(buf, eoff: int, e: EntryHead) -> None:
    ENTRY_HEAD.pack_into(buf, eoff, *e)


# indices into the raw ENTRY_HEAD tuple
(E_OFFSET, E_SIZE, E_NBYTES, E_ATIME, E_CTIME, E_HASH, E_NEXT, E_GEN, E_PINS, E_WRITER, E_EXTENT, E_NBLOBS,
 E_KEYLEN, E_SESSION, E_STATE, E_KIND, E_LEVEL, E_FLAGS) = range(18)
entry_raw = ENTRY_HEAD.unpack_from


def fast_path_layout() -> tuple[int, ...]:
    """What the optional C fast path (_fast.c) needs to know: ENTRY size; hash, next,
    key length, session, state and key offsets; SEALED, WRITING; the ENTRY_ARRAY
    offset; the object count's offset in a STRIPE_STATS record; the offset, nbytes,
    atime, generation, kind and level offsets; MAX_KEY; DELETED; the writer offset;
    RESERVED."""
    return (ENTRY_SIZE, _E_HASH, _E_NEXT, 68, 70, _E_STATE, ENTRY_KEY_OFFSET, SEALED, WRITING,
            ENTRY_ARRAY_OFFSET, _STATS_OBJECTS, 0, 16, _E_ATIME, _E_GEN, 73, 74, MAX_KEY, DELETED, _E_WRITER,
            RESERVED)


def entry_state_offset(eoff: int) -> int:
    """Offset of an entry's state byte (for the C fast path's seal)."""
    return eoff + _E_STATE


def find_entry(buf, layout: Layout, b: int, h: int, session: int, key: bytes) -> tuple[int, int, tuple | None]:
    """Walk bucket ``b``'s chain for ``key``: (index, entry offset, raw ENTRY_HEAD tuple) or (-1, 0, None)."""
    rec = _I32.unpack_from(buf, layout.buckets + 4 * b)[0]
    base, klen = layout.entries, len(key)
    unpack = ENTRY_HEAD.unpack_from
    while rec:
        eoff = base + (rec - 1) * ENTRY_SIZE
        e = unpack(buf, eoff)
        if e[5] == h and e[12] == klen and e[13] == session and buf[eoff + ENTRY_KEY_OFFSET: eoff + ENTRY_KEY_OFFSET + klen] == key:
            return rec - 1, eoff, e
        rec = e[6]
    return -1, 0, None


def entry_key(buf, eoff: int, keylen: int) -> bytes:
    return bytes(buf[eoff + ENTRY_KEY_OFFSET: eoff + ENTRY_KEY_OFFSET + keylen])


def set_entry_key(buf, eoff: int, key: bytes) -> None:
    buf[eoff + ENTRY_KEY_OFFSET: eoff + ENTRY_KEY_OFFSET + len(key)] = key


def bucket_head(buf, boff: int) -> int:
    return _I32.unpack_from(buf, boff)[0]


def set_bucket_head(buf, boff: int, rec: int) -> None:
    _I32.pack_into(buf, boff, rec)


def entry_next(buf, eoff: int) -> int:
    return _I32.unpack_from(buf, eoff + _E_NEXT)[0]


def set_entry_next(buf, eoff: int, nxt: int) -> None:
    _I32.pack_into(buf, eoff + _E_NEXT, nxt)


def entry_state(buf, eoff: int) -> int:
    return buf[eoff + _E_STATE]


def set_entry_state(buf, eoff: int, state: int) -> None:
    buf[eoff + _E_STATE] = state


def entry_flags(buf, eoff: int) -> int:
    return buf[eoff + _E_FLAGS]


def set_entry_flags(buf, eoff: int, flags: int) -> None:
    buf[eoff + _E_FLAGS] = flags


def entry_gen(buf, eoff: int) -> int:
    return _U32.unpack_from(buf, eoff + _E_GEN)[0]


def set_entry_gen(buf, eoff: int, gen: int) -> None:
    _U32.pack_into(buf, eoff + _E_GEN, gen)


def entry_extent(buf, eoff: int) -> int:
    return _I32.unpack_from(buf, eoff + _E_EXTENT)[0]


def entry_hash(buf, eoff: int) -> int:
    return _U32.unpack_from(buf, eoff + _E_HASH)[0]


def set_entry_extent(buf, eoff: int, rec: int) -> None:
    _I32.pack_into(buf, eoff + _E_EXTENT, rec)


def set_entry_atime(buf, eoff: int, atime: float) -> None:
    _F64.pack_into(buf, eoff + _E_ATIME, atime)


def reserve_entry(buf, eoff: int, slot: int) -> None:
    """Mark a free entry as held in client ``slot``'s batch."""
    _I32.pack_into(buf, eoff + _E_WRITER, slot)
    buf[eoff + _E_STATE] = RESERVED


_ARRAY_META: dict[tuple, bytes] = {}


def array_meta(dtype: str, shape: tuple[int, ...], order: str) -> bytes:
    """ENTRY_ARRAY bytes for an ndarray (cached: the same shapes come back)."""
    k = (dtype, shape, order)
    meta = _ARRAY_META.get(k)
    if meta is None:
        dims = list(shape) + [0] * (MAX_NDIM - len(shape))
        meta = ENTRY_ARRAY.pack(dtype.encode(), len(shape), 1 if order == "F" else 0, *dims)
        if len(_ARRAY_META) < 4096:
            _ARRAY_META[k] = meta
    return meta


def set_entry_array(buf, eoff: int, meta: bytes) -> None:
    buf[eoff + ENTRY_ARRAY_OFFSET: eoff + ENTRY_ARRAY_OFFSET + len(meta)] = meta


def entry_array_raw(buf, eoff: int) -> tuple:
    """ENTRY_ARRAY fields as stored: (dtype bytes, ndim, order flag, 8 dims)."""
    return ENTRY_ARRAY.unpack_from(buf, eoff + ENTRY_ARRAY_OFFSET)


def entry_table(buf, layout: Layout) -> np.ndarray:
    """Structured numpy view of the whole entry table (no copy)."""
    return np.ndarray((layout.max_objects,), ENTRY_DTYPE, buffer=buf, offset=layout.entries)


# ---- extents ----------------------------------------------------------------

# hot-path accessors: plain tuples in EXTENT field order, single-field stores
extent_raw = EXTENT.unpack_from
extent_write = EXTENT.pack_into


def set_extent_prev_phys(buf, xoff: int, rec: int) -> None:
    _I32.pack_into(buf, xoff + 16, rec)


def set_extent_next_phys(buf, xoff: int, rec: int) -> None:
    _I32.pack_into(buf, xoff + 20, rec)


def set_extent_prev_free(buf, xoff: int, rec: int) -> None:
    _I32.pack_into(buf, xoff + 24, rec)


def set_extent_next_free(buf, xoff: int, rec: int) -> None:
    _I32.pack_into(buf, xoff + 28, rec)


# ---- clients and sessions ---------------------------------------------------

def unpack_client(buf, coff: int) -> tuple[int, int, int, float]:
    """(pid, state, start time, attach time)."""
    return CLIENT.unpack_from(buf, coff)


def pack_client(buf, coff: int, pid: int, state: int, start: int, attached: float) -> None:
    CLIENT.pack_into(buf, coff, pid, state, start, attached)
    CLIENT_CHUNK.pack_into(buf, coff + CLIENT_CHUNK_OFFSET, 0, 0, 0)


def client_chunk(buf, coff: int) -> tuple[int, int, int]:
    """(extent record, offset, size) of a client's current chunk."""
    return CLIENT_CHUNK.unpack_from(buf, coff + CLIENT_CHUNK_OFFSET)


def set_client_chunk(buf, coff: int, rec: int, offset: int, size: int) -> None:
    CLIENT_CHUNK.pack_into(buf, coff + CLIENT_CHUNK_OFFSET, rec, offset, size)


def client_table(buf, layout: Layout) -> np.ndarray:
    return np.ndarray((layout.max_clients,), CLIENT_DTYPE, buffer=buf, offset=layout.clients)


def unpack_session(buf, soff: int) -> str | None:
    n, raw = SESSION.unpack_from(buf, soff)
    return raw[:n - 1].decode() if n else None  # n = len + 1, so 0 means unused


def pack_session(buf, soff: int, name: str) -> None:
    raw = name.encode()
    SESSION.pack_into(buf, soff, len(raw) + 1, raw)


# ---- pins ---------------------------------------------------------------------

def pin_row(buf, layout: Layout, slot: int) -> memoryview:
    """Client ``slot``'s pin bytes, indexable by entry (release() it when done)."""
    start = layout.pinbyte(slot, 0)
    return memoryview(buf)[start: start + layout.max_objects]


def pin_table(buf, layout: Layout) -> np.ndarray:
    """(max_clients, max_objects) uint8 view of every client's pin bytes."""
    return np.ndarray((layout.max_clients, layout.max_objects), np.uint8, buffer=buf, offset=layout.pinmaps,
                      strides=(layout.pinrow, 1))


# ---- pickled object header (lives in the arena) -----------------------------

def object_header_size(nblobs: int) -> int:
    return OBJECT_HEADER.size + nblobs * BLOB.size


def plan_object(pickle_len: int, blob_lens: list[int]) -> tuple[int, list[int]]:
    """Total size and blob offsets of a pickled object with these parts."""
    pos = align(object_header_size(len(blob_lens)) + pickle_len)
    offsets = []
    for n in blob_lens:
        offsets.append(pos)
        pos = align(pos + n)
    return max(pos, ALIGN), offsets


def pack_object_header(buf, off: int, pickle_len: int, blobs: list[tuple[int, int]]) -> None:
    """Write the header of a pickled object: ``blobs`` are (offset, length) in pickle order."""
    OBJECT_HEADER.pack_into(buf, off, len(blobs), 0, pickle_len)
    if blobs:
        flat = [v for b in blobs for v in b]
        struct.pack_into(f"<{len(flat)}Q", buf, off + OBJECT_HEADER.size, *flat)


def unpack_object_header(buf, off: int = 0) -> tuple[int, int, list[tuple[int, int]]]:
    """(pickle start, pickle length, [(blob offset, blob length)]) relative to ``off``."""
    nblobs, _flags, pickle_len = OBJECT_HEADER.unpack_from(buf, off)
    flat = struct.unpack_from(f"<{2 * nblobs}Q", buf, off + OBJECT_HEADER.size)
    return object_header_size(nblobs), pickle_len, list(zip(flat[0::2], flat[1::2]))
