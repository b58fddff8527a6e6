"""The GPU arena records, as metadata only (no CUDA): slots keyed by device, their ranges, losing one.

A store has ``MAX_GPUS`` arena slots (``GPU_ARENA`` records). Slot ``s``
covers the offsets ``[(s + 1) << 44, (s + 1) << 44 + capacity)`` and names
its device by ``uuid`` (``gpumaps.device_key``), claimed under the ALLOC
lock by the first process that uses that device. Every process works out
its own ordinal for a slot from that key: a slot is never "device 0".
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from ..errors import StorageFullError
from ..meta import layout as L
from ..meta.alloc import Allocator
from ..node.protocols import LevelHost
from ..primitives.procs import pid_alive
from ..values import Level
from .gpumaps import UNCLAIMED, claim_slot

__all__ = ["Arena", "slot_of", "arena_of", "slot_for", "find_slot", "ready_arenas", "lose_arena", "drop_dead_arenas",
           "allocator"]

STATE_NAMES = ("not made", "being made", "ready", "failed", "lost with the spill process that held it")


class Arena(NamedTuple):
    """A ready arena: its slot, first offset, end offset and capacity (bytes)."""

    slot: int
    lo: int
    hi: int
    capacity: int


def allocator(host: LevelHost, slot: int) -> Allocator | None:
    """The allocator of arena ``slot`` if it is ready (metadata only: no device needed)."""
    g = L.unpack_gpu(host.buf, host.layout, slot)
    if g.state != L.GPU_READY:
        return None
    return Allocator(host.buf, host.layout, g.capacity, gpu=slot)


def slot_of(offset: int) -> int:
    """The arena slot of a GPU offset."""
    return (offset >> L.GPU_BASE_SHIFT) - 1


arena_of = slot_of


def _keys(host: LevelHost) -> list[bytes]:
    return [bytes(L.unpack_gpu(host.buf, host.layout, s).uuid) for s in range(L.MAX_GPUS)]


def find_slot(host: LevelHost, key: bytes) -> int:
    """The slot claimed for device ``key``; -1 where none is."""
    keys = _keys(host)
    return keys.index(key) if key in keys else -1


def slot_for(host: LevelHost, key: bytes, setting: str) -> int:
    """The slot of device ``key``, claimed (its key recorded) if no slot names it yet.

    Raises:
        StorageFullError: every slot names another device.
    """
    slot = find_slot(host, key)
    if slot >= 0:
        return slot
    with host.alloc_lock:  # claimed once: two processes of one device race for it here
        slot = claim_slot(_keys(host), key)
        if slot >= 0 and bytes(L.unpack_gpu(host.buf, host.layout, slot).uuid) == UNCLAIMED:
            L.set_gpu(host.buf, host.layout, slot, uuid=key)
    if slot < 0:
        raise StorageFullError(f"the store has GPU arenas on {L.MAX_GPUS} other devices already, the most it "
                               f"keeps ({setting})", None, Level.GPU)
    return slot


def ready_arenas(host: LevelHost) -> list[Arena]:
    """Every ready arena (metadata only)."""
    out = []
    for s in range(L.MAX_GPUS):
        g = L.unpack_gpu(host.buf, host.layout, s)
        if g.state == L.GPU_READY:
            out.append(Arena(s, L.gpu_base(s), L.gpu_base(s) + int(g.capacity), int(g.capacity)))
    return out


def lose_arena(host: LevelHost, slot: int, level: int) -> int:
    """Mark arena ``slot`` lost and drop the objects on it (hidden, unlinked, freed unless pinned); returns
    how many. Their space goes back to the lost arena's bins, which the next owner reuses when it makes the
    arena again (same size, new IPC handle)."""
    buf, lay, table = host.buf, host.layout, host.table
    g = L.unpack_gpu(buf, lay, slot)
    with host.alloc_lock:
        L.set_gpu(buf, lay, slot, state=L.GPU_LOST)
    t = L.entry_table(buf, lay)
    lo, hi = L.gpu_base(slot), L.gpu_base(slot) + int(g.capacity)
    on = (t["level"] == level) & (t["offset"] >= lo) & (t["offset"] < hi)
    lost = 0
    for idx in np.flatnonzero(on & (t["state"] == L.SEALED)).tolist():
        with host.stripe_of(idx):
            e = L.entry(buf, lay.entry(idx))
            if e.state != L.SEALED or e.level != level:
                continue
            table.mark_deleted(idx)  # hidden first, then out of its chain (see repair.py)
            table.unlink(idx, table.bucket_of(idx))
            host.free_if_unpinned(idx)
            lost += 1
    return lost


def drop_dead_arenas(host: LevelHost, level: int, only_mine: bool = False) -> int:
    """Lose every ready arena whose owner died (``only_mine``: every ready arena this process owns, as it
    exits); returns how many objects went."""
    lost = 0
    for s in range(L.MAX_GPUS):
        g = L.unpack_gpu(host.buf, host.layout, s)
        if g.state != L.GPU_READY:
            continue
        if (g.owner == os.getpid()) if only_mine else not pid_alive(g.owner):
            lost += lose_arena(host, s, level)
    return lost
