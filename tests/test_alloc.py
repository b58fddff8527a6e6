"""The arena allocator on a plain bytearray: tiling, coalescing, reuse, rebuild."""
from __future__ import annotations

import random

import pytest

from shmstore.kernel import layout as L
from shmstore.kernel.alloc import Allocator

CAP = 1 << 24


@pytest.fixture
def alloc():
    lay = L.Layout(max_objects=512, max_clients=4, nstripes=4)
    a = Allocator(bytearray(lay.size), lay, CAP)
    a.init()
    return a


def check_tiling(a: Allocator, used: dict[int, tuple[int, int]]) -> None:
    spans = sorted(list(used.values()) + a.free_extents())
    pos = 0
    for off, size in spans:
        assert off == pos, f"gap or overlap at {pos}: next extent at {off}"
        assert off % L.ALIGN == 0
        pos = off + size
    assert pos == CAP
    free = a.free_extents()
    for (o1, s1), (o2, _) in zip(free, free[1:]):
        assert o1 + s1 < o2, "adjacent free extents were not coalesced"


def test_random_alloc_free_keeps_the_arena_tiled(alloc):
    rng = random.Random(7)
    used: dict[int, tuple[int, int]] = {}
    for step in range(3000):
        if used and (rng.random() < 0.45 or len(used) > 400):
            rec = rng.choice(list(used))
            alloc.free(rec)
            del used[rec]
        else:
            size = rng.choice([1, 64, 100, 4096, 70000, 1 << 20])
            rec, off = alloc.alloc(size, step + 1)
            if rec:
                used[rec] = (off, alloc.size_of(rec))
                assert alloc.size_of(rec) >= size
        if step % 250 == 0:
            check_tiling(alloc, used)
    for rec in list(used):
        alloc.free(rec)
    assert alloc.free_extents() == [(0, CAP)]


def test_freed_space_is_reused_before_fresh_space(alloc):
    r1, o1 = alloc.alloc(1 << 20, 1)
    alloc.alloc(4096, 2)
    alloc.free(r1)
    r3, o3 = alloc.alloc(1 << 19, 3)
    assert o3 == o1, "a freed hole that fits should be reused"


def test_full_arena_returns_nothing(alloc):
    rec, _ = alloc.alloc(CAP, 1)
    assert rec
    assert alloc.alloc(64, 2) == (0, 0)
    alloc.free(rec)
    assert alloc.alloc(CAP + 64, 3) == (0, 0)


def test_rebuild_from_live_extents(alloc):
    live = []
    for i in range(20):
        rec, off = alloc.alloc(1000 * (i + 1), i + 1)
        live.append((off, alloc.size_of(rec), i + 1, L.EXT_USED))
    keep = live[::2]
    owners = alloc.rebuild(keep)
    assert set(owners) == {o for _, _, o, _ in keep}
    used = {owners[o]: (off, size) for off, size, o, _ in keep}
    check_tiling(alloc, used)
    for rec in owners.values():
        alloc.free(rec)
    assert alloc.free_extents() == [(0, CAP)]


def test_double_free_is_refused(alloc):
    rec, _ = alloc.alloc(64, 1)
    alloc.free(rec)
    with pytest.raises(RuntimeError):
        alloc.free(rec)
