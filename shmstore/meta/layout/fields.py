"""The binary records of a node store, declared once, and the constants they hold.

Each record is a table of fields (``records.Record``): its struct, numpy dtype, field indices and offsets
(the C fast path's included, with each field's width) and the tables at the end of this documentation all
derive from that declaration. Where each record sits is :mod:`.sections`' business; reads and writes of more
than one field, :mod:`.access`'s.

The records follow.
"""
from __future__ import annotations

from typing import NamedTuple

from ..records import Record

__all__ = ["MAGIC", "LAYOUT_VERSION", "HEADER_SIZE", "MAX_SESSIONS", "MAX_KEY", "MAX_NDIM", "ALIGN", "PAGE", "NBINS",
           "MAX_GPUS", "GPU_BASE_SHIFT", "MIN_CHUNK", "LOCK_ADMIN", "LOCK_ALLOC", "LOCK_FIRST_STRIPE", "LOCK_STRIDE",
           "FREE", "WRITING", "SEALED", "DELETED", "RESERVED", "KIND_RAW", "KIND_NDARRAY", "KIND_PICKLE",
           "FLAG_MOVING", "FLAG_IN_CHUNK", "FLAG_SHADOW", "LEVEL_GPU", "LEVEL_MEMORY", "LEVEL_DISK", "LEVEL_NAMES",
           "STATE_NAMES", "STATE_INIT", "STATE_READY", "STATE_DESTROYING", "FLAG_PERSIST", "EXT_UNUSED", "EXT_FREE",
           "EXT_USED", "EXT_CHUNK", "EXT_RETIRED", "REQ_NONE", "REQ_SPACE", "REQ_MOVE", "REQ_GPU", "RS_IDLE",
           "RS_PENDING", "RS_DONE", "RS_FAILED", "ERR_FULL", "ERR_IO", "ERR_LOCKED", "ERR_MISSING", "NMIGRATIONS",
           "MIG_FREE", "MIG_FLIGHT", "MIG_FAILED", "align", "HEADER", "ALLOC_OFFSET", "ALLOC_STATE", "SPILL_OFFSET",
           "SPILL_STATE", "SPILL_DIR_OFFSET", "SPILL_DIR_SIZE", "TRANSFER_STATS_OFFSET", "TRANSFER_STATS", "GPU_ARENA",
           "GPU_NONE", "GPU_ASKED", "GPU_READY", "GPU_FAILED", "GPU_LOST", "SESSION", "CLIENT", "REQUEST_OFFSET",
           "REQUEST", "STRIPE_STATS", "Entry", "ENTRY_HEAD", "ENTRY_ARRAY", "ENTRY_ARRAY_OFFSET", "ENTRY_KEY_OFFSET",
           "ENTRY_SIZE", "BUCKET", "STRIPE_SHIFT", "EXTENT", "MIGRATION_SIZE", "MIGRATION", "OBJECT_HEADER", "BLOB",
           "RECORDS",
           "ENTRY_DTYPE", "CLIENT_DTYPE", "E_OFFSET", "E_SIZE", "E_NBYTES", "E_ATIME", "E_CTIME", "E_HASH", "E_NEXT",
           "E_GEN", "E_TARGET_EXTENT", "E_WRITER", "E_EXTENT", "E_NBLOBS", "E_KEYLEN", "E_SESSION", "E_STATE",
           "E_KIND", "E_LEVEL", "E_FLAGS", "E_TARGET", "entry_raw", "extent_raw", "HEAD", "ALLOC", "SPILL",
           "USED_WIDTH", "Header", "SpillState", "Request", "Migration", "fast_path_layout"]

MAGIC = b"SHMSTOR\0"
# 8: a stripe owns whole cache lines of bucket heads (STRIPE_SHIFT); GPU arenas keyed by
LAYOUT_VERSION = 8
                    # the device's identity (GPU_ARENA.uuid), not its ordinal; REQUEST.arena
HEADER_SIZE = 4096
MAX_SESSIONS = 256
MAX_KEY = 255
MAX_NDIM = 8
ALIGN = 64
PAGE = 4096
NBINS = 64
MAX_GPUS = 8
# GPU arena d starts at offset (d + 1) << 44 of the store's offset space
GPU_BASE_SHIFT = 44
MIN_CHUNK = 64 << 10  # smallest chunk of the arena handed to a client for small objects

