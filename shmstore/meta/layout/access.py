"""Reads and writes of a node store's records that take more than one field store.

Text fields (NUL-padded bytes in the segment, ``str`` here), cursors and counters stored as one run of
fields, the ENTRY slot's array metadata and key, and numpy views of whole tables for vectorised scans.
Single fields are read and written with ``Record.get``/``Record.set`` (``HEAD``/``ALLOC``/``SPILL`` for the
records at fixed offsets). The functions are pure functions over a buffer (``mmap``, ``memoryview`` or
``bytearray``) and an offset: they take no lock.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .fields import (
    ALLOC_OFFSET,
    ALLOC_STATE,
    CLIENT,
    CLIENT_DTYPE,
    ENTRY_ARRAY,
    ENTRY_ARRAY_OFFSET,
    ENTRY_DTYPE,
    ENTRY_HEAD,
    ENTRY_KEY_OFFSET,
    EXTENT,
    GPU_ARENA,
    GPU_BASE_SHIFT,
    HEADER,
    MAX_NDIM,
    MAX_SESSIONS,
    MIGRATION,
    NMIGRATIONS,
    REQUEST,
    REQUEST_OFFSET,
    SESSION,
    SPILL_DIR_OFFSET,
    SPILL_DIR_SIZE,
    SPILL_OFFSET,
    SPILL_STATE,
    STRIPE_STATS,
    TRANSFER_STATS,
    TRANSFER_STATS_OFFSET,
    USED_WIDTH,
    Entry,
)
from .sections import Layout

__all__ = ["pack_header", "unpack_header", "unpack_spill_state", "pack_spill_state", "spill_dir", "set_spill_dir",
           "unpack_request", "pack_request", "unpack_migration", "pack_migration", "migration_states",
           "unpack_session", "pack_session", "sessions_in_use", "unpack_transfer_stats", "add_transfer_stats",
           "entry_cursor",
           "set_entry_cursor", "extent_cursor", "set_extent_cursor", "bins_offsets", "unpack_gpu", "set_gpu",
           "gpu_base", "add_stripe_stats", "add_stripe_deleted", "pack_client", "client_chunk", "set_client_chunk",
           "entry", "pack_entry", "entry_state_offset", "entry_key", "set_entry_key", "array_meta", "set_entry_array",
           "entry_array_raw", "entry_array_bytes", "extent_write", "entry_table", "extent_table", "client_table",
           "stats_table", "pin_table", "pin_row"]

_CURSOR = struct.Struct("<Ii")
_ENTRY_CURSOR = ALLOC_OFFSET + ALLOC_STATE.offset["entries_unused"]
_EXTENT_CURSOR = ALLOC_OFFSET + ALLOC_STATE.offset["extents_unused"]
_I64 = struct.Struct("<q")


def _put(buf: Any, off: int, st: struct.Struct, *values: Any) -> None:
    """Store ``values`` packed by ``st`` at ``off``: a memcpy of packed bytes, never ``pack_into``,
    whose zero fill shows readers in other processes zeros (see records.py)."""
    buf[off: off + st.size] = st.pack(*values)


# ---- records with text in them: NUL-padded bytes in the segment, str here -------------------------------

def pack_header(buf: Any, h: Any) -> None:
    HEADER.pack(buf, 0, **h._replace(name=h.name.encode(), node=h.node.encode())._asdict())


def unpack_header(buf: Any) -> Any:
    h = HEADER.unpack(buf, 0)
    return h._replace(name=_text(h.name), node=_text(h.node))


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


def unpack_spill_state(buf: Any) -> Any:
    return SPILL_STATE.unpack(buf, SPILL_OFFSET)


def pack_spill_state(buf: Any, s: Any) -> None:
    SPILL_STATE.pack(buf, SPILL_OFFSET, **s._asdict())


def spill_dir(buf: Any) -> str:
    return _text(bytes(buf[SPILL_DIR_OFFSET: SPILL_DIR_OFFSET + SPILL_DIR_SIZE]))


def set_spill_dir(buf: Any, path: str) -> None:
    raw = path.encode()
    if len(raw) >= SPILL_DIR_SIZE:
        raise ValueError(f"spill directory path longer than {SPILL_DIR_SIZE - 1} bytes: {path!r}")
    buf[SPILL_DIR_OFFSET: SPILL_DIR_OFFSET + SPILL_DIR_SIZE] = raw.ljust(SPILL_DIR_SIZE, b"\0")


def unpack_request(buf: Any, coff: int) -> Any:
    r = REQUEST.unpack(buf, coff + REQUEST_OFFSET)
    return r._replace(message=_text(r.message))


def pack_request(buf: Any, coff: int, r: Any) -> None:
    REQUEST.pack(buf, coff + REQUEST_OFFSET, **r._replace(message=r.message.encode()[:120])._asdict())


def unpack_migration(buf: Any, layout: Layout, slot: int) -> Any:
    m = MIGRATION.unpack(buf, layout.migration(slot))
    return m._replace(error=_text(m.error), key=m.key[: m.keylen])


def pack_migration(buf: Any, layout: Layout, slot: int, m: Any) -> None:
    MIGRATION.pack(buf, layout.migration(slot), **m._replace(keylen=len(m.key), error=m.error.encode()[:128])._asdict())


def migration_states(buf: Any, layout: Layout) -> bytes:
    """The state of every migration slot, one byte each (the low byte of its ``state``)."""
    start = layout.migrations
    return bytes(buf[start: start + NMIGRATIONS * MIGRATION.size: MIGRATION.size])


def unpack_session(buf: Any, soff: int) -> str | None:
    s = SESSION.unpack(buf, soff)
    return s.name[:s.length - 1].decode() if s.length else None  # length + 1, so 0 means unused


def pack_session(buf: Any, soff: int, name: str) -> None:
    raw = name.encode()
    SESSION.pack(buf, soff, length=len(raw) + 1, name=raw)


def sessions_in_use(buf: Any, layout: Layout) -> list[tuple[int, str]]:
    """(id, name) of every session slot in use, read in one pass over the session table."""
    t = np.ndarray((MAX_SESSIONS,), SESSION.dtype, buffer=buf, offset=layout.session(0))
    used = np.flatnonzero(t["length"])
    return [(int(sid), bytes(t["name"][sid])[:int(t["length"][sid]) - 1].decode(errors="replace")) for sid in used]


# ---- counters and runs of fields written together ---------------------------------------------------------

def unpack_transfer_stats(buf: Any) -> Any:
    """This node's TRANSFER_STATS (transfers, bytes received and sent, deduplicated requests)."""
    return TRANSFER_STATS.unpack(buf, TRANSFER_STATS_OFFSET)


