"""The arena allocator on a plain bytearray: tiling, coalescing, reuse, rebuild."""
from __future__ import annotations

import random

import pytest

import shmstore
from shmstore.meta import layout as L
from shmstore.meta.alloc import Allocator

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


def test_rebuild_keeps_the_record_numbers_of_kept_extents(alloc):
    """Other processes hold the record numbers of extents they own: a rebuild must not renumber them."""
    recs = []
    for i in range(20):
        rec, off = alloc.alloc(1000 * (i + 1), i + 1)
        recs.append((rec, off, alloc.size_of(rec)))
    alloc.free(recs[5][0])
    keep = recs[::2]
    alloc.rebuild([r for r, _, _ in keep])
    used = {r: (off, size) for r, off, size in keep}
    check_tiling(alloc, used)
    for r, off, size in keep:  # the same record, the same extent
        x = L.extent_raw(alloc._buf, alloc._layout.extent(r))
        assert (x[0], x[1], x[6]) == (off, size, L.EXT_USED)
    for r, _, _ in keep:
        alloc.free(r)
    assert alloc.free_extents() == [(0, CAP)]
    again = [alloc.alloc(4096, 100 + i)[0] for i in range(50)]  # the records freed by the rebuild are reusable
    assert len(set(again)) == 50 and 0 not in again


def test_free_owned_frees_only_what_its_owner_holds(alloc):
    rec, _ = alloc.alloc(4096, 7)
    assert alloc.free_owned(rec, 8) == 0 and alloc.free_owned(0, 7) == 0
    assert alloc.free_owned(rec, 7) == 4096
    assert alloc.free_owned(rec, 7) == 0  # freed already: no double free
    assert alloc.free_extents() == [(0, CAP)]


def test_double_free_is_refused(alloc):
    rec, _ = alloc.alloc(64, 1)
    alloc.free(rec)
    with pytest.raises(shmstore.LayoutError):
        alloc.free(rec)


def test_an_object_taking_a_high_hole_whole_moves_the_frontier(alloc):
    """Regression (found by tests/levels/test_conformance.py): an exact fit never moved the frontier, so check()
    saw an object beyond it."""
    buf = alloc._buf
    small, _ = alloc.alloc(4096, 1)
    x = 1 << 20
    top, top_off = alloc.alloc(x, -1, L.EXT_CHUNK)
    alloc.alloc(x, -2, L.EXT_CHUNK)
    assert L.ALLOC.get(buf, "frontier") == 4096
    alloc.free(top)  # a hole of exactly x at the very top
    rec, off = alloc.alloc(x, 2)
    assert off == top_off and L.ALLOC.get(buf, "frontier") == off + x


def test_gpu_arenas_share_the_records_but_never_space_and_survive_a_rebuild():
    """GPU arenas (device memory of the GPU level) are cut by the same allocator: same records, bins of
    their own, offsets in their own range; a rebuild after a crash recreates every arena's free space."""
    lay = L.Layout(max_objects=512, max_clients=4, nstripes=4)
    buf = bytearray(lay.size)
    mem = Allocator(buf, lay, CAP)
    mem.init()
    gpus = [Allocator(buf, lay, (4 + d) << 20, gpu=d) for d in (0, 3)]
    for g in gpus:
        g.init_arena()
    arenas = [mem, *gpus]
    rng = random.Random(11)
    used: dict[int, tuple[int, int, int]] = {}  # record -> (arena index, offset, size)
    owner = 0
    for _ in range(2000):
        i = rng.randrange(len(arenas))
        a = arenas[i]
        if used and rng.random() < 0.45:
            rec = rng.choice(list(used))
            arenas[used.pop(rec)[0]].free(rec)
            continue
        owner += 1
        rec, off = a.alloc(rng.choice([64, 4096, 100_000, 1 << 20]), owner)
        if rec:
            assert a.base <= off < a.base + a.capacity
            used[rec] = (i, off, a.size_of(rec))
    for _ in range(2):  # as allocated, then as rebuilt after a crash
        for i, a in enumerate(arenas):
            mine = sorted((off, size) for j, off, size in used.values() if j == i)
            spans = sorted(mine + a.free_extents())
            pos = a.base
            for off, size in spans:
                assert off == pos, f"arena {i}: gap or overlap at {pos}"
                pos = off + size
            assert pos == a.base + a.capacity
        mem.rebuild(list(used), gpus)