# lock indices
LOCK_ADMIN, LOCK_ALLOC, LOCK_FIRST_STRIPE = 0, 1, 2
LOCK_STRIDE = 64

# entry states and kinds
FREE, WRITING, SEALED, DELETED, RESERVED = 0, 1, 2, 3, 4
KIND_RAW, KIND_NDARRAY, KIND_PICKLE = 0, 1, 2
FLAG_MOVING, FLAG_IN_CHUNK = 1, 2
# a ``writing`` entry of an overwrite: in no chain until it replaces the old one
FLAG_SHADOW = 4
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



def align(n: int) -> int:
    """Round ``n`` up to the arena alignment (64 bytes)."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)

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
    4    device    i32       the device's CUDA ordinal in the owner process (information only: ordinals
                             depend on each process's CUDA_VISIBLE_DEVICES; ``uuid`` names the device)
    8    base      u64       offset of the arena in the store's offset space ((d + 1) << 44)
    16   capacity  u64       bytes
    24   owner     i32       pid of the process holding the device allocation (the spill process)
    28   epoch     u32       bumped whenever the arena is made again (clients reopen the handle)
    32   bin_mask  u64       bitmap of non-empty allocator bins of this arena
    40   bins      i32[64]   free extents of this arena, per size class (as ALLOC_STATE's)
    296  handle    bytes64   the allocation's cudaIpcMemHandle_t
    360  message   bytes120  why creating it failed (UTF-8)
    480  uuid      bytes16   the device's identity, the same in every process (levels/gpumaps.py
                             device_key: from its PCI bus id and UUID); all zero: slot unclaimed
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
    48   gpu_views     u32  GPU arena slots (bit d) this process holds views of, through CUDA IPC: the
                            arena's owner keeps the allocation until the bit goes (levels/gpu.py)
""")
REQUEST_OFFSET = 64  # within a CLIENT record
REQUEST = Record("REQUEST", 160, """
    0    kind     u32       0 none, 1 make room (bytes on a level), 2 move an entry to a level, 3 make
                            GPU arena slot ``idx`` (on the device the slot names)
    4    seq      u32       sequence number (bumped by the client on every request)
    8    idx      i32       entry index
    12   gen      u32       entry generation
    16   level    u32       the level to make room on, or to move to
    20   status   u32       0 idle, 1 pending, 2 done, 3 failed
    24   error    u32       when failed: 1 full, 2 I/O, 3 locked, 4 not found
    28   arena    i32       a move onto a device level: the slot + 1 of the arena of the asking client's
                            current device (0: the spill process chooses)
    32   nbytes   u64       bytes
    40   message  bytes120  error message (UTF-8)
""")
STRIPE_STATS = Record("STRIPE_STATS", 64, """
    0    used     i64[3]  bytes of the stripe's objects per level (GPU, MEMORY, DISK)
    24   objects  i64     live entries (writing, sealed, deleted)
    32   deleted  i64     deleted entries still pinned
""")
class Entry(NamedTuple):
    """An ENTRY_HEAD record by name: ``ENTRY_HEAD.tuple`` (the record checks the names and their order)."""

    offset: int
    size: int
    nbytes: int
    atime: float
    ctime: float
    hash: int
    next: int
    gen: int
    target_extent: int
    writer: int
    extent: int
    nblobs: int
    keylen: int
    session: int
    state: int
    kind: int
    level: int
    flags: int
    target: int


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
""", tuple_type=Entry)
ENTRY_ARRAY = Record("ENTRY_ARRAY", 88, """
    0    dtype  bytes16  ndarray dtype.str
    16   ndim   u8       ndarray ndim (<= 8)
    17   order  u8       0 C, 1 F
    24   shape  i64[8]   ndarray shape
""")
# an ENTRY slot: ENTRY_HEAD, ENTRY_ARRAY, then the key (UTF-8, MAX_KEY bytes at most)
ENTRY_ARRAY_OFFSET = ENTRY_HEAD.size
ENTRY_KEY_OFFSET = ENTRY_ARRAY_OFFSET + ENTRY_ARRAY.size
ENTRY_SIZE = align(ENTRY_KEY_OFFSET + MAX_KEY)
BUCKET = Record("BUCKET", 4, """
    0    head  i32  first entry of the bucket's hash chain (1-based, 0 none)
