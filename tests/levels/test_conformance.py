"""The level conformance suite: the same tests for every registered level.

A level is a module plus a line in ``shmstore/levels/registry.py``; these
tests are what it must pass, in two parts:

- on a bare metadata segment: the level built by ``open_levels`` from a node
  store that no client uses and no spill process serves (its
  ``LevelHost``), and the protocol driven directly: place, write, view,
  sink, free, and the level's own check, recount and recovery;
- through a real store, with the level as the only one allowed
  (``levels=[level]``); moves run to and from every other level.

A level this machine cannot use (GPU without CuPy or a device) is skipped
with the level's own reason.
"""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import shmstore
from shmstore.config import Config
from shmstore.levels.protocol import DeviceLevel, MovableLevel, StorageLevel
from shmstore.levels.registry import DEVICE_LEVELS, LEVELS, open_levels
from shmstore.meta import layout as L
from shmstore.node import serialize
from shmstore.node.check import check
from shmstore.node.janitor import release_all
from shmstore.node.nodestore import NodeStore
from shmstore.node.protocols import PutContext
from shmstore.node.supplies import ClientSupply

from helpers import Child, wait_for

MiB = 1 << 20
CAPACITY = 32 * MiB


ALL = sorted({*LEVELS, *DEVICE_LEVELS})


@pytest.fixture(params=ALL, ids=lambda lv: lv.name.lower())
def level(request):
    return request.param


class Bare:
    """A node store's bare metadata with its levels opened on it (this process makes the device arenas) and
    one client slot, as the protocol's callers hold it."""

    def __init__(self, node, slot):
        self.node, self.slot = node, slot
        # what a put hands a level: this client's slot and supply (no C operations: the general way)
        self.client = PutContext(slot, ClientSupply(node, slot), None, node.prefault, node.stripes)

    def reserve(self, key: str) -> tuple[int, int]:
        return self.client.supply.take_entry(key)

    def place(self, lv, key: str, size: int) -> tuple[int, int, int, int, int]:
        """Place ``size`` bytes for a new entry as a put does (the entry names its space from the start);
        returns (idx, gen, offset, extent, flags)."""
        idx, gen = self.reserve(key)
        eoff = self.node.layout.entry(idx)
        with self.node.stripe_of(idx):
            def write_entry(off, rec, flags):
                L.ENTRY_HEAD.pack(self.node.buf, eoff, offset=off, extent=rec, flags=flags, size=size, nbytes=size,
                                  level=int(lv.level))
            off, rec, flags = lv.place(key, idx, gen, size, self.client, write_entry)
        return idx, gen, off, rec, flags

    def free(self, lv, idx: int) -> None:
        """Free a placed entry as ``NodeStore.release`` does: bytes outside the table first, then the space."""
        node = self.node
        with node.stripe_of(idx):
            e = L.entry(node.buf, node.layout.entry(idx))
            lv.drop(idx, e)
            with node.alloc_lock:
                lv.free_locked(idx, e)
                node.table.release_entry(idx, free_extent=False)


@pytest.fixture
def bare(name, tmp_path, level):
    cfg = Config.from_kwargs(name=name, capacity=CAPACITY, disk_capacity=CAPACITY, gpu_capacity=CAPACITY,
                             spill_dir=str(tmp_path), prefault=0)
    node = NodeStore.open(cfg)
    try:
        node.use_levels(open_levels(node))
        why = node.levels[level].available()
        if why:
            pytest.skip(f"{level} is not available here: {why}")
        b = Bare(node, node.register())
        yield b
        assert check(node) == []
        release_all(node, b.slot)
        node.deregister(b.slot)
    finally:
        node.unlink()
        node.close()


def host_bytes(buf, off: int, n: int) -> bytes:
    """The bytes a level's ``view`` gave, on the host (a device array comes back through ``get``)."""
    if hasattr(buf, "__cuda_array_interface__"):
        return bytes(buf[off: off + n].get()) if n else b""
    return bytes(memoryview(buf)[off: off + n]) if n else b""


# ---- on a bare metadata segment: the protocol itself ---------------------------------------