def add_transfer_stats(buf: Any, transfers: int = 0, received: int = 0, sent: int = 0, dedup: int = 0) -> None:
    """Add to this node's transfer counters (ADMIN lock held); on every small fetch: one struct, no records."""
    st, at = TRANSFER_STATS.struct, TRANSFER_STATS_OFFSET
    t = st.unpack_from(buf, at)
    buf[at: at + st.size] = st.pack(t[0] + transfers, t[1] + received, t[2] + sent, t[3] + dedup)


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


def bins_offsets(layout: Layout, gpu: int = -1) -> tuple[int, int]:
    """(offset of the bins, offset of the bin mask) of the MEMORY arena, or of GPU arena ``gpu``."""
    if gpu < 0:
        return ALLOC_OFFSET + ALLOC_STATE.offset["bins"], ALLOC_OFFSET + ALLOC_STATE.offset["bin_mask"]
    at = layout.gpu(gpu)
    return at + GPU_ARENA.offset["bins"], at + GPU_ARENA.offset["bin_mask"]


def unpack_gpu(buf: Any, layout: Layout, d: int) -> Any:
    return GPU_ARENA.unpack(buf, layout.gpu(d))


def set_gpu(buf: Any, layout: Layout, d: int, **fields: Any) -> None:
    """Set fields of GPU arena ``d``'s record, one store each (``state`` last: it publishes)."""
    state = fields.pop("state", None)
    for name, value in fields.items():
        GPU_ARENA.set(buf, layout.gpu(d), name, value)
    if state is not None:
        GPU_ARENA.set(buf, layout.gpu(d), "state", state)


def gpu_base(d: int) -> int:
    return (d + 1) << GPU_BASE_SHIFT