""")
# Bucket b belongs to stripe (b >> STRIPE_SHIFT) & (nstripes - 1): the 16 heads of one 64-byte cache line all
# belong to one stripe, so a put or delete writes no line that a process working on another stripe writes
# (with b & (nstripes - 1), every line held heads of 16 stripes).
STRIPE_SHIFT = (64 // BUCKET.size).bit_length() - 1
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
RECORDS = (HEADER, ALLOC_STATE, SPILL_STATE, TRANSFER_STATS, SESSION, CLIENT, REQUEST, STRIPE_STATS, BUCKET,
           ENTRY_HEAD, ENTRY_ARRAY, EXTENT, MIGRATION, OBJECT_HEADER, BLOB)
__doc__ += "\n" + "\n\n".join(r.doc() for r in RECORDS) + "\n"  # noqa: A001 - the tables derive from the records

# numpy dtypes of whole slots, for vectorised scans (list, janitor, spill policy, checks)
ENTRY_DTYPE = ENTRY_HEAD.table_dtype(ENTRY_SIZE)
CLIENT_DTYPE = CLIENT.table_dtype(CLIENT.size, (REQUEST_OFFSET, REQUEST, "req_", ("kind", "status")))

# positions in a raw ENTRY_HEAD tuple (entry_raw), for the hot paths
(E_OFFSET, E_SIZE, E_NBYTES, E_ATIME, E_CTIME, E_HASH, E_NEXT, E_GEN, E_TARGET_EXTENT, E_WRITER, E_EXTENT,
 E_NBLOBS, E_KEYLEN, E_SESSION, E_STATE, E_KIND, E_LEVEL, E_FLAGS, E_TARGET) = ENTRY_HEAD.indices(*Entry._fields)
entry_raw = ENTRY_HEAD.struct.unpack_from
extent_raw = EXTENT.struct.unpack_from
HEAD, ALLOC, SPILL = HEADER.at(0), ALLOC_STATE.at(ALLOC_OFFSET), SPILL_STATE.at(SPILL_OFFSET)
_USED_FIELD = next(f for f in STRIPE_STATS.fields if f.name == "used")
USED_WIDTH = _USED_FIELD.size // _USED_FIELD.n  # one level's counter in STRIPE_STATS.used
Header = HEADER.tuple
SpillState = SPILL_STATE.tuple
Request = REQUEST.tuple
Migration = MIGRATION.tuple


# ---- what the C fast path is told -----------------------------------------------------------------------

_FAST_FIELDS = ("offset", "size", "nbytes", "atime", "ctime", "hash", "next", "gen", "writer", "extent", "nblobs",
                "keylen", "session", "state", "kind", "level", "flags")


def fast_path_layout() -> dict[str, int]:
    """What the optional C fast path (_fast.c) needs to know, by name (see ``_fast.configure``): each entry
    field's offset (``<name>_off``) and width in bytes (``<name>_width``: C refuses a width it does not
    store that field with), the sizes of the tables it indexes, and the entry states."""
    fields = {f.name: f for f in ENTRY_HEAD.fields}
    return {"entry_size": ENTRY_SIZE, "array_off": ENTRY_ARRAY_OFFSET, "array_size": ENTRY_ARRAY.size,
            "key_off": ENTRY_KEY_OFFSET, "max_key": MAX_KEY, "bucket_width": BUCKET.size,
            "stripe_shift": STRIPE_SHIFT,
            "stats_used_off": STRIPE_STATS.offset["used"], "stats_used_width": USED_WIDTH,
            "stats_objects_off": STRIPE_STATS.offset["objects"],
            "stats_objects_width": STRIPE_STATS.field("objects").size,
            "sealed": SEALED, "writing": WRITING, "deleted": DELETED, "reserved": RESERVED,
            **{f"{n}_off": fields[n].offset for n in _FAST_FIELDS},
            **{f"{n}_width": fields[n].size for n in _FAST_FIELDS}}
