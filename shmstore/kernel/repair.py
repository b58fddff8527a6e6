"""Repairing the allocator after a process died holding the ALLOC lock."""
from __future__ import annotations

import numpy as np

from . import layout as L

__all__ = ["rebuild_allocator"]


def rebuild_allocator(node) -> None:
    """Rebuild allocator and entry free list from the entry table and client records.

    Kept as they are: every attached client's current chunk (the client
    goes on carving from it), reserved entries, and every live object
    outside those chunks, which becomes an extent of its own (objects of
    retired chunks included, so retired chunks disappear).
    """
    buf, lay = node.meta.mm, node.layout
    t = L.entry_table(buf, lay)
    c = L.client_table(buf, lay)
    next_unused, _ = L.entry_cursor(buf)
    spans, chunks = [], []
    for slot in np.flatnonzero((c["state"] == 1) & (c["chunk"] != 0)):
        off, size = int(c["chunk_offset"][slot]), int(c["chunk_size"][slot])
        spans.append((off, size, -(int(slot) + 1), L.EXT_CHUNK))
        chunks.append((off, off + size, int(slot)))
    live = (t["state"] == L.WRITING) | (t["state"] == L.SEALED) | (t["state"] == L.DELETED)
    live[next_unused:] = False
    mem = np.flatnonzero(live & (t["level"] == 1) & (t["size"] > 0))
    in_chunk: dict[int, int] = {}
    for i in mem:
        off = int(t["offset"][i])
        slot = next((sl for lo, hi, sl in chunks if lo <= off < hi), None)
        if slot is None:
            spans.append((off, int(t["size"][i]), int(i) + 1, L.EXT_USED))
        else:
            in_chunk[int(i)] = slot
    owners = node.alloc.rebuild(spans)
    for i in mem:
        i = int(i)
        eoff = lay.entry(i)
        if i in in_chunk:
            L.set_entry_extent(buf, eoff, owners[-(in_chunk[i] + 1)])
        else:
            L.set_entry_extent(buf, eoff, owners[i + 1])
            L.set_entry_flags(buf, eoff, L.entry_flags(buf, eoff) & ~L.FLAG_IN_CHUNK)
    for _, _, slot in chunks:
        coff = lay.client(slot)
        _, off, size = L.client_chunk(buf, coff)
        L.set_client_chunk(buf, coff, owners[-(slot + 1)], off, size)
    head = 0
    for i in reversed(np.flatnonzero(t["state"][:next_unused] == L.FREE)):
        L.set_entry_next(buf, lay.entry(int(i)), head)
        head = int(i) + 1
    L.set_entry_cursor(buf, next_unused, head)
    L.set_retired_chunks(buf, 0)
