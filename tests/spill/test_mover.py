"""The mover (``spill/mover.py``) driven directly, with no spill process running.

A bare node store (``NodeStore.open``: real POSIX shared memory, no spill
process), a real spill directory under ``tmp_path``, the levels opened as the
spill process opens them (``open_levels(node)``, no arena requests), one
client (a ``Kernel`` on a slot of its own) that puts, reads, pins and
deletes, and a ``Mover`` on the same store: what the spill process holds,
without its loop. Each move is checked by its bytes (CRC), the usage
counters, the spill files and the store's own ``check``. A move given up half
way, a mover killed mid-move (a forked child, SIGKILLed) and files no entry
explains must all leave the object whole where it was and nothing behind.
"""
from __future__ import annotations

import os
import signal
import traceback
import zlib

import numpy as np
import pytest

from shmstore import Level
from shmstore.client.kernel import Kernel
from shmstore.config import Config
from shmstore.errors import StorageFullError
from shmstore.levels.registry import open_levels
from shmstore.levels.spillfiles import SpillFiles, incarnation
from shmstore.meta import layout as L
from shmstore.node.check import check
from shmstore.node.nodestore import NodeStore
from shmstore.spill.mover import MoveError, Mover

MiB = 1 << 20
CAPACITY = 32 * MiB
MEM, DISK = Level.MEMORY, Level.DISK


class Bare:
    """A node store with no spill process: its levels (as the spill process opens them), one client and a
    mover."""

    def __init__(self, node: NodeStore) -> None:
        self.node = node
        node.use_levels(open_levels(node))  # no request callback: as the spill process opens them
        self.kernel = Kernel(node, node.register(), "")
        self.mover = Mover(node)

    def put(self, key: str, value: object, level: Level = MEM) -> tuple[int, int, int]:
        """Put ``value`` on ``level``; returns (idx, gen, stored size)."""
        self.kernel.put(key, value, level)
        return self.where(key)

    def where(self, key: str) -> tuple[int, int, int]:
        found = self.kernel.lookup(self.kernel.begin(key), False)
        return found.idx, found.entry.gen, found.entry.size

    def level(self, key: str) -> Level:
        return self.kernel.info(key).level

    def crc(self, key: str) -> int:
        view = self.kernel.get(key)
        try:
            return zlib.crc32(np.ascontiguousarray(view))
        finally:
            del view  # the view pins the object: a pin makes a move give up

    def used(self, level: Level) -> int:
        return self.node.used(int(level))

    def free_memory(self) -> int:
        """The largest free piece of the arena: what an arena extent leaked by a move would shrink."""
        return self.node.levels[MEM].largest_free()

    def files(self) -> list[str]:
        return sorted(self.node.levels[Level.DISK].files.names())

    def moving(self, idx: int) -> bool:
        return bool(L.entry(self.node.buf, self.node.layout.entry(idx)).flags & L.FLAG_MOVING)

    def assert_consistent(self) -> None:
        problems = check(self.node)
        assert not problems, "\n".join(problems)
        assert L.unpack_spill_state(self.node.buf).moving == 0


@pytest.fixture
def bare(name, tmp_path):
    cfg = Config.from_kwargs(name=name, capacity=CAPACITY, disk_capacity=CAPACITY, spill_dir=str(tmp_path),
                             prefault=0)
    node = NodeStore.open(cfg)
    b = None
    try:
        b = Bare(node)
        yield b
    finally:
        if b is not None:
            b.kernel.close()
        node.unlink()
        node.close()


