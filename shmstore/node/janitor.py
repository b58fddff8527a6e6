"""Reclaiming what dead processes held: pins, half-written objects, client slots.

Run by the spill process (and by any client that finds the spill process
gone). Each step takes only the lock of the entry it repairs, so clients keep
working while a dead process's leftovers are cleaned up.
"""
from __future__ import annotations

import numpy as np

from ..meta import layout as L
from .nodestore import NodeStore, pid_alive
from .supplies import retire_chunk

__all__ = ["reclaim", "release_all", "dead_clients", "janitor_pass", "sweep_deleted", "give_back", "probe_locks"]


def dead_clients(node: NodeStore) -> list[tuple[int, int]]:
    """(slot, pid) of registered clients whose process is gone."""
    return [(slot, pid) for slot, pid, start in node.clients() if not pid_alive(pid, start)]


def reclaim(node: NodeStore, slot: int) -> tuple[int, int]:
    """Release everything client ``slot`` held, then free its slot.

    Returns:
        (objects dropped, bytes freed) - unsealed writes and deleted objects
        whose last pin it was.
    """
    dropped, freed = release_all(node, slot)
    node.deregister(slot)
    return dropped, freed


def release_all(node: NodeStore, slot: int) -> tuple[int, int]:
    """Release everything client ``slot`` holds: unsealed writes, pins, reserved entries, its chunk.

    For a dead client (:func:`reclaim`), and for a live one closing with no
    verb in flight: what a verb cut short by an asynchronous exception had
    set aside for itself (an entry taken from its batch, a write it had
    begun, a pin it had not counted yet) comes back then, as it would
    after the process's death.

    Returns:
        (objects dropped, bytes freed).
    """
    buf, lay, table = node.buf, node.layout, node.table
    dropped = freed = 0
    entries = L.entry_table(buf, lay)
    for idx in np.flatnonzero((entries["state"] == L.WRITING) & (entries["writer"] == slot)).tolist():
        with node.stripe_of(idx):
            eoff = lay.entry(idx)
            e = L.entry(buf, eoff)
            if e.state == L.WRITING and e.writer == slot:
                table.unlink(idx, table.bucket_of(idx))
                node.release(idx)
                dropped, freed = dropped + 1, freed + e.size
    for idx in table.pinned_by(slot).tolist():
        with node.stripe_of(idx):
            size = L.entry(buf, lay.entry(idx)).size
            node.table.unpin(slot, idx)
            if node.free_if_unpinned(idx):
                dropped, freed = dropped + 1, freed + size
    give_back(node, slot)
    return dropped, freed


def give_back(node: NodeStore, slot: int) -> None:
    """Return client ``slot``'s reserved entries (with any space placed for them) and retire its chunk."""
    buf, lay = node.buf, node.layout
    with node.alloc_lock:
        t = L.entry_table(buf, lay)
        for idx in np.flatnonzero((t["state"] == L.RESERVED) & (t["writer"] == slot)):
            node.table.release_entry(int(idx))  # a reserved entry counts in no stripe
        retire_chunk(node, slot)


def sweep_deleted(node: NodeStore) -> int:
    """Free deleted entries that nobody pins any more; returns how many.

    Catches the one case the lock-free unpin leaves behind (see table.py).
    """
    if not node.table.deleted_pending():
        return 0
    entries = L.entry_table(node.buf, node.layout)
    candidates = np.flatnonzero(entries["state"] == L.DELETED)
    freed = 0
    for idx in candidates.tolist():
        if node.table.pin_count(idx):
            continue
        with node.stripe_of(idx):
            freed += bool(node.free_if_unpinned(idx))
    return freed


def janitor_pass(node: NodeStore) -> list[tuple[int, int, int, int]]:
    """Reclaim every dead client of ``node``: [(slot, pid, objects dropped, bytes freed)]."""
    out = []
    for slot, pid in dead_clients(node):
        dropped, freed = reclaim(node, slot)
        out.append((slot, pid, dropped, freed))
    if out:
        probe_locks(node)
    return out


def probe_locks(node: NodeStore) -> None:
    """Take and release each free lock once, so that one a dead process held is repaired now.

    Otherwise its repair waits for the next process that needs that lock,
    and until then its stripe's usage counters may be off.
    """
    for lock in (*node.stripes, node.alloc_lock, node.admin):
        if lock.acquire(blocking=False):
            lock.release()
