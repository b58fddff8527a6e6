"""Repairing what a process killed inside a locked section left half done.

Two repairs, each run by whoever next takes the lock the dead process held
(the lock reports ``EOWNERDEAD``), with that lock held:

- the ALLOC lock (:func:`rebuild_allocator`): the allocator's free space,
  the entry free list, the retired-chunk count and each level's own counter
  (the DISK quota: ``StorageLevel.recount_locked``) are all derived again
  from what owns space, which is the truth: entries and client records (see
  ``alloc.py`` on two-way ownership);
- a stripe lock (:func:`repair_stripe`): chains lose anything that is not
  ``writing`` or ``sealed`` (a delete killed between hiding an entry and
  unlinking it), an entry left out of its chain while still ``writing`` (a
  put killed before linking it) is dropped, the stripe's usage counters are
  counted again, and deleted entries nobody pins are freed.

Both repairs only ever drop what no finished operation produced: a put that
returned had linked its entry; a delete that returned had hidden and
unlinked it. An entry is ``sealed`` only once linked, and hidden before it
is unlinked, so ``list()`` (which reads states without locks) never shows
an object that ``get()`` cannot find.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..meta import layout as L

if TYPE_CHECKING:
    from ..meta.table import Table
    from .nodestore import NodeStore

__all__ = ["rebuild_allocator", "repair_stripe", "valid_extents"]


def valid_extents(buf: Any, lay: L.Layout) -> tuple[np.ndarray, np.ndarray]:
    """(records to keep, records among them that must become retired chunks).

    A used extent is kept when its owner names it back: an entry (any state
    but free: a reserved entry may hold the extent of a put in flight) whose
    ``extent`` is this record (or, while it moves, whose ``target_extent``
    is), or a client whose chunk is this record. A
    chunk no client names any more is kept as a retired chunk while an
    object still lives in it, and dropped otherwise.
    """
    t = L.entry_table(buf, lay, max(1, L.entry_cursor(buf)[0]))  # never empty: owners index into it
    c = L.client_table(buf, lay)
    n, _ = L.extent_cursor(buf)
    ext = L.extent_table(buf, lay)[:n]
    recs = np.arange(1, n + 1, dtype=np.int64)
    flags, owner = ext["flags"], ext["owner"].astype(np.int64)
    taken = t["state"] != L.FREE
    own = np.clip(owner - 1, 0, max(len(t) - 1, 0))
    moving = (t["flags"][own] & L.FLAG_MOVING) != 0
    names = (((t["extent"][own] == recs) & ((t["flags"][own] & L.FLAG_IN_CHUNK) == 0))
             | (moving & (t["target_extent"][own] == recs)))  # the new copy of a move in flight
    used = (flags == L.EXT_USED) & (owner > 0) & (owner <= len(t)) & taken[own] & names
    slot = np.clip(-owner - 1, 0, lay.max_clients - 1)
    chunk = (flags == L.EXT_CHUNK) & (owner < 0) & (-owner <= lay.max_clients) & (c["chunk"][slot] == recs)
    refs = t["extent"][taken & ((t["flags"] & L.FLAG_IN_CHUNK) != 0)]
    retired = ((flags == L.EXT_CHUNK) | (flags == L.EXT_RETIRED)) & ~chunk & np.isin(recs, refs)
    return recs[used | chunk | retired], recs[retired]


def rebuild_allocator(node: NodeStore) -> None:
    """Derive everything the ALLOC lock guards again (ALLOC lock held, its last holder died)."""
    buf, lay = node.buf, node.layout
    keep, retire = valid_extents(buf, lay)
    ext = L.extent_table(buf, lay)
    ext["flags"][retire - 1] = L.EXT_RETIRED
    node.alloc.rebuild(keep.tolist(), node.device_allocators())
    L.ALLOC.set(buf, "retired", len(retire))
    c = L.client_table(buf, lay)
    for slot in np.flatnonzero((c["chunk"] != 0) & ~np.isin(c["chunk"], keep)):
        L.set_client_chunk(buf, lay.client(int(slot)), 0, 0, 0)  # its owner died allocating it
    _rebuild_free_entries(buf, lay)
    t = L.entry_table(buf, lay)
    for level in node.levels.values():  # the levels this process opened: every one (see NodeStore)
        level.recount_locked(t)


def _rebuild_free_entries(buf: Any, lay: L.Layout) -> None:
    t = L.entry_table(buf, lay)
    next_unused, _ = L.entry_cursor(buf)
    free = np.flatnonzero(t["state"][:next_unused] == L.FREE)
    if len(free):
        t["next"][free[:-1]] = free[1:] + 1
        t["next"][free[-1]] = 0
    L.set_entry_cursor(buf, next_unused, int(free[0]) + 1 if len(free) else 0)


def repair_stripe(node: NodeStore, stripe: int) -> int:
    """Repair one stripe (its lock held, its last holder died); returns how many entries were dropped."""
    buf, lay, table = node.buf, node.layout, node.table
    linked = table.prune_chains(stripe)
    t = L.entry_table(buf, lay)
    # live and meant to be linked (an overwrite's shadow entry is in no chain until it replaces the old one)
    live = ((t["state"] == L.WRITING) & ((t["flags"] & L.FLAG_SHADOW) == 0)) | (t["state"] == L.SEALED)
    ghosts = [idx for idx in np.setdiff1d(_of_stripe(table, stripe, t, live), linked).tolist()
              if _still(node, stripe, idx, (L.WRITING, L.SEALED))]
    for idx in ghosts:
        table.mark_deleted(idx)
    table.repair_stats(stripe)
    deleted = (t["state"] == L.DELETED) & ((t["flags"] & L.FLAG_MOVING) == 0)
    for idx in _of_stripe(table, stripe, t, deleted).tolist():  # ghosts, and a delete killed half way
        if _still(node, stripe, idx, (L.DELETED,)):
            node.free_if_unpinned(idx)  # the last pin frees a pinned one; the mover a moving one
    return len(ghosts)


def _of_stripe(table: Table, stripe: int, t: np.ndarray, states: np.ndarray) -> np.ndarray:
    """Indices of the entries picked by ``states`` (a mask of ``t`` computed already) whose key hashes to
    ``stripe``: the states read first, the hashes after, never the other way round.

    Only this stripe's entries stand still while we hold its lock; an entry of
    another stripe's key changes under that stripe's lock meanwhile. The race
    of the other order, step by step: a client's batch holds entry ``i``,
    reserved, with the hash of the key it held before (of our stripe); we read
    the hashes: ``i`` is ours; the client puts a key of another stripe into
    ``i`` under that stripe's lock (hash, then state: linked and sealed there)
    and its put returns; we read the states: ``i`` is sealed, ours and in none
    of our chains, so a ghost, and we hide it - an object whose put returned
    answers ``ObjectNotFoundError`` (or, still being written, is counted deleted
    in a stripe that did not delete it). A state is always written after the
    hash it goes with, so an entry we see live has its final hash by the time
    we read that.
    """
    idx: np.ndarray = np.flatnonzero(states & table.stripe_mask(stripe, t))
    return idx


def _still(node: NodeStore, stripe: int, idx: int, states: tuple[int, ...]) -> bool:
    """Whether entry ``idx`` is (still) in one of ``states`` and of ``stripe`` (its state read first, as in
    :func:`_of_stripe`), right before acting on it."""
    eoff = node.layout.entry(idx)
    return L.ENTRY_HEAD.get(node.buf, eoff, "state") in states and node.table.stripe_of(idx) == stripe
