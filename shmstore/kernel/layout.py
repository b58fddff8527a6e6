"""All binary layout of a node store: the metadata segment and object headers.

Nothing else in shmstore computes an offset into shared memory: the other
modules call the functions here, which are pure functions over a buffer
(``mmap``, ``memoryview`` or ``bytearray``) and an offset. Each record is
declared once, as a table of fields (``records.Record``); its struct, numpy
dtype, field indices and offsets (the C fast path's included) and the tables
at the end of this documentation all derive from that declaration.

Metadata segment (``/shmstore-<uid>-<name>-<node>-meta``), sections in order,
each aligned to 64 bytes (``Layout`` computes the offsets from the header)::

    offset   size                 what
    0        4096                 HEADER (identity, fixed at creation) at 0, ALLOC_STATE at
                                  256, SPILL_STATE at 1024, the spill directory's path
                                  (1024 bytes, NUL padded) at 2048, TRANSFER_STATS at 3072
    4096     MAX_SESSIONS * 64    SESSION names; id 0 is ""
    ...      nlocks * 64          process-shared robust mutexes: ADMIN, ALLOC,
                                  SPILL, then one per key stripe
    ...      max_clients * 256    CLIENT records (attached processes), each with its
                                  REQUEST to the spill process at byte 64
    ...      nstripes * 64        STRIPE_STATS: used bytes per level, object count and
                                  deleted-but-pinned count of the entries hashed to
                                  each stripe (under its lock)
    ...      nbuckets * 4         hash bucket heads (i32, 1-based entry index, 0 = none)
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

The records follow.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .records import Record

MAGIC = b"SHMSTOR\0"
LAYOUT_VERSION = 6
HEADER_SIZE = 4096
MAX_SESSIONS = 256
MAX_KEY = 255
MAX_NDIM = 8
ALIGN = 64
PAGE = 4096
NBINS = 64
MAX_GPUS = 8
GPU_BASE_SHIFT = 44  # GPU arena d starts at offset (d + 1) << 44 of the store's offset space
MIN_CHUNK = 64 << 10  # smallest chunk of the arena handed to a client for small objects

# lock indices
LOCK_ADMIN, LOCK_ALLOC, LOCK_SPILL, LOCK_FIRST_STRIPE = 0, 1, 2, 3
LOCK_STRIDE = 64

# entry states and kinds
FREE, WRITING, SEALED, DELETED, RESERVED = 0, 1, 2, 3, 4
KIND_RAW, KIND_NDARRAY, KIND_PICKLE = 0, 1, 2
FLAG_MOVING, FLAG_IN_CHUNK = 1, 2
FLAG_SHADOW = 4  # a ``writing`` entry of an overwrite: in no chain until it replaces the old one
LEVEL_GPU, LEVEL_MEMORY, LEVEL_DISK = 0, 1, 2  # Level values, for code below the Level enum
LEVEL_NAMES = ("gpu", "memory", "disk")
STATE_NAMES = {FREE: "free", WRITING: "writing", SEALED: "sealed", DELETED: "deleted", RESERVED: "reserved"}
# header states and flags
STATE_INIT, STATE_READY, STATE_DESTROYING = 0, 1, 2
FLAG_PERSIST = 1
# extent record flags
EXT_UNUSED, EXT_FREE, EXT_USED, EXT_CHUNK, EXT_RETIRED = 0, 1, 2, 3, 4
# requests to the spill process
REQ_NONE, REQ_SPACE, REQ_MOVE, REQ_GPU = 0, 1, 2, 3
RS_IDLE, RS_PENDING, RS_DONE, RS_FAILED = 0, 1, 2, 3
ERR_FULL, ERR_IO, ERR_LOCKED, ERR_MISSING = 1, 2, 3, 4
# migrations
NMIGRATIONS = 128
MIG_FREE, MIG_FLIGHT, MIG_FAILED = 0, 1, 2

# ---- the records ----------------------------------------------------------------

HEADER = Record("HEADER", 256, """
    0    magic        bytes8   b"SHMSTOR\\0"
    8    version      u32      layout version (LAYOUT_VERSION)
    12   state        u32      0 initialising, 1 ready, 2 destroying
    16   flags        u32      1 persistent
    20   uid          u32      owner
    24   creator_pid  i32      the process that created the store
    28   spill_pid    i32      its spill process (0 none)
    32   capacity     u64      bytes of the MEMORY arena
    40   meta_size    u64      bytes of this segment
    48   max_objects  u32      entries in the table
    52   max_clients  u32      client slots
    56   nstripes     u32      key stripes (each with its lock)
    60   nbuckets     u32      hash buckets
    64   created      f64      creation time (time.time())
    72   name         bytes64  store name (NUL padded)
    136  node         bytes64  node id (NUL padded)