def test_bare_levels_are_built_from_the_host_alone(bare, level):
    lv = bare.node.levels[level]
    assert isinstance(lv, StorageLevel) and isinstance(lv, MovableLevel) and lv.level == level
    assert (level in bare.node.devices) == (level in DEVICE_LEVELS)
    if level in DEVICE_LEVELS:
        assert isinstance(bare.node.devices[level], DeviceLevel)
    assert lv.setting and lv.total() > 0
    high, low = lv.watermarks()
    assert 0 < low <= high <= 1
    assert lv.spill_to is None or lv.spill_to > level  # spills go to slower levels
    assert lv.check(L.entry_table(bare.node.buf, bare.node.layout).copy()) == []


@pytest.mark.parametrize("size", [0, 1000, 3 * MiB + 17])
def test_bare_place_write_view_free(bare, level, size):
    lv = bare.node.levels[level]
    before = lv.largest_free()
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    enc = serialize.encode(data)
    idx, gen, off, rec, flags = bare.place(lv, "k", enc.size)
    lv.write(idx, gen, off, flags, enc, "k")
    buf, at = lv.view(idx, gen, off, enc.size)
    assert host_bytes(buf, at, enc.size) == data
    del buf
    bare.free(lv, idx)
    if not flags & L.FLAG_IN_CHUNK:  # a cut of the client's chunk goes back with the chunk
        assert lv.largest_free() == before


def test_bare_sink_fills_the_placement(bare, level):
    lv = bare.node.levels[level]
    data = bytes(range(256)) * 4096
    idx, gen, off, rec, flags = bare.place(lv, "w", len(data))
    sink = lv.sink(idx, gen, off, len(data), "w")
    for pos in range(0, len(data), 100_000):
        sink.write(data[pos: pos + 100_000], pos)
    sink.close()
    buf, at = lv.view(idx, gen, off, len(data))
    assert host_bytes(buf, at, len(data)) == data
    del buf
    bare.free(lv, idx)


def test_bare_unplace_gives_the_space_back(bare, level):
    lv = bare.node.levels[level]
    before = lv.largest_free()
    idx, gen, off, rec, flags = bare.place(lv, "u", 2 * MiB)
    lv.unplace(idx, rec, flags)
    bare.free(lv, idx)  # an entry that was never made: nothing of it is left on the level
    assert lv.largest_free() == before


def test_bare_full_names_the_level_and_places_nothing(bare, level):
    lv = bare.node.levels[level]
    idx, gen = bare.reserve("big")
    with bare.node.stripe_of(idx), pytest.raises(shmstore.StorageFullError) as exc:
        lv.place("big", idx, gen, lv.total() + MiB, bare.client, lambda off, rec, flags: None)
    assert exc.value.level == level and lv.setting.split()[0] in str(exc.value)
    bare.client.supply.entries.append((idx, gen))


def test_bare_orphans_are_what_no_entry_explains(bare, level):
    """Bytes written for an entry that was never made (a put killed before it wrote its entry) are orphans:
    ``remove_orphans`` takes them (files; an arena's space is the allocator's); ``recount_locked`` then
    derives the level's counters from the table again, and nothing died here, so ``drop_lost`` drops
    nothing."""
    lv = bare.node.levels[level]
    idx, gen, off, rec, flags = bare.place(lv, "k", 4096)
    lv.write(idx, gen, off, flags, serialize.encode(b"x" * 4096), "k")
    removed = lv.remove_orphans()
    assert removed in (0, 1)
    if removed:
        with pytest.raises(OSError):
            lv.view(idx, gen, off, 4096)
    else:  # nothing of it outside the arena: it stays readable until its space is freed
        buf, at = lv.view(idx, gen, off, 4096)
        assert host_bytes(buf, at, 4096) == b"x" * 4096
        del buf
    assert lv.drop_lost() == 0
    bare.free(lv, idx)
    with bare.node.alloc_lock:
        lv.recount_locked(L.entry_table(bare.node.buf, bare.node.layout))
    assert lv.check(L.entry_table(bare.node.buf, bare.node.layout).copy()) == []