def add_stripe_stats(buf: Any, soff: int, level: int, nbytes: int, objects: int) -> None:
    """Add to one stripe's used bytes on ``level`` and object count (stripe lock held).

    Two single-field stores: a struct with pad bytes would write zeros over
    the other levels' counters (packing writes pads too).
    """
    uoff, coff = soff + STRIPE_STATS.offset["used"] + USED_WIDTH * level, soff + STRIPE_STATS.offset["objects"]
    _put(buf, uoff, _I64, _I64.unpack_from(buf, uoff)[0] + nbytes)
    _put(buf, coff, _I64, _I64.unpack_from(buf, coff)[0] + objects)


def add_stripe_deleted(buf: Any, soff: int, n: int) -> None:
    """Count entries of a stripe that are deleted but still pinned."""
    STRIPE_STATS.set(buf, soff, "deleted", STRIPE_STATS.get(buf, soff, "deleted") + n)


def pack_client(buf: Any, coff: int, pid: int, state: int, start: int, attached: float) -> None:
    CLIENT.pack(buf, coff, pid=pid, state=state, start=start, attached=attached)  # no chunk yet


_CLIENT_CHUNK = CLIENT.span("chunk", "chunk_size")


def client_chunk(buf: Any, coff: int) -> tuple[int, int, int]:
    """(extent record, offset, size) of a client's current chunk."""
    return _CLIENT_CHUNK.unpack_from(buf, coff + CLIENT.offset["chunk"])


def set_client_chunk(buf: Any, coff: int, rec: int, offset: int, size: int) -> None:
    _put(buf, coff + CLIENT.offset["chunk"], _CLIENT_CHUNK, rec, offset, size)


# ---- entries --------------------------------------------------------------------------------------------

_make_entry, _unpack_entry = Entry._make, ENTRY_HEAD.struct.unpack_from


def entry(buf: Any, eoff: int) -> Entry:
    """The entry head at ``eoff``, named (the cold paths'; the hot ones index ``entry_raw`` with ``E_*``)."""
    return _make_entry(_unpack_entry(buf, eoff))


def pack_entry(buf: Any, eoff: int, e: Any) -> None:
    """Write a whole entry head from an ``Entry`` (or any tuple in its field order)."""
    _put(buf, eoff, ENTRY_HEAD.struct, *e)


def entry_state_offset(eoff: int) -> int:
    """Offset of an entry's state byte (for the C fast path's seal)."""
    return eoff + ENTRY_HEAD.offset["state"]


def entry_key(buf: Any, eoff: int, keylen: int) -> bytes:
    return bytes(buf[eoff + ENTRY_KEY_OFFSET: eoff + ENTRY_KEY_OFFSET + keylen])


def set_entry_key(buf: Any, eoff: int, key: bytes) -> None:
    buf[eoff + ENTRY_KEY_OFFSET: eoff + ENTRY_KEY_OFFSET + len(key)] = key


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
    return bytes(buf[eoff + ENTRY_ARRAY_OFFSET: eoff + ENTRY_ARRAY_OFFSET + ENTRY_ARRAY.size])


def extent_write(buf: Any, xoff: int, *values: Any) -> None:
    """Write a whole EXTENT record from its values in field order."""
    _put(buf, xoff, EXTENT.struct, *values)


# ---- numpy views of whole tables, for vectorised scans (list, janitor, spill policy, checks) ----------

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


def extent_table(buf: Any, layout: Layout) -> np.ndarray:
    return np.ndarray((layout.nextents,), EXTENT.dtype, buffer=buf, offset=layout.extents)


def client_table(buf: Any, layout: Layout) -> np.ndarray:
    return np.ndarray((layout.max_clients,), CLIENT_DTYPE, buffer=buf, offset=layout.clients)


def stats_table(buf: Any, layout: Layout) -> np.ndarray:
    return np.ndarray((layout.nstripes,), STRIPE_STATS.dtype, buffer=buf, offset=layout.stats)


def pin_table(buf: Any, layout: Layout) -> np.ndarray:
    """(max_clients, max_objects) uint8 view of every client's pin bytes."""
    return np.ndarray((layout.max_clients, layout.max_objects), np.uint8, buffer=buf, offset=layout.pinmaps,
                      strides=(layout.pinrow, 1))


def pin_row(buf: Any, layout: Layout, slot: int) -> memoryview:
    """Client ``slot``'s pin bytes, indexable by entry (release() it when done)."""
    start = layout.pinbyte(slot, 0)
    return memoryview(buf)[start: start + layout.max_objects]