""")
ALLOC_OFFSET = 256
ALLOC_STATE = Record("ALLOC_STATE", 768, """
    0    disk_reserved    u64      bytes charged to the DISK level (its quota counter)
    24   retired          u64      retired chunks not yet reclaimed
    32   frontier         u64      end of the highest extent ever cut from the front
    40   entries_unused   u32      entries never used yet start here (0-based)
    44   entries_free     i32      head of the free entry list (1-based, 0 none)
    48   extents_unused   u32      extent records never used yet start here (0-based)
    52   extents_free     i32      head of the free extent-record list (1-based)
    56   bin_mask         u64      bitmap of non-empty allocator bins
    64   bins             i32[64]  free extents with size in [2**k, 2**(k+1)), per k
    320  slots_high       u32      client slots ever taken (slots go lowest first): pins are scanned
                                   up to here only (set under the ADMIN lock before the slot is used)
""")
SPILL_OFFSET = 1024
SPILL_STATE = Record("SPILL_STATE", 1024, """
    0    high           f64  high watermark (fraction of the MEMORY capacity), fixed at creation
    8    low            f64  low watermark, fixed at creation
    16   disk_capacity  u64  DISK capacity in bytes
    24   spilled        u64  bytes spilled to DISK so far
    32   restored       u64  bytes restored to MEMORY so far
    40   moving         i32  entry being moved (1-based, 0 none)
    44   moving_to      i32  level it is moving to
    48   progress       u64  bytes of that move done
    56   total          u64  bytes of that move in all
    64   failures       u64  failed moves so far
    72   heartbeat      f64  last time the spill process went round its loop
    80   gpu_capacity   u64  bytes of each GPU arena, fixed at creation (0: half the device's free memory
                             when the arena is made)
""")
SPILL_DIR_OFFSET, SPILL_DIR_SIZE = 2048, 1024
TRANSFER_STATS_OFFSET = 3072
TRANSFER_STATS = Record("TRANSFER_STATS", 32, """
    0    transfers  u64  transfers into this node
    8    received   u64  bytes received
    16   sent       u64  bytes sent
    24   dedup      u64  requests that joined a transfer already in flight
