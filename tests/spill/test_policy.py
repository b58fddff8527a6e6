"""policy: which objects to spill, as pure functions over a table on a bytearray."""
from __future__ import annotations

import numpy as np

from shmstore.meta import layout as L
from shmstore.spill.policy import spill_candidates, watermark_excess


def table(rows):
    """An entry table holding ``rows``: (state, level, flags, atime) per entry."""
    lay = L.Layout(max_objects=len(rows), max_clients=2, nstripes=2)
    buf = bytearray(lay.size)
    for i, (state, level, flags, atime) in enumerate(rows):
        L.pack_entry(buf, lay.entry(i), L.Entry(0, 64, 64, atime, 0.0, 0, 0, 0, 0, 0, 0, 0, 1, 0, state,
                                                       L.KIND_RAW, level, flags, 0))
    return L.entry_table(buf, lay, len(rows))


def test_least_recently_used_sealed_memory_objects_first():
    t = table([(L.SEALED, L.LEVEL_MEMORY, 0, 5.0), (L.SEALED, L.LEVEL_MEMORY, 0, 1.0),
               (L.SEALED, L.LEVEL_MEMORY, 0, 3.0)])
    assert list(spill_candidates(t, np.zeros(3, int))) == [1, 2, 0]


def test_never_pinned_moving_unsealed_or_not_in_memory():
    t = table([(L.SEALED, L.LEVEL_MEMORY, 0, 1.0),               # pinned below
               (L.SEALED, L.LEVEL_MEMORY, L.FLAG_MOVING, 2.0),
               (L.WRITING, L.LEVEL_MEMORY, 0, 3.0), (L.DELETED, L.LEVEL_MEMORY, 0, 4.0),
               (L.SEALED, L.LEVEL_DISK, 0, 5.0), (L.RESERVED, L.LEVEL_MEMORY, 0, 6.0),
               (L.SEALED, L.LEVEL_MEMORY, 0, 7.0)])
    pins = np.array([1, 0, 0, 0, 0, 0, 0])
    assert list(spill_candidates(t, pins)) == [6]
    assert list(spill_candidates(t, pins, exclude=6)) == []


def test_whole_extents_before_objects_carved_from_chunks():
    t = table([(L.SEALED, L.LEVEL_MEMORY, L.FLAG_IN_CHUNK, 1.0), (L.SEALED, L.LEVEL_MEMORY, 0, 9.0),
               (L.SEALED, L.LEVEL_MEMORY, 0, 4.0)])
    assert list(spill_candidates(t, np.zeros(3, int), whole_extents_first=True)) == [2, 1, 0]
    assert list(spill_candidates(t, np.zeros(3, int))) == [0, 2, 1]


def test_watermarks():
    assert watermark_excess(80, 100, 0.9, 0.75) == 0
    assert watermark_excess(90, 100, 0.9, 0.75) == 0
    assert watermark_excess(95, 100, 0.9, 0.75) == 20
