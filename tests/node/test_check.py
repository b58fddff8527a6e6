"""The invariant checker finds each kind of inconsistency, and a healthy store has none.

Each test breaks one thing by hand (with the store frozen, so the spill
process sees none of it), asserts ``check()`` names it, and puts it back.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.meta import layout as L
from shmstore.node.check import frozen

MiB = 1 << 20


@pytest.fixture
def filled(name, tmp_path):
    """A store holding small, large, pickled and spilled objects, its spill process idle."""
    with shmstore.connect(name, capacity="32MiB", spill_dir=str(tmp_path), max_objects=1024) as s:
        s.put("small", np.arange(100))
        s.put("large", np.ones(MiB))
        s.put("dict", {"a": np.zeros(1000), "b": "x"})
        s.put("disk", np.arange(50_000), levels=[Level.DISK])
        with s.open_writer("raw", 1000) as w:
            w.write(b"r" * 1000)
        assert s.check() == []
        yield s


def entry_of(store, key: str) -> tuple[int, int]:
    idx, e, _ = store.kernel.lookup(store.kernel.begin(key), False)
    return idx, store.node_store.layout.entry(idx)


def broken(store, match: str, edit, undo) -> None:
    """Apply ``edit`` with the store frozen, expect a problem matching ``match``, then ``undo`` it."""
    node = store.node_store
    saved = frozen(node, lambda: edit(node.buf, node.layout))
    try:
        problems = store.check()
        assert any(match in p for p in problems), problems
    finally:
        frozen(node, lambda: undo(node.buf, node.layout, saved))
    assert store.check() == []


def test_healthy_store_through_spill_restore_and_clear(name, tmp_path):
    with shmstore.connect(name, capacity="16MiB", spill_dir=str(tmp_path)) as s:
        for i in range(60):  # 60 x 0.8 MiB through 16 MiB: spills in the background
            s.put(f"k{i}", np.full(100_000, i))
            if i % 4 == 0:
                s.delete(f"k{i // 2}", missing_ok=True)
        assert s.check() == []
        assert {i.level for i in s.list()} == {Level.MEMORY, Level.DISK}
        for info in s.list(level=Level.DISK)[:5]:
            s.get(info.key, levels=[Level.MEMORY])
        assert s.check() == []
        s.clear()
        assert s.check() == []
        cap = s.get_capacity()
        assert cap[Level.MEMORY].used == 0 and cap[Level.DISK].used == 0


def test_usage_counter_off(filled):
    def edit(buf, lay):
        soff = lay.stripe_stats(3)
        L.add_stripe_stats(buf, soff, L.LEVEL_MEMORY, 64, 0)
        return soff
    broken(filled, "usage counter", edit, lambda buf, lay, soff: L.add_stripe_stats(buf, soff, L.LEVEL_MEMORY, -64, 0))


def test_entry_out_of_its_chain(filled):
    idx, eoff = entry_of(filled, "small")

    def edit(buf, lay):
        b = filled.node_store.table.bucket_of(idx)
        filled.node_store.table.unlink(idx, b)
        return b
    broken(filled, "in no chain", edit, lambda buf, lay, b: filled.node_store.table.link(idx, b))


def test_leaked_extent(filled):
    def edit(buf, lay):
        rec, _ = filled.node_store.alloc.alloc(4096, 1000)  # owner entry 999 does not name it
        return rec
    broken(filled, "not named back by its owner", edit, lambda buf, lay, rec: filled.node_store.alloc.free(rec))


def test_object_outside_its_extent(filled):
    idx, eoff = entry_of(filled, "large")
    off = L.entry_raw(filled.node_store.meta.mm, eoff)[L.E_OFFSET]

    def edit(buf, lay):
        np.frombuffer(buf, np.uint64, 1, eoff)[0] = off + 4096  # the offset field comes first
        return off

    def undo(buf, lay, off):
        np.frombuffer(buf, np.uint64, 1, eoff)[0] = off
    broken(filled, "not inside its extent", edit, undo)


def test_stray_and_missing_spill_files(filled):
    disk = filled.node_store.levels[Level.DISK].files
    disk.ensure()
    fd = os.open(disk.file(99, 1), os.O_WRONLY | os.O_CREAT, 0o600)  # named as this store names its files
    os.close(fd)
    assert any("99.1 belongs to no object" in p for p in filled.check())
    disk.unlink("99.1")
    idx, eoff = entry_of(filled, "disk")
    gen = L.ENTRY_HEAD.get(filled.node_store.meta.mm, eoff, "gen")
    hidden = os.path.join(disk.path, "hidden")  # no file of this store's (another store's would be tagged)
    os.rename(disk.file(idx, gen), hidden)
    try:
        assert any("is missing" in p for p in filled.check())
    finally:
        os.rename(hidden, disk.file(idx, gen))
    assert filled.check() == []


def test_disk_quota_counter_off(filled):
    def edit(buf, lay):
        old = L.ALLOC.get(buf, "disk_reserved")
        L.ALLOC.set(buf, "disk_reserved", old + 4096)
        return old
    broken(filled, "disk quota counter", edit, lambda buf, lay, old: L.ALLOC.set(buf, "disk_reserved", old))


def test_entry_free_list_broken(filled):
    idx, _ = entry_of(filled, "small")

    def edit(buf, lay):
        cursor = L.entry_cursor(buf)
        L.set_entry_cursor(buf, cursor[0], idx + 1)  # a live entry at the head of the free list
        return cursor
    broken(filled, "entry free list", edit, lambda buf, lay, cursor: L.set_entry_cursor(buf, *cursor))


def test_allocator_bitmap_broken(filled):
    def edit(buf, lay):
        mask = L.ALLOC.get(buf, "bin_mask")
        L.ALLOC.set(buf, "bin_mask", 0)
        return mask
    broken(filled, "bitmap and list disagree", edit, lambda buf, lay, mask: L.ALLOC.set(buf, "bin_mask", mask))


def test_check_from_the_command_line(filled):
    from shmstore.cli import main
    assert main(["--name", filled.name, "check"]) == 0
