"""Processes killed at every step of an operation: the store stays consistent, the operation all or nothing.

A forked child connects, then runs one operation under a line tracer that
SIGKILLs it at the N-th line of shmstore code it executes; N runs over every
line of the operation (or a stride of them). After each death the janitor
reclaims the child, ``store.check()`` must find nothing wrong, usage must
equal what the objects hold, and the object must be either intact or
absent (put) / absent or intact (delete) - never a ghost, never other bytes.
The spill process's moves are killed the same way, then rolled back by a
new spill process.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.levels.registry import open_levels
from shmstore.meta import layout as L
from shmstore.meta.table import find_entry
from shmstore.node.nodestore import NodeStore

from ._sweeps import PKG, _child_store, assert_consistent, crc_of, kill_points, settle, values
from helpers import spill_running, wait_for

pytestmark = pytest.mark.slow

MiB = 1 << 20


def _arm(stop_at: int) -> list[int]:
    """Trace this process: SIGKILL itself at the ``stop_at``-th line executed in shmstore."""
    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] >= stop_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return local

    def glob(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(PKG) else None

    sys.settrace(glob)
    return count


def run_killed(prepare, op, stop_at: int) -> int:
    """Fork: ``ctx = prepare()``, then ``op(ctx)`` killed at line ``stop_at``.

    Returns the number of traced lines the op ran (when it finished), or -1
    when it was killed.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            ctx = prepare()
            count = _arm(stop_at)
            op(ctx)
            sys.settrace(None)
            os.write(w, str(count[0]).encode())
            code = 0
        except BaseException:
            sys.settrace(None)
            os.write(w, traceback.format_exc().encode())  # pytest captures this process's stderr: lost
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return -1
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child failed (status {status}):\n{out}"
    return int(out)


# a move's kill point costs a spill process start (~0.3 s): 20 a run, each run from a random start of the stride
MOVE_POINTS = int(os.environ.get("SHMSTORE_CRASH_POINTS", "20"))


def sweep(store, prepare, op, verify, max_points: int | None = None) -> int:
    """Kill ``op`` at every traced line (or a stride of them); verify after each. Returns kill points tried."""
    total = run_killed(prepare, op, 1 << 60)  # how long the op is, run to its end
    assert total > 0
    settle(store)
    verify(finished=True)
    tried = 0
    for stop in kill_points(total, max_points):
        finished = run_killed(prepare, op, stop) >= 0
        settle(store)
        try:
            assert_consistent(store)
            verify(finished=finished)
        except AssertionError as exc:
            raise AssertionError(f"killed at line {stop} of {total}: {exc}") from None
        tried += 1
    return tried


@pytest.mark.parametrize("kind", ["small", "dict", "large", "disk"])
def test_put_killed_at_every_step_is_all_or_nothing(crash_store, kind):
    store, value = crash_store, values()[kind]
    levels = [Level.DISK] if kind == "disk" else None
    want = crc_of(value)

    def op(s):
        s.put("victim", value, levels=levels)

    def verify(finished):
        if finished:
            assert "victim" in store
        if "victim" in store:
            assert crc_of(store.get("victim")) == want
            store.delete("victim")
        assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify) > 5


@pytest.mark.parametrize("kind", ["small", "dict", "large", "disk"])
def test_delete_killed_at_every_step_leaves_no_ghost(crash_store, kind):
    store, value = crash_store, values()[kind]
    levels = [Level.DISK] if kind == "disk" else None
    want = crc_of(value)
    store.put("victim", value, levels=levels)

    def op(s):
        s.delete("victim")

    def verify(finished):
        if finished:
            assert "victim" not in store
        if "victim" in store:
            assert crc_of(store.get("victim")) == want
        else:  # gone for good: the key can be put again, once
            with pytest.raises(shmstore.ObjectNotFoundError):
                store.get("victim")
            store.put("victim", value, levels=levels)
        assert len([i for i in store.list() if i.key == "victim"]) == 1
        assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify) > 5


@pytest.mark.parametrize("kind", ["small", "dict", "large", "disk"])
def test_overwrite_killed_at_every_step_leaves_the_old_or_the_new_never_neither(crash_store, kind):
    store, new = crash_store, values()[kind]
    old = np.arange(50_000)
    levels = [Level.DISK] if kind == "disk" else None
    want_new, want_old = crc_of(new), crc_of(old)
    store.put("victim", old)

    def op(s):
        view = s.get("victim")  # the old object stays pinned by the child throughout
        s.put("victim", new, levels=levels, overwrite=True)
        assert crc_of(view) == want_old and crc_of(s.get("victim")) == want_new

    def verify(finished):
        assert "victim" in store, "the key went missing"
        got = crc_of(store.get("victim"))
        assert got in (want_new, want_old), "neither the old nor the new value"
        assert got == want_new or not finished
        assert [i.key for i in store.list()] == ["victim"]
        assert_consistent(store)
        if got == want_new:
            store.put("victim", old, overwrite=True)
            assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify) > 5


@pytest.mark.parametrize("level", [Level.MEMORY, Level.DISK])
def test_writer_killed_at_every_step_leaves_nothing_half_visible(crash_store, level):
    store = crash_store
    data = bytes(range(256)) * 2000

    def op(s):
        with s.open_writer("victim", len(data), levels=[level]) as w:
            w.write(data[:100_000])
            w.write(data[100_000:])

    def verify(finished):
        if finished:
            assert "victim" in store
        if "victim" in store:
            assert bytes(store.get("victim")) == data
            store.delete("victim")
        assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify) > 5