VALUES = {
    "small": np.arange(2000, dtype=np.int32),  # carved from the client's chunk
    "large": np.random.default_rng(3).random(MiB // 2),  # 4 MiB: an extent of its own
}


def other(level: Level) -> Level:
    return DISK if level == MEM else MEM


# ---- a move there and back ------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(VALUES))
def test_spill_and_restore_move_the_bytes_and_the_usage(bare, kind):
    idx, gen, size = bare.put("k", VALUES[kind])
    want, memory = bare.crc("k"), bare.used(MEM)
    assert memory >= size and bare.used(DISK) == 0

    assert bare.mover.spill(idx, gen) == size
    assert bare.level("k") == DISK and bare.crc("k") == want
    assert bare.used(MEM) == memory - size and bare.used(DISK) == size
    assert bare.files() == [f"{idx}.{gen}"]
    assert L.unpack_spill_state(bare.node.buf).spilled == size
    bare.assert_consistent()

    assert bare.mover.restore(idx, gen) == size
    assert bare.level("k") == MEM and bare.crc("k") == want
    assert bare.used(MEM) == memory and bare.used(DISK) == 0
    assert bare.files() == []  # the file goes with the move
    assert L.unpack_spill_state(bare.node.buf).restored == size
    bare.assert_consistent()


def test_a_move_refuses_what_it_must_not_move(bare):
    idx, gen, _ = bare.put("k", VALUES["large"])
    with pytest.raises(MoveError) as exc:
        bare.mover.spill(idx, gen + 1)  # another generation: the object it meant is gone
    assert exc.value.kind == L.ERR_MISSING
    with pytest.raises(MoveError, match="'k' is not on level") as exc:
        bare.mover.restore(idx, gen)  # it is in memory, not on disk
    assert exc.value.kind == L.ERR_MISSING
    bare.kernel.pin("k")
    with pytest.raises(MoveError, match="'k' is pinned") as exc:
        bare.mover.spill(idx, gen)
    assert exc.value.kind == L.ERR_LOCKED
    bare.kernel.unpin("k")
    assert bare.mover.move(idx, gen, MEM) == 0  # already there
    assert bare.level("k") == MEM and bare.files() == [] and bare.used(DISK) == 0
    bare.assert_consistent()


# ---- giving up ---------------------------------------------------------------------------------

@pytest.mark.parametrize("meanwhile", ["pinned", "deleted"])
@pytest.mark.parametrize("start", [MEM, DISK], ids=["spill", "restore"])
def test_a_move_given_up_half_way_leaves_the_object_and_nothing_else(bare, monkeypatch, start, meanwhile):
    """A reader pins the object, or a client deletes it, while the mover copies: the mover gives up at its
    last step (returns 0). The object stays where it was, whole (or is freed, when deleted); the new copy
    goes: no spill file, no arena space, no quota."""
    empty = bare.free_memory()
    idx, gen, size = bare.put("k", VALUES["large"], start)
    want, before, files = bare.crc("k"), bare.free_memory(), bare.files()
    to = other(start)
    dst = bare.node.levels[to]
    copy = dst.write_move

    def copy_then_interfere(*args, **kwargs):
        copy(*args, **kwargs)  # the new copy is complete, the entry not switched yet
        assert bare.moving(idx)
        if meanwhile == "pinned":
            bare.kernel.pin("k")
        else:
            bare.kernel.delete("k")

    monkeypatch.setattr(dst, "write_move", copy_then_interfere)
    assert bare.mover.move(idx, gen, to, expect=start) == 0
    monkeypatch.undo()
    if meanwhile == "pinned":
        assert bare.level("k") == start and bare.crc("k") == want and not bare.moving(idx)
        assert bare.used(start) == size and bare.used(to) == 0
        assert bare.files() == files and bare.free_memory() == before
        bare.kernel.unpin("k")
    else:  # freed by the mover's last step, once its own copy was gone
        assert not bare.kernel.contains("k")
        assert bare.used(MEM) == bare.used(DISK) == 0
        assert bare.files() == [] and bare.free_memory() == empty
    bare.assert_consistent()


def test_a_spill_that_cannot_write_rolls_back_and_says_why(bare):
    """The spill directory cannot be made (a file is where it should be): the spill fails with an I/O error
    naming the object, and leaves it in memory with nothing charged to the disk quota."""
    idx, gen, size = bare.put("k", VALUES["large"])
    want, before = bare.crc("k"), bare.free_memory()
    failures = L.unpack_spill_state(bare.node.buf).failures
    blocker = bare.node.spill_path
    with open(blocker, "w") as f:
        f.write("not a directory")
    try:
        with pytest.raises(MoveError, match=r"cannot spill 'k' \(4\.0 MiB\) from .* to .*") as exc:
            bare.mover.spill(idx, gen)
        assert exc.value.kind == L.ERR_IO
    finally:
        os.unlink(blocker)
    assert bare.level("k") == MEM and bare.crc("k") == want and not bare.moving(idx)
    assert bare.used(DISK) == 0 and bare.free_memory() == before
    assert L.unpack_spill_state(bare.node.buf).failures == failures + 1
    bare.assert_consistent()  # the quota counter equals what the table charges: nothing
    assert bare.mover.spill(idx, gen) == size  # once the directory can be made
    assert bare.crc("k") == want
    bare.assert_consistent()


class DeviceError(RuntimeError):
    """What CuPy raises for a CUDA error (``CUDARuntimeError`` is a ``RuntimeError``), made here without CuPy."""


ERRORS = {"cuda-error": DeviceError("cudaErrorIllegalAddress: an illegal memory access was encountered"),
          "no-cupy": AttributeError("'NoneType' object has no attribute 'cuda'")}


@pytest.mark.parametrize("error", sorted(ERRORS))
@pytest.mark.parametrize("where", ["placing", "copying"])
@pytest.mark.parametrize("start", [MEM, DISK], ids=["spill", "restore"])
def test_a_move_that_fails_with_any_error_gives_up_cleanly_and_logs_it(bare, monkeypatch, caplog, start, where,
                                                                        error):
    """Issue 23: a device error in the middle of a move (CUDA's errors are RuntimeErrors; AttributeError where
    CuPy is missing) escaped the mover, which caught only OSError: the entry stayed MOVING with its target
    extent, the spill state's moving slot set, and nothing could free or move it again. Now any error placing
    or copying the new copy gives up: the object whole where it was, the target's space and charge gone, the
    moving slot cleared, a MoveError naming the object, its size and the error, and the traceback logged."""
    idx, gen, size = bare.put("k", VALUES["large"], start)
    want, before, files = bare.crc("k"), bare.free_memory(), bare.files()
    failures = L.unpack_spill_state(bare.node.buf).failures
    to, exc = other(start), ERRORS[error]
    dst = bare.node.levels[to]
    seen = []

    if where == "placing":
        def place_and_fail(*args):
            seen.append(bare.moving(idx))  # flagged and charged: the new copy's space is next
            raise exc
        monkeypatch.setattr(dst, "space_for_move", place_and_fail)
    else:
        copy = dst.write_move

        def copy_and_fail(i, g, off, buf, n, progress):
            def report(done):  # the copy under way, part of the bytes written: the device fails
                progress(done)
                seen.append(bare.moving(idx) and L.unpack_spill_state(bare.node.buf).moving == idx + 1)
                raise exc
            copy(i, g, off, buf, n, report)
        monkeypatch.setattr(dst, "write_move", copy_and_fail)

    with caplog.at_level("ERROR", logger="shmstore.spill"), pytest.raises(MoveError) as info:
        bare.mover.move(idx, gen, to, expect=start)
    monkeypatch.undo()
    assert seen and all(seen)
    assert info.value.kind == L.ERR_IO
    verb = "spill" if start == MEM else "restore"
    assert f"cannot {verb} 'k' (4.0 MiB) from {start} to {to}: {type(exc).__name__}: " in str(info.value)
    assert f"(the object stays on {start})" in str(info.value)
    assert [r.exc_info[1] for r in caplog.records if r.exc_info] == [exc]
    assert bare.level("k") == start and bare.crc("k") == want and not bare.moving(idx)
    assert bare.used(start) == size and bare.used(to) == 0
    assert bare.files() == files and bare.free_memory() == before  # no spill file, no arena extent left
    state = L.unpack_spill_state(bare.node.buf)
    assert state.moving == 0 and state.failures == failures + (where == "copying")
    bare.assert_consistent()
    assert bare.mover.move(idx, gen, to, expect=start) == size  # movable again
    assert bare.crc("k") == want
    bare.assert_consistent()


def test_a_restore_with_no_room_gives_up_and_keeps_the_object_on_disk(bare):
    """Memory is full of pinned objects: a restore cannot make room (it would spill them) and gives up with
    ERR_FULL naming the setting; once they are unpinned it spills the oldest of them to make room."""
    idx, gen, size = bare.put("k", VALUES["large"], DISK)
    want, pinned = bare.crc("k"), []
    try:
        for i in range(CAPACITY // MiB):
            bare.kernel.put(f"p{i}", np.full(MiB // 8 * 3, i))  # 3 MiB each, till memory is full
            bare.kernel.pin(f"p{i}")
            pinned.append(f"p{i}")
    except StorageFullError:
        pass
    before = bare.free_memory()
    assert before < size
    with pytest.raises(MoveError, match="capacity") as exc:
        bare.mover.restore(idx, gen)
    assert exc.value.kind == L.ERR_FULL
    assert bare.level("k") == DISK and bare.crc("k") == want and not bare.moving(idx)
    assert bare.files() == [f"{idx}.{gen}"] and bare.used(DISK) == size and bare.free_memory() == before
    bare.assert_consistent()
    for key in pinned:
        bare.kernel.unpin(key)
    assert bare.mover.restore(idx, gen) == size  # made room by spilling the least recently used
    assert bare.level("k") == MEM and bare.crc("k") == want
    assert any(bare.level(key) == DISK for key in pinned)
    bare.assert_consistent()


# ---- a mover killed mid-move, and recovery ------------------------------------------------------

POINTS = ["charging", "charged", "copying", "copied", "switched"]


def _kill_here(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(node: NodeStore, start: Level, to: Level, point: str) -> None:
    """In the child: SIGKILL it at ``point`` of a move from ``start`` to ``to``."""
    src, dst = node.levels[start], node.levels[to]
    if point == "charging":  # inside the ALLOC section that charges the move, before the flag: both locks held
        charge = dst.charge_move_locked
        dst.charge_move_locked = lambda *a: (charge(*a), _kill_here())
    elif point == "charged":  # flagged and charged, the new space placed, nothing copied
        space = dst.space_for_move
        dst.space_for_move = lambda *a: (space(*a), _kill_here())[0]
    elif point == "copying":  # at the first progress report: the copy begun, not finished
        copy = dst.write_move
        dst.write_move = lambda idx, gen, off, buf, size, progress: copy(
            idx, gen, off, buf, size, _kill_here)
    elif point == "copied":  # the new copy complete, the entry not switched
        copy = dst.write_move
        dst.write_move = lambda *a: (copy(*a), _kill_here())
    else:  # the entry switched, the old copy not dropped yet (the stripe lock held)
        src.drop = _kill_here


def run_killed_mover(cfg: Config, idx: int, gen: int, start: Level, to: Level, point: str) -> None:
    """Fork a child that opens the store as the spill process does and moves entry ``idx`` with a Mover of
    its own, SIGKILLed at ``point``; returns once it is dead (fails if it was not killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            node = NodeStore.open(cfg, create=False)
            node.use_levels(open_levels(node))
            _arm(node, start, to, point)
            Mover(node).move(idx, gen, to, expect=start)
            os.write(w, b"the move finished: not killed")
        except BaseException:
            os.write(w, traceback.format_exc().encode())
        finally:
            os._exit(1)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, out


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("start", [MEM, DISK], ids=["spill", "restore"])
def test_recover_rolls_back_a_mover_killed_mid_move(bare, start, point):
    """A mover SIGKILLed at each step of a move leaves a half-done move (a lock held, a moving entry, a
    charge, a new copy, or a stray old one); ``recover`` rolls it back (or, once the entry was switched,
    removes the stray): the object whole on one level, usage and quota exact, no file or arena space left
    over."""
    empty = bare.free_memory()
    idx, gen, size = bare.put("k", VALUES["large"], start)
    want, before = bare.crc("k"), bare.free_memory()
    to = other(start)
    run_killed_mover(bare.node.cfg, idx, gen, start, to, point)

    switched, flagged = point == "switched", point not in ("charging", "switched")
    assert bare.moving(idx) == flagged  # the child died where it was meant to
    if point == "copying" and to == DISK:
        assert bare.files() == [f"{idx}.{gen}.tmp"]
    if point == "copied" and to == DISK:
        assert bare.files() == [f"{idx}.{gen}"]  # published, but the entry still names memory
    if switched and start == DISK:
        assert bare.files() == [f"{idx}.{gen}"]  # the old copy, of an object now in memory
        assert any("belongs to no object" in p for p in check(bare.node))
    if to == MEM and flagged:
        assert bare.free_memory() < before  # the new copy's space is placed

    assert bare.mover.recover() == int(flagged)  # the dead holder's locks repaired as they are taken
    now = to if switched else start
    assert bare.level("k") == now and not bare.moving(idx) and bare.crc("k") == want
    assert bare.used(now) == size and bare.used(other(now)) == 0
    assert bare.files() == ([f"{idx}.{gen}"] if now == DISK else [])
    if now == DISK:
        assert bare.free_memory() == empty  # the object's arena space freed, the aborted copy's too
    elif start == MEM:
        assert bare.free_memory() == before  # the new copy's space given back
    else:
        assert bare.free_memory() < before  # restored: the object's own extent
    bare.assert_consistent()
    assert bare.mover.move(idx, gen, other(now)) == size  # movable again
    assert bare.crc("k") == want
    bare.assert_consistent()


def test_recover_removes_the_files_no_entry_explains_and_only_this_stores(bare):
    """Files of this store that no entry explains (a killed writer's ``.tmp``, a file of a freed entry, one
    of an other generation of a live entry) go; the object's own file, another incarnation's files (a
    newer store under the same name keeps its files beside ours, see ``levels/spillfiles.py``) and files that
    are not shmstore's stay."""
    idx, gen, _ = bare.put("k", VALUES["large"], DISK)
    want = bare.crc("k")
    mine = bare.node.levels[Level.DISK].files
    data = [(0, memoryview(b"x" * 4096))]
    free = next(i for i in range(bare.node.layout.max_objects) if i != idx)
    mine.write(free, 1, data, 4096)  # a file of an entry that is free
    mine.write(idx, gen + 1, data, 4096)  # another generation of a live entry
    os.close(mine.create_tmp(free, 2))  # a writer's half-written file
    theirs = SpillFiles(mine.root, mine.folder, incarnation(os.getpid() + 1, 1.0))  # another incarnation
    theirs.write(free, 1, data, 4096)
    theirs.close()
    foreign = os.path.join(mine.path, "notes.txt")
    with open(foreign, "w") as f:
        f.write("not shmstore's")
    assert len(bare.files()) == 4
    assert len([p for p in check(bare.node) if "belongs to no object" in p]) == 3

    assert bare.mover.recover() == 0  # no move to roll back
    assert bare.files() == [f"{idx}.{gen}"] and bare.crc("k") == want
    other_files = sorted(set(os.listdir(mine.path)) - {f"{mine.tag}.{idx}.{gen}"})
    assert other_files == sorted([f"{theirs.tag}.{free}.1", "notes.txt"])
    bare.assert_consistent()
    os.unlink(foreign)
    os.unlink(os.path.join(mine.path, f"{theirs.tag}.{free}.1"))