""")
GPU_ARENA = Record("GPU_ARENA", 512, """
    0    state     u32       0 none, 1 asked for (the spill process creates it), 2 ready, 3 failed
                             (see message), 4 lost (its owner died: its objects went)
    4    device    i32       CUDA device ordinal
    8    base      u64       offset of the arena in the store's offset space ((d + 1) << 44)
    16   capacity  u64       bytes
    24   owner     i32       pid of the process holding the device allocation (the spill process)
    28   epoch     u32       bumped whenever the arena is made again (clients reopen the handle)
    32   bin_mask  u64       bitmap of non-empty allocator bins of this arena
    40   bins      i32[64]   free extents of this arena, per size class (as ALLOC_STATE's)
    296  handle    bytes64   the allocation's cudaIpcMemHandle_t
    360  message   bytes120  why creating it failed (UTF-8)
""")
GPU_NONE, GPU_ASKED, GPU_READY, GPU_FAILED, GPU_LOST = 0, 1, 2, 3, 4
SESSION = Record("SESSION", 64, """
    0    length  u8       length of the name + 1 (0: slot unused)
    1    name    bytes63  session name (UTF-8)
""")
CLIENT = Record("CLIENT", 256, """
    0    pid           i32  pid of the attached process
    4    state         i32  0 free, 1 attached
    8    start         u64  its start time (/proc/<pid>/stat field 22: tells a reused pid apart)
    16   attached      f64  attach time
    24   chunk         i32  extent record of its current chunk (0 none)
    32   chunk_offset  u64  arena offset of that chunk
    40   chunk_size    u64  its size
""")
REQUEST_OFFSET = 64  # within a CLIENT record
REQUEST = Record("REQUEST", 160, """
    0    kind     u32       0 none, 1 make room (bytes on a level), 2 move an entry to a level, 3 make
                            the GPU arena of device ``idx``
    4    seq      u32       sequence number (bumped by the client on every request)
    8    idx      i32       entry index
    12   gen      u32       entry generation
    16   level    u32       the level to make room on, or to move to
    20   status   u32       0 idle, 1 pending, 2 done, 3 failed
    24   error    u32       when failed: 1 full, 2 I/O, 3 locked, 4 not found
    32   nbytes   u64       bytes
    40   message  bytes120  error message (UTF-8)
""")
STRIPE_STATS = Record("STRIPE_STATS", 64, """
    0    used     i64[3]  bytes of the stripe's objects per level (GPU, MEMORY, DISK)
    24   objects  i64     live entries (writing, sealed, deleted)
    32   deleted  i64     deleted entries still pinned
""")
ENTRY_HEAD = Record("ENTRY_HEAD", 80, """
    0    offset   u64  offset of the data in its level (arena offset for MEMORY and GPU, 0 for DISK)
    8    size     u64  stored size in bytes (the same on every level)
    16   nbytes   u64  logical size (what ObjectInfo.size reports)
    24   atime    f64  last access (CLOCK_MONOTONIC, comparable across processes)
    32   ctime    f64  creation time
    40   hash     u32  crc32 of (session, key)
    44   next     i32  next entry in the bucket chain (1-based, 0 end)
    48   gen      u32  generation (bumped whenever the entry is freed or changes hands)
    52   target_extent  i32  during a move onto an arena level, the extent placed there for
                       it (written under the ALLOC lock, like ``extent``); 0 otherwise
    56   writer   i32  client slot of the writer while writing (of the batch while reserved)
    60   extent   i32  extent record of the data (1-based, 0 none) on an arena level (MEMORY, GPU);
                       while reserved, that placed for a put in flight (written under the
                       ALLOC lock: extent and owner name each other)
    64   nblobs   u32  number of blobs
    68   keylen   u16  key length in bytes
    70   session  u16  session id
    72   state    u8   0 free, 1 writing, 2 sealed (only while linked), 3 deleted (hidden; freed by
                       its last pin), 4 reserved (in client writer's batch)
    73   kind     u8   0 raw bytes, 1 ndarray, 2 pickle5
    74   level    u8   level (Level value)
    75   flags    u8   1 being moved, 2 carved from a chunk (extent is the chunk), 4 an overwrite
                       being written (in no chain until it replaces the old object)
    76   target   u8   during a move (flag 1), the level it is moving to
""")
ENTRY_ARRAY_OFFSET = 80
ENTRY_ARRAY = Record("ENTRY_ARRAY", 88, """
    0    dtype  bytes16  ndarray dtype.str
    16   ndim   u8       ndarray ndim (<= 8)
    17   order  u8       0 C, 1 F
    24   shape  i64[8]   ndarray shape
""")
ENTRY_KEY_OFFSET = 168
ENTRY_SIZE = 448
EXTENT = Record("EXTENT", 40, """
    0    offset     u64  arena offset
    8    size       u64  bytes
    16   prev_phys  i32  physical predecessor (1-based, 0 none)
    20   next_phys  i32  physical successor
    24   prev_free  i32  previous in its free bin list
    28   next_free  i32  next in its free bin list (the record free list's link too)
    32   flags      i32  0 record unused, 1 free, 2 one object, 3 a client's current chunk, 4 a retired chunk
    36   owner      i32  owning entry (1-based) while used; -(slot+1) for a chunk
""")
MIGRATION_SIZE = 416
MIGRATION = Record("MIGRATION", MIGRATION_SIZE, """
    0    state    u32       0 free, 1 in flight, 2 failed
    4    session  u16       session id of the key
    6    keylen   u16       key length
    8    pid      i32       the transferring process
    16   start    u64       its start time (/proc ticks)
    24   time     f64       when the entry last changed
    32   error    bytes128  why it failed
    160  key      bytes256  the key
""")
OBJECT_HEADER = Record("OBJECT_HEADER", 16, """
    0    nblobs      u32  out-of-band buffers (blobs) of the pickled object
    4    flags       u32  reserved
    8    pickle_len  u64  bytes of the pickle stream, after the BLOB records
""")
BLOB = Record("BLOB", 16, """
    0    offset  u64  from the start of the object (64-byte aligned)
    8    length  u64  bytes
""")
RECORDS = (HEADER, ALLOC_STATE, SPILL_STATE, TRANSFER_STATS, SESSION, CLIENT, REQUEST, STRIPE_STATS, ENTRY_HEAD,
           ENTRY_ARRAY, EXTENT, MIGRATION, OBJECT_HEADER, BLOB)
__doc__ += "\n" + "\n\n".join(r.doc() for r in RECORDS) + "\n"  # noqa: A001 - the tables derive from the records

SESSION_SIZE, CLIENT_SIZE, STRIPE_STATS_SIZE = SESSION.size, CLIENT.size, STRIPE_STATS.size

# numpy views, for vectorised scans (list, janitor, spill policy, checks)
ENTRY_DTYPE = ENTRY_HEAD.table_dtype(ENTRY_SIZE)
CLIENT_DTYPE = CLIENT.table_dtype(CLIENT.size, (REQUEST_OFFSET, REQUEST, "req_", ("kind", "status")))
STATS_DTYPE = STRIPE_STATS.dtype
EXTENT_DTYPE = EXTENT.dtype

# positions in a raw ENTRY_HEAD tuple (entry_raw), for the hot paths
(E_OFFSET, E_SIZE, E_NBYTES, E_ATIME, E_CTIME, E_HASH, E_NEXT, E_GEN, E_TARGET_EXTENT, E_WRITER, E_EXTENT,
 E_NBLOBS, E_KEYLEN, E_SESSION, E_STATE, E_KIND, E_LEVEL, E_FLAGS, E_TARGET) = ENTRY_HEAD.indices(
    "offset", "size", "nbytes", "atime", "ctime", "hash", "next", "gen", "target_extent", "writer", "extent",
    "nblobs", "keylen", "session", "state", "kind", "level", "flags", "target")
entry_raw = ENTRY_HEAD.struct.unpack_from
_E = ENTRY_HEAD.offset
_E_ATIME, _E_NEXT, _E_GEN, _E_WRITER, _E_EXTENT = _E["atime"], _E["next"], _E["gen"], _E["writer"], _E["extent"]
_E_HASH, _E_STATE, _E_FLAGS = _E["hash"], _E["state"], _E["flags"]
_E_TARGET_EXTENT, _E_TARGET = _E["target_extent"], _E["target"]

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_CURSOR = struct.Struct("<Ii")


def _put(buf: Any, off: int, st: struct.Struct, *values: Any) -> None:
    """Store ``values`` packed by ``st`` at ``off``: a memcpy of packed bytes, never ``pack_into``,
    whose zero fill shows readers in other processes zeros (see records.py)."""
    buf[off: off + st.size] = st.pack(*values)
_BINS_OFFSET = ALLOC_OFFSET + ALLOC_STATE.offset["bins"]


def align(n: int) -> int:
    """Round ``n`` up to the arena alignment (64 bytes)."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def page_align(n: int) -> int:
    """Round ``n`` up to a page."""
    return (n + PAGE - 1) & ~(PAGE - 1)


Header = HEADER.tuple


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
        self.entries = align(self.buckets + self.nbuckets * 4)
        self.extents = align(self.entries + max_objects * ENTRY_SIZE)
        self.pinmaps = align(self.extents + self.nextents * EXTENT.size)
        self.migrations = align(self.pinmaps + max_clients * self.pinrow)
        self.gpus = align(self.migrations + NMIGRATIONS * MIGRATION.size)
        self.size = page_align(self.gpus + MAX_GPUS * GPU_ARENA.size)

    @classmethod
    def from_header(cls, h: Any) -> "Layout":
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


# ---- header -----------------------------------------------------------------

def pack_header(buf: Any, h: Any) -> None:
    HEADER.pack(buf, 0, **h._replace(name=h.name.encode(), node=h.node.encode())._asdict())


def unpack_header(buf: Any) -> Any:
    h = HEADER.unpack(buf, 0)
    return h._replace(name=h.name.rstrip(b"\0").decode(errors="replace"),
                      node=h.node.rstrip(b"\0").decode(errors="replace"))


def header_state(buf: Any) -> int:
    return HEADER.get(buf, 0, "state")


def set_header_state(buf: Any, state: int) -> None:
    HEADER.set(buf, 0, "state", state)


def header_flags(buf: Any) -> int:
    return HEADER.get(buf, 0, "flags")


def spill_pid(buf: Any) -> int:
    return HEADER.get(buf, 0, "spill_pid")


def set_spill_pid(buf: Any, pid: int) -> None:
    HEADER.set(buf, 0, "spill_pid", pid)


# ---- spill state, transfers ---------------------------------------------------

SpillState = SPILL_STATE.tuple


def unpack_spill_state(buf: Any) -> Any:
    return SPILL_STATE.unpack(buf, SPILL_OFFSET)


def pack_spill_state(buf: Any, s: Any) -> None:
    SPILL_STATE.pack(buf, SPILL_OFFSET, **s._asdict())


def spill_dir(buf: Any) -> str:
    return bytes(buf[SPILL_DIR_OFFSET: SPILL_DIR_OFFSET + SPILL_DIR_SIZE]).rstrip(b"\0").decode()


def set_spill_dir(buf: Any, path: str) -> None:
    raw = path.encode()
    if len(raw) >= SPILL_DIR_SIZE:
        raise ValueError(f"spill directory path longer than {SPILL_DIR_SIZE - 1} bytes: {path!r}")
    buf[SPILL_DIR_OFFSET: SPILL_DIR_OFFSET + SPILL_DIR_SIZE] = raw.ljust(SPILL_DIR_SIZE, b"\0")


def unpack_transfer_stats(buf: Any) -> tuple[int, int, int, int]:
    """(transfers, bytes received, bytes sent, deduplicated requests) of this node."""
    return TRANSFER_STATS.struct.unpack_from(buf, TRANSFER_STATS_OFFSET)


def add_transfer_stats(buf: Any, transfers: int = 0, received: int = 0, sent: int = 0, dedup: int = 0) -> None:
    """Add to this node's transfer counters (ADMIN lock held); on every small fetch: one struct, no records."""
    st, at = TRANSFER_STATS.struct, TRANSFER_STATS_OFFSET
    t = st.unpack_from(buf, at)
    buf[at: at + st.size] = st.pack(t[0] + transfers, t[1] + received, t[2] + sent, t[3] + dedup)


# ---- requests and migrations --------------------------------------------------

Request = REQUEST.tuple


def unpack_request(buf: Any, coff: int) -> Any:
    r = REQUEST.unpack(buf, coff + REQUEST_OFFSET)
    return r._replace(message=r.message.rstrip(b"\0").decode(errors="replace"))


def pack_request(buf: Any, coff: int, r: Any) -> None:
    REQUEST.pack(buf, coff + REQUEST_OFFSET, **r._replace(message=r.message.encode()[:120])._asdict())


Migration = MIGRATION.tuple


def unpack_migration(buf: Any, layout: Layout, slot: int) -> Any:
    m = MIGRATION.unpack(buf, layout.migration(slot))
    return m._replace(error=m.error.rstrip(b"\0").decode(errors="replace"), key=m.key[: m.keylen])


def pack_migration(buf: Any, layout: Layout, slot: int, m: Any) -> None:
    MIGRATION.pack(buf, layout.migration(slot), **m._replace(keylen=len(m.key), error=m.error.encode()[:128])._asdict())


def migration_states(buf: Any, layout: Layout) -> bytes:
    """The state of every migration slot, one byte each (the low byte of its ``state``)."""
    start = layout.migrations
    return bytes(buf[start: start + NMIGRATIONS * MIGRATION.size: MIGRATION.size])


# ---- allocator state --------------------------------------------------------

def disk_reserved(buf: Any) -> int:
    return ALLOC_STATE.get(buf, ALLOC_OFFSET, "disk_reserved")


def set_disk_reserved(buf: Any, value: int) -> None:
    ALLOC_STATE.set(buf, ALLOC_OFFSET, "disk_reserved", value)


def retired_chunks(buf: Any) -> int:
    return ALLOC_STATE.get(buf, ALLOC_OFFSET, "retired")


def set_retired_chunks(buf: Any, value: int) -> None:
    ALLOC_STATE.set(buf, ALLOC_OFFSET, "retired", value)


def frontier(buf: Any) -> int:
    return ALLOC_STATE.get(buf, ALLOC_OFFSET, "frontier")


def set_frontier(buf: Any, value: int) -> None:
    ALLOC_STATE.set(buf, ALLOC_OFFSET, "frontier", value)


_ENTRY_CURSOR = ALLOC_OFFSET + ALLOC_STATE.offset["entries_unused"]
_EXTENT_CURSOR = ALLOC_OFFSET + ALLOC_STATE.offset["extents_unused"]


def entry_cursor(buf: Any) -> tuple[int, int]:
    """(first never-used entry, head of the free entry list)."""
    return _CURSOR.unpack_from(buf, _ENTRY_CURSOR)


def set_entry_cursor(buf: Any, next_unused: int, free_head: int) -> None:
    _put(buf, _ENTRY_CURSOR, _CURSOR, next_unused, free_head)


def extent_cursor(buf: Any) -> tuple[int, int]:
    """(first never-used extent record, head of the free record list)."""
    return _CURSOR.unpack_from(buf, _EXTENT_CURSOR)


def set_extent_cursor(buf: Any, next_unused: int, free_head: int) -> None:
    _put(buf, _EXTENT_CURSOR, _CURSOR, next_unused, free_head)


def bin_mask(buf: Any) -> int:
    return ALLOC_STATE.get(buf, ALLOC_OFFSET, "bin_mask")


def set_bin_mask(buf: Any, mask: int) -> None:
    ALLOC_STATE.set(buf, ALLOC_OFFSET, "bin_mask", mask)


def bin_head(buf: Any, k: int) -> int:
    return _I32.unpack_from(buf, _BINS_OFFSET + 4 * k)[0]


def set_bin_head(buf: Any, k: int, rec: int) -> None:
    _put(buf, _BINS_OFFSET + 4 * k, _I32, rec)


def clear_bins(buf: Any) -> None:
    buf[_BINS_OFFSET: _BINS_OFFSET + 4 * NBINS] = bytes(4 * NBINS)


def bins_offsets(layout: "Layout", gpu: int = -1) -> tuple[int, int]:
    """(offset of the bins, offset of the bin mask) of the MEMORY arena, or of GPU arena ``gpu``."""
    if gpu < 0:
        return _BINS_OFFSET, ALLOC_OFFSET + ALLOC_STATE.offset["bin_mask"]
    at = layout.gpu(gpu)
    return at + GPU_ARENA.offset["bins"], at + GPU_ARENA.offset["bin_mask"]


def unpack_gpu(buf: Any, layout: "Layout", d: int) -> Any:
    return GPU_ARENA.unpack(buf, layout.gpu(d))


def set_gpu(buf: Any, layout: "Layout", d: int, **fields: Any) -> None:
    """Set fields of GPU arena ``d``'s record, one store each (``state`` last: it publishes)."""
    state = fields.pop("state", None)
    for name, value in fields.items():
        GPU_ARENA.set(buf, layout.gpu(d), name, value)
    if state is not None:
        GPU_ARENA.set(buf, layout.gpu(d), "state", state)


def gpu_base(d: int) -> int:
    return (d + 1) << GPU_BASE_SHIFT


# ---- stripe usage -------------------------------------------------------------

_STATS_OBJECTS, _STATS_DELETED = STRIPE_STATS.offset["objects"], STRIPE_STATS.offset["deleted"]


def add_stripe_stats(buf: Any, soff: int, level: int, nbytes: int, objects: int) -> None:
    """Add to one stripe's used bytes on ``level`` and object count (stripe lock held).

    Two single-field stores: a struct with pad bytes would write zeros over
    the other levels' counters (packing writes pads too).
    """
    uoff, coff = soff + 8 * level, soff + _STATS_OBJECTS
    _put(buf, uoff, _I64, _I64.unpack_from(buf, uoff)[0] + nbytes)
    _put(buf, coff, _I64, _I64.unpack_from(buf, coff)[0] + objects)


def add_stripe_deleted(buf: Any, soff: int, n: int) -> None:
    """Count entries of a stripe that are deleted but still pinned."""
    _put(buf, soff + _STATS_DELETED, _I64, _I64.unpack_from(buf, soff + _STATS_DELETED)[0] + n)


def stats_table(buf: Any, layout: Layout) -> np.ndarray:
    return np.ndarray((layout.nstripes,), STATS_DTYPE, buffer=buf, offset=layout.stats)


# ---- entries ----------------------------------------------------------------

EntryHead = ENTRY_HEAD.tuple


def unpack_entry(buf: Any, eoff: int) -> Any:
    return ENTRY_HEAD.unpack(buf, eoff)


def pack_entry(buf: Any, eoff: int, e: Any) -> None:
    """Write a whole entry head from an ``EntryHead`` (or any tuple in its field order)."""
    _put(buf, eoff, ENTRY_HEAD.struct, *e)


def fast_path_layout() -> dict[str, int]:
    """What the optional C fast path (_fast.c) needs to know, by name (see ``_fast.configure``)."""
    e = ENTRY_HEAD.offset
    return {"entry_size": ENTRY_SIZE, "array_off": ENTRY_ARRAY_OFFSET, "key_off": ENTRY_KEY_OFFSET,
            "max_key": MAX_KEY, "stats_objects_off": _STATS_OBJECTS,
            "sealed": SEALED, "writing": WRITING, "deleted": DELETED, "reserved": RESERVED,
            **{f"{name}_off": e[name] for name in ("offset", "size", "nbytes", "atime", "ctime", "hash", "next",
                                                    "gen", "writer", "extent", "nblobs", "keylen", "session",
                                                    "state", "kind", "level", "flags")}}


def entry_state_offset(eoff: int) -> int:
    """Offset of an entry's state byte (for the C fast path's seal)."""
    return eoff + _E_STATE


def find_entry(buf: Any, layout: Layout, b: int, h: int, session: int,
               key: bytes) -> tuple[int, int, tuple[Any, ...] | None]:
    """Walk bucket ``b``'s chain for ``key``: (index, entry offset, raw ENTRY_HEAD tuple) or (-1, 0, None)."""
    rec = _I32.unpack_from(buf, layout.buckets + 4 * b)[0]
    base, klen = layout.entries, len(key)
    unpack = entry_raw
    while rec:
        eoff = base + (rec - 1) * ENTRY_SIZE
        e = unpack(buf, eoff)
        if e[E_HASH] == h and e[E_KEYLEN] == klen and e[E_SESSION] == session \
                and buf[eoff + ENTRY_KEY_OFFSET: eoff + ENTRY_KEY_OFFSET + klen] == key:
            return rec - 1, eoff, e
        rec = e[E_NEXT]
    return -1, 0, None


def entry_key(buf: Any, eoff: int, keylen: int) -> bytes:
    return bytes(buf[eoff + ENTRY_KEY_OFFSET: eoff + ENTRY_KEY_OFFSET + keylen])


def set_entry_key(buf: Any, eoff: int, key: bytes) -> None:
    buf[eoff + ENTRY_KEY_OFFSET: eoff + ENTRY_KEY_OFFSET + len(key)] = key


def bucket_head(buf: Any, boff: int) -> int:
    return _I32.unpack_from(buf, boff)[0]


def set_bucket_head(buf: Any, boff: int, rec: int) -> None:
    _put(buf, boff, _I32, rec)


def entry_next(buf: Any, eoff: int) -> int:
    return _I32.unpack_from(buf, eoff + _E_NEXT)[0]


def set_entry_next(buf: Any, eoff: int, nxt: int) -> None:
    _put(buf, eoff + _E_NEXT, _I32, nxt)


def entry_state(buf: Any, eoff: int) -> int:
    return buf[eoff + _E_STATE]


def set_entry_state(buf: Any, eoff: int, state: int) -> None:
    buf[eoff + _E_STATE] = state


def entry_flags(buf: Any, eoff: int) -> int:
    return buf[eoff + _E_FLAGS]


def set_entry_flags(buf: Any, eoff: int, flags: int) -> None:
    buf[eoff + _E_FLAGS] = flags


def entry_gen(buf: Any, eoff: int) -> int:
    return _U32.unpack_from(buf, eoff + _E_GEN)[0]


def set_entry_gen(buf: Any, eoff: int, gen: int) -> None:
    _put(buf, eoff + _E_GEN, _U32, gen)


def entry_extent(buf: Any, eoff: int) -> int:
    return _I32.unpack_from(buf, eoff + _E_EXTENT)[0]


def entry_hash(buf: Any, eoff: int) -> int:
    return _U32.unpack_from(buf, eoff + _E_HASH)[0]


def set_entry_extent(buf: Any, eoff: int, rec: int) -> None:
    _put(buf, eoff + _E_EXTENT, _I32, rec)


def entry_target_extent(buf: Any, eoff: int) -> int:
    return _I32.unpack_from(buf, eoff + _E_TARGET_EXTENT)[0]


def set_entry_target_extent(buf: Any, eoff: int, rec: int) -> None:
    _put(buf, eoff + _E_TARGET_EXTENT, _I32, rec)


def set_entry_target(buf: Any, eoff: int, level: int) -> None:
    buf[eoff + _E_TARGET] = level


def set_entry_atime(buf: Any, eoff: int, atime: float) -> None:
    _put(buf, eoff + _E_ATIME, _F64, atime)


def reserve_entry(buf: Any, eoff: int, slot: int) -> None:
    """Mark a free entry as held in client ``slot``'s batch."""
    _put(buf, eoff + _E_WRITER, _I32, slot)
    buf[eoff + _E_STATE] = RESERVED


_ARRAY_META: dict[tuple[Any, ...], bytes] = {}


def array_meta(dtype: str, shape: tuple[int, ...], order: str) -> bytes:
    """ENTRY_ARRAY bytes for an ndarray (cached: the same shapes come back)."""
    k = (dtype, shape, order)
    meta = _ARRAY_META.get(k)
    if meta is None:
        dims = list(shape) + [0] * (MAX_NDIM - len(shape))
        meta = ENTRY_ARRAY.struct.pack(*ENTRY_ARRAY.flat({"dtype": dtype.encode(), "ndim": len(shape),
                                                          "order": 1 if order == "F" else 0, "shape": dims}))
        if len(_ARRAY_META) < 4096:
            _ARRAY_META[k] = meta
    return meta


def set_entry_array(buf: Any, eoff: int, meta: bytes) -> None:
    buf[eoff + ENTRY_ARRAY_OFFSET: eoff + ENTRY_ARRAY_OFFSET + len(meta)] = meta


def entry_array_raw(buf: Any, eoff: int) -> tuple[Any, ...]:
    """ENTRY_ARRAY fields as stored: (dtype bytes, ndim, order flag, 8 dims)."""
    return ENTRY_ARRAY.struct.unpack_from(buf, eoff + ENTRY_ARRAY_OFFSET)


def entry_array_bytes(buf: Any, eoff: int) -> bytes:
    """The ENTRY_ARRAY bytes of an entry, as stored (to copy an ndarray entry elsewhere)."""
    return bytes(buf[eoff + ENTRY_ARRAY_OFFSET: eoff + ENTRY_ARRAY_OFFSET + ENTRY_ARRAY.struct.size])


def entry_table(buf: Any, layout: Layout, n: int | None = None) -> np.ndarray:
    """Structured numpy view of the entry table (no copy): its first ``n`` entries, by default those ever
    handed out (below the never-used cursor; every entry beyond it is FREE and untouched).

    Scans never touch the table's unused tail, so a large ``max_objects`` costs memory only as entries are
    used. Callers that combine several arrays (pins, masks) take their length from this one view: the
    cursor may grow meanwhile.
    """
    if n is None:
        n = entry_cursor(buf)[0]
    return np.ndarray((min(n, layout.max_objects),), ENTRY_DTYPE, buffer=buf, offset=layout.entries)


# ---- extents ----------------------------------------------------------------

# hot-path accessors: plain tuples in EXTENT field order, single-field stores
extent_raw = EXTENT.struct.unpack_from


def extent_write(buf: Any, xoff: int, *values: Any) -> None:
    """Write a whole EXTENT record from its values in field order."""
    _put(buf, xoff, EXTENT.struct, *values)
_X = EXTENT.offset
_X_PREV_PHYS, _X_NEXT_PHYS, _X_PREV_FREE, _X_NEXT_FREE = _X["prev_phys"], _X["next_phys"], _X["prev_free"], \
    _X["next_free"]


def extent_table(buf: Any, layout: Layout) -> np.ndarray:
    return np.ndarray((layout.nextents,), EXTENT_DTYPE, buffer=buf, offset=layout.extents)


def set_extent_prev_phys(buf: Any, xoff: int, rec: int) -> None:
    _put(buf, xoff + _X_PREV_PHYS, _I32, rec)


def set_extent_next_phys(buf: Any, xoff: int, rec: int) -> None:
    _put(buf, xoff + _X_NEXT_PHYS, _I32, rec)


def set_extent_prev_free(buf: Any, xoff: int, rec: int) -> None:
    _put(buf, xoff + _X_PREV_FREE, _I32, rec)


def set_extent_next_free(buf: Any, xoff: int, rec: int) -> None:
    _put(buf, xoff + _X_NEXT_FREE, _I32, rec)


# ---- clients and sessions ---------------------------------------------------

def unpack_client(buf: Any, coff: int) -> tuple[int, int, int, float]:
    """(pid, state, start time, attach time)."""
    c = CLIENT.unpack(buf, coff)
    return c.pid, c.state, c.start, c.attached


def pack_client(buf: Any, coff: int, pid: int, state: int, start: int, attached: float) -> None:
    CLIENT.pack(buf, coff, pid=pid, state=state, start=start, attached=attached)  # no chunk yet


_CLIENT_CHUNK = CLIENT.span("chunk", "chunk_size")


def client_chunk(buf: Any, coff: int) -> tuple[int, int, int]:
    """(extent record, offset, size) of a client's current chunk."""
    return _CLIENT_CHUNK.unpack_from(buf, coff + CLIENT.offset["chunk"])


def set_client_chunk(buf: Any, coff: int, rec: int, offset: int, size: int) -> None:
    _put(buf, coff + CLIENT.offset["chunk"], _CLIENT_CHUNK, rec, offset, size)


def client_table(buf: Any, layout: Layout) -> np.ndarray:
    return np.ndarray((layout.max_clients,), CLIENT_DTYPE, buffer=buf, offset=layout.clients)


def unpack_session(buf: Any, soff: int) -> str | None:
    s = SESSION.unpack(buf, soff)
    return s.name[:s.length - 1].decode() if s.length else None  # length + 1, so 0 means unused


def pack_session(buf: Any, soff: int, name: str) -> None:
    raw = name.encode()
    SESSION.pack(buf, soff, length=len(raw) + 1, name=raw)


# ---- pins ---------------------------------------------------------------------

def pin_row(buf: Any, layout: Layout, slot: int) -> memoryview:
    """Client ``slot``'s pin bytes, indexable by entry (release() it when done)."""
    start = layout.pinbyte(slot, 0)
    return memoryview(buf)[start: start + layout.max_objects]


def slots_high(buf: Any) -> int:
    return ALLOC_STATE.get(buf, ALLOC_OFFSET, "slots_high")


def set_slots_high(buf: Any, n: int) -> None:
    ALLOC_STATE.set(buf, ALLOC_OFFSET, "slots_high", n)


def pin_table(buf: Any, layout: Layout) -> np.ndarray:
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


def pack_object_header(buf: Any, off: int, pickle_len: int, blobs: list[tuple[int, int]]) -> None:
    """Write the header of a pickled object: ``blobs`` are (offset, length) in pickle order."""
    OBJECT_HEADER.pack(buf, off, nblobs=len(blobs), pickle_len=pickle_len)
    if blobs:
        flat = [v for b in blobs for v in b]
        _put(buf, off + OBJECT_HEADER.size, struct.Struct(f"<{len(flat)}Q"), *flat)


def unpack_object_header(buf: Any, off: int = 0) -> tuple[int, int, list[tuple[int, int]]]:
    """(pickle start, pickle length, [(blob offset, blob length)]) relative to ``off``."""
    h = OBJECT_HEADER.unpack(buf, off)
    flat = struct.unpack_from(f"<{2 * h.nblobs}Q", buf, off + OBJECT_HEADER.size)
    return object_header_size(h.nblobs), h.pickle_len, list(zip(flat[0::2], flat[1::2]))