def test_bare_move_onto_the_level_then_abort_leaves_nothing(bare, level):
    """The steps of a move onto the level, as the mover takes them (charge, space, copy), then the roll back
    of one that must give up: the level's space and charge come back, the entry stops moving, and no byte of
    the copy is left (check() at the end)."""
    lv, node = bare.node.levels[level], bare.node
    data = np.random.default_rng(7).integers(0, 256, 2 * MiB + 5, dtype=np.uint8)
    before = lv.largest_free()
    idx, gen = bare.reserve("m")
    eoff = node.layout.entry(idx)
    with node.stripe_of(idx):
        L.ENTRY_HEAD.pack(node.buf, eoff, size=data.nbytes, nbytes=data.nbytes, flags=L.FLAG_MOVING,
                          target=int(level))
        e = L.entry(node.buf, eoff)
        with node.alloc_lock:
            lv.charge_move_locked(idx, e)
    off, rec = lv.space_for_move(idx, data.nbytes)
    seen = []
    lv.write_move(idx, gen, off, data, data.nbytes, seen.append)
    assert seen and seen[-1] == data.nbytes
    buf, at = lv.view(idx, gen, off, data.nbytes)
    assert host_bytes(buf, at, data.nbytes) == data.tobytes()
    del buf
    with node.stripe_of(idx):
        lv.abort_move(idx, L.entry(node.buf, eoff))
        assert not L.entry(node.buf, eoff).flags & L.FLAG_MOVING
        with node.alloc_lock:
            node.table.release_entry(idx, free_extent=False)  # never on the level: nothing of it to free
    assert lv.largest_free() == before


# ---- through a real store ---------------------------------------------------------------


@pytest.fixture
def lstore(name, tmp_path, level):
    """A store with every level sized at CAPACITY (the GPU level too: unsized, its arena would take half the
    device, and ``total()`` reads 0 until it is made), skipping a level this process cannot use."""
    with shmstore.connect(name, capacity=CAPACITY, disk_capacity=CAPACITY, gpu_capacity=CAPACITY,
                          spill_dir=str(tmp_path), prefault="8MiB") as s:
        why = s.node_store.levels[level].available()
        if why:
            pytest.skip(f"{level} is not available here: {why}")
        yield s


def used(store, level) -> int:
    return store.get_capacity()[level].used


VALUES = {
    "bytes": b"\x01\x02" * 5000,
    "empty-bytes": b"",
    "array": np.arange(100_000, dtype=np.float32).reshape(100, 1000),
    "fortran": np.asfortranarray(np.arange(600).reshape(20, 30)),
    "empty-array": np.empty((0, 3)),
    "state-dict": {"w": np.ones((64, 64)), "b": np.zeros(64), "step": 3, "none": None},
    "large": np.arange(2 * MiB, dtype=np.uint8),
}


def same(a, b) -> bool:
    """``a`` (what was put, on the host) equals ``b`` (what came back); a device array is compared on the host
    (numpy's ``array_equal`` over a CuPy array goes to CuPy, which refuses a numpy operand with TypeError)."""
    if hasattr(b, "__cuda_array_interface__"):
        b = b.get()
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (bytes, bytearray)):
        return bytes(a) == bytes(b)
    return bool(a == b)


def test_implements_the_protocol(lstore, level):
    lv = lstore.node_store.levels[level]
    assert isinstance(lv, StorageLevel) and lv.level == level
    assert lv.total() == CAPACITY and lv.setting
    assert lv.spill_to is None or lv.spill_to > level  # spills go to slower levels


@pytest.mark.parametrize("kind", sorted(VALUES))
def test_put_get_delete_round_trip(lstore, level, kind):
    value = VALUES[kind]
    info = lstore.put("k", value, levels=[level])
    assert info.level == level and lstore.get_info("k").level == level
    assert same(value, lstore.get("k"))
    assert used(lstore, level) == info.stored
    lstore.delete("k")
    assert "k" not in lstore and used(lstore, level) == 0
    assert lstore.check() == []


def test_views_stay_valid_after_delete_until_dropped(lstore, level):
    lstore.put("k", np.arange(50_000), levels=[level])
    view = lstore.get("k")
    part = lstore.get("k", conditions=(slice(10, 20),))
    lstore.delete("k")
    assert int(view.sum()) == sum(range(50_000)) and list(part) == list(range(10, 20))
    assert used(lstore, level) > 0  # held by the views
    del view, part
    assert wait_for(lambda: used(lstore, level) == 0, timeout=5)
    assert lstore.check() == []


def test_writer_and_reader(lstore, level):
    data = np.random.default_rng(1).integers(0, 256, 3 * MiB + 17, dtype=np.uint8).tobytes()
    with lstore.open_writer("w", len(data), levels=[level]) as w:
        for pos in range(0, len(data), 1 * MiB):
            w.write(data[pos: pos + MiB])
    assert lstore.get_info("w").level == level
    with lstore.open_reader("w") as r:
        assert r.read() == data
    w = lstore.open_writer("dropped", 1000, levels=[level])
    w.write(b"x" * 10)
    w.abort()
    assert "dropped" not in lstore and used(lstore, level) == lstore.get_info("w").stored
    assert lstore.check() == []


