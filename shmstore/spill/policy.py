"""Spill policy: which objects to move, as pure functions over table snapshots.

The mover (``mover.py``) decides nothing: it asks these functions for
candidates and re-checks each one under its lock before moving it.
"""
from __future__ import annotations

import numpy as np

from ..meta import layout as L

__all__ = ["spill_candidates", "watermark_excess", "arena_used"]


def spill_candidates(entries: np.ndarray, pins: np.ndarray, exclude: int = -1,
                     whole_extents_first: bool = False, level: int = L.LEVEL_MEMORY,
                     within: tuple[int, int] | None = None) -> np.ndarray:
    """Indices of objects on ``level`` that may be spilled, least recently used first.

    Args:
        entries: the entry table (structured array, ``layout.ENTRY_DTYPE``).
        pins: pinning processes per entry.
        exclude: an entry never to pick (the one being restored).
        level: the level to pick from (any level: the same rules).
        within: only objects whose offset is in ``[lo, hi)`` (one arena of a level with several).
        whole_extents_first: put objects with an extent of their own first
            (spilling those frees contiguous space at once; objects carved
            from a chunk free space only when the whole chunk empties).
    """
    ok = ((entries["state"] == L.SEALED) & (entries["level"] == level)
          & ((entries["flags"] & L.FLAG_MOVING) == 0) & (pins == 0))
    if within is not None:
        ok &= (entries["offset"] >= within[0]) & (entries["offset"] < within[1])
    if 0 <= exclude < len(ok):
        ok[exclude] = False
    idx = np.flatnonzero(ok)
    order = np.argsort(entries["atime"][idx], kind="stable")
    if whole_extents_first:
        chunked = (entries["flags"][idx] & L.FLAG_IN_CHUNK) != 0
        order = np.lexsort((entries["atime"][idx], chunked))
    return idx[order]


def watermark_excess(used: int, capacity: int, high: float, low: float) -> int:
    """Bytes to spill to get from above ``high`` down to ``low`` (0 if not above ``high``)."""
    if used <= high * capacity:
        return 0
    return int(used - low * capacity)


def arena_used(entries: np.ndarray, level: int, lo: int, hi: int) -> int:
    """Bytes of the live objects (writing, sealed, deleted but pinned) of ``level`` in ``[lo, hi)``: one
    arena's own usage, for a level with an arena per device."""
    on = ((entries["level"] == level) & (entries["offset"] >= lo) & (entries["offset"] < hi)
          & (entries["state"] != L.FREE) & (entries["state"] != L.RESERVED))
    return int(entries["size"][on].sum())