def test_reader_killed_holding_pins_while_another_deletes(crash_store):
    store = crash_store
    store.put("victim", np.arange(100_000))

    def op(s):
        view = s.get("victim")
        s.pin("victim")
        with s.open_reader("victim") as r:
            r.read(1000)
        assert view[5] == 5
        s.unpin("victim")

    def verify(finished):
        np.testing.assert_array_equal(store.get("victim"), np.arange(100_000))
        assert store.get_info("victim").pins == 0
        assert_consistent(store)

    sweep(store, _child_store(store), op, verify)
    store.delete("victim")
    assert_consistent(store)
    assert store.get_capacity()[Level.MEMORY].used == 0


def _mover_context(store):
    """The child as the spill process: the real one is stopped, the child moves with its own Mover."""
    from shmstore.spill.mover import Mover

    def prepare():
        node = NodeStore.open(store.config, create=False)
        node.use_levels(open_levels(node))  # as the spill process opens them
        return Mover(node)
    return prepare


@pytest.mark.parametrize("direction", ["spill", "restore"])
@pytest.mark.parametrize("kind", ["small", "large"])
def test_move_killed_at_every_step_is_rolled_back(crash_store, direction, kind):
    store, value = crash_store, values()[kind]
    want = crc_of(value)
    store.put("victim", value, levels=[Level.DISK] if direction == "restore" else None)

    def stop_spill() -> None:
        pid = store.node_store.spill_pid()
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not spill_running(pid), timeout=10)

    def op(mover):
        node = mover.node
        h, b, _ = node.table.locate(0, b"victim")
        idx, _, e = find_entry(node.buf, node.layout, b, h, 0, b"victim")
        if direction == "spill":
            mover.spill(idx, e[L.E_GEN])
        else:
            mover.restore(idx, e[L.E_GEN])

    start = Level.DISK if direction == "restore" else Level.MEMORY

    def verify(finished):
        info = store.get_info("victim")
        assert crc_of(store.get("victim")) == want
        if finished:
            assert info.level != start
        if info.level != start:  # put it back for the next kill
            store.move("victim", start)
        assert_consistent(store)
        stop_spill()  # the child is the only mover

    stop_spill()
    total = run_killed(_mover_context(store), op, 1 << 60)
    settle(store)
    verify(finished=True)
    for stop in kill_points(total, MOVE_POINTS):
        run_killed(_mover_context(store), op, stop)
        settle(store)  # a new spill process rolls back what the dead one left
        info = store.get_info("victim")
        assert crc_of(store.get("victim")) == want, f"killed at line {stop}: {info}"
        verify(finished=False)
    settle(store)


def _die_holding_alloc(store) -> None:
    """Fork a process that takes the ALLOC lock, allocates without recording it anywhere, and is killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            node = NodeStore.open(store.config, create=False)
            node.alloc_lock.acquire()
            node.alloc.alloc(1 << 20, 999)  # half an update: an extent nobody will ever name
            os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(1)
    os.read(r, 1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    os.close(w)


@pytest.mark.parametrize("direction", ["spill", "restore"])
def test_allocator_repair_during_a_move_keeps_the_movers_extents(crash_store, direction):
    """Regression: the ALLOC repair renumbered every extent, and a mover that had read its object's
    extent before the repair freed a stale number after it: 'double free of extent N', or another
    object's space handed out again (corrupt reads)."""
    from shmstore.spill.mover import Mover
    store = crash_store
    others = {f"o{i}": np.full(100_000, i) for i in range(8)}
    for k, v in others.items():
        store.put(k, v)
    store.put("victim", np.arange(250_000), levels=[Level.DISK] if direction == "restore" else None)
    pid = store.node_store.spill_pid()
    os.kill(pid, signal.SIGKILL)  # this test is the mover now
    assert wait_for(lambda: not spill_running(pid), timeout=10)
    node = NodeStore.open(store.config, create=False)
    node.use_levels(open_levels(node))  # as the spill process opens them
    try:
        mover = Mover(node)
        files = node.levels[Level.DISK].files  # the DISK level's spill files, which the mover writes and reads
        copy = files.write if direction == "spill" else files.read_into

        def copy_then_repair(*args, **kw):
            copy(*args, **kw)
            _die_holding_alloc(store)  # between the mover's first and last step

        if direction == "spill":
            files.write = copy_then_repair
        else:
            files.read_into = copy_then_repair
        idx, e, _ = store.kernel.lookup(store.kernel.begin("victim"), False)
        moved = mover.spill(idx, e[L.E_GEN]) if direction == "spill" else mover.restore(idx, e[L.E_GEN])
        assert moved > 0
        for i in range(20):  # reuse whatever the repair freed
            store.put(f"n{i}", np.full(50_000, 100 + i))
    finally:
        node.close()
    settle(store)
    assert_consistent(store)
    np.testing.assert_array_equal(store.get("victim"), np.arange(250_000))
    for k, v in others.items():
        np.testing.assert_array_equal(store.get(k), v)
    for i in range(20):
        assert store.get(f"n{i}")[7] == 100 + i