def test_full_level_names_itself_and_the_setting(lstore, level):
    lv = lstore.node_store.levels[level]
    with pytest.raises(shmstore.StorageFullError) as exc:
        lstore.put("big", np.zeros(CAPACITY + MiB, np.uint8), levels=[level])
    assert exc.value.level == level and lv.setting.split()[0] in str(exc.value)
    assert "big" not in lstore and used(lstore, level) == 0 and lstore.check() == []


def test_overwrite_replaces_on_the_level(lstore, level):
    lstore.put("k", np.zeros(1000), levels=[level])
    old = lstore.get("k")
    lstore.put("k", np.ones(3000), levels=[level], overwrite=True)
    assert lstore.get("k").sum() == 3000 and old.sum() == 0
    del old
    assert wait_for(lambda: used(lstore, level) == lstore.get_info("k").stored, timeout=5)
    assert lstore.check() == []


def test_moves_to_and_from_every_other_level(lstore, level):
    value = {"a": np.arange(300_000), "b": b"raw" * 100}
    lstore.put("k", value, levels=[level])
    stored = lstore.get_info("k").stored
    for other in ALL:
        if other == level or lstore.node_store.levels[other].available():
            continue
        assert lstore.move("k", other).level == other
        assert same(value, lstore.get("k"))
        assert used(lstore, other) == stored and used(lstore, level) == 0
        assert lstore.move("k", level).level == level
        assert same(value, lstore.get("k")) and used(lstore, other) == 0
        assert lstore.check() == []


def test_get_with_levels_brings_the_object_here(lstore, level):
    for other in ALL:
        if other == level or lstore.node_store.levels[other].available():
            continue
        lstore.put(f"from-{other}", np.full(1000, 5), levels=[other])
        got = lstore.get(f"from-{other}", levels=[level])
        assert got.sum() == 5000 and lstore.get_info(f"from-{other}").level == level
    assert lstore.check() == []


def test_a_pinned_object_never_moves(lstore, level):
    lstore.put("k", np.arange(1000), levels=[level])
    lstore.pin("k")
    for other in ALL:
        if other != level and not lstore.node_store.levels[other].available():
            with pytest.raises(shmstore.ObjectLockedError):
                lstore.move("k", other)
    lstore.unpin("k")
    assert lstore.get_info("k").level == level


def test_spill_policy_keeps_the_level_under_its_high_watermark(lstore, level):
    lv = lstore.node_store.levels[level]
    if lv.spill_to is None:
        pytest.skip(f"{level} spills nowhere (the last level)")
    high, _ = lv.watermarks()
    n = int(CAPACITY * 1.5 // MiB)  # more than the level holds: the rest must spill
    for i in range(n):
        lstore.put(f"o{i}", np.full(MiB // 8, i, np.int64), levels=[level, lv.spill_to])
    assert wait_for(lambda: used(lstore, level) <= high * CAPACITY, timeout=20), lstore.get_capacity()
    for i in range(n):  # every object intact, wherever it went
        assert int(lstore.get(f"o{i}")[0]) == i
    assert {lstore.get_info(f"o{i}").level for i in range(n)} == {level, lv.spill_to}
    assert lstore.check() == []


WRITER = """
import os, sys, shmstore
from shmstore import Level
s = shmstore.connect(os.environ['N'], spill_dir=os.environ['D'])
w = s.open_writer('half', 4 << 20, levels=[Level(int(os.environ['L']))])
w.write(b'x' * (1 << 20))
print('half', flush=True)
sys.stdin.readline()
"""


def test_killed_writer_gives_the_space_back(lstore, level, tmp_path):
    child = Child(WRITER, env={"N": lstore.name, "D": str(tmp_path), "L": str(int(level))})
    assert child.readline() == "half"
    assert used(lstore, level) >= 4 * MiB and "half" not in lstore
    os.kill(child.pid, signal.SIGKILL)
    child.kill()
    assert wait_for(lambda: used(lstore, level) == 0, timeout=15), lstore.get_capacity()
    assert lstore.check() == []
