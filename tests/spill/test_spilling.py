"""Spill: the DISK level, the spill process moving objects, priority lists of levels."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.meta import layout as L

from helpers import ROOT, Child, spill_running, wait_for

MiB = 1 << 20


@pytest.fixture
def small(name, tmp_path):
    """A store with 32 MiB of memory and a private spill directory."""
    with shmstore.connect(name, capacity="32MiB", spill_dir=str(tmp_path), prefault="32MiB") as s:
        yield s


def level_of(store, key) -> Level:
    return store.get_info(key).level


def check_accounting(store) -> None:
    """Each level's used bytes equal the sum of the objects on it (once the background spill, which moves
    objects between the two readings, is quiet)."""
    def differences():
        cap = store.get_capacity()
        infos = store.kernel.list(all_sessions=True)
        return {level: (cap[level].used, sum(i.stored for i in infos if i.level == level))
                for level in (Level.MEMORY, Level.DISK)
                if cap[level].used != sum(i.stored for i in infos if i.level == level)}
    assert wait_for(lambda: not differences(), timeout=10), differences()


def spill_files(store) -> list[str]:
    return sorted(store.node_store.levels[shmstore.Level.DISK].files.names())


def test_priority_list_spills_lru_objects_to_disk(small):
    arrays = {f"a{i}": np.full(MiB, i, np.float32) for i in range(16)}  # 64 MiB through 32 MiB
    for k, a in arrays.items():
        small.put(k, a, levels=[Level.MEMORY, Level.DISK])
    levels = [level_of(small, k) for k in arrays]
    assert Level.DISK in levels and levels[-1] == Level.MEMORY  # the newest stays in memory
    assert levels.index(Level.DISK) < len(levels) - 1
    for k, a in arrays.items():
        np.testing.assert_array_equal(small.get(k), a)
    check_accounting(small)
    cap = small.get_capacity()
    assert cap[Level.DISK].spilled > 0 and cap[Level.MEMORY].used <= cap[Level.MEMORY].total


def test_object_larger_than_memory_goes_to_disk_at_once(small):
    big = np.arange(12 * MiB, dtype=np.int32)  # 48 MiB
    info = small.put("big", big)
    assert info.level == Level.DISK
    np.testing.assert_array_equal(small.get("big", conditions=(slice(5, 10),)), big[5:10])
    with pytest.raises(shmstore.StorageFullError, match="capacity"):
        small.put("big2", big, levels=[Level.MEMORY])
    assert "big2" not in small


def test_memory_only_put_waits_for_spill_of_others(small):
    for i in range(6):
        small.put(f"old{i}", np.full(MiB, i, np.float32), levels=[Level.MEMORY, Level.DISK])
    small.put("fresh", np.ones(6 * MiB, np.float32), levels=[Level.MEMORY])  # 24 MiB: others must go
    assert level_of(small, "fresh") == Level.MEMORY
    assert any(level_of(small, f"old{i}") == Level.DISK for i in range(6))
    for i in range(6):
        assert small.get(f"old{i}")[7] == i
    check_accounting(small)


def test_memory_only_put_fails_when_nothing_is_spillable(small):
    views = []
    for i in range(6):
        small.put(f"p{i}", np.full(MiB, i, np.float32))
        views.append(small.get(f"p{i}"))  # live views pin them
    with pytest.raises(shmstore.StorageFullError):
        small.put("x", np.ones(4 * MiB, np.float32), levels=[Level.MEMORY])
    assert all(level_of(small, f"p{i}") == Level.MEMORY for i in range(6))
    info = small.put("x", np.ones(4 * MiB, np.float32))  # the default list may use the disk
    assert info.level == Level.DISK
    del views


def test_move_and_get_with_levels_round_trip(small):
    a = np.random.default_rng(1).standard_normal((512, 1024))
    small.put("a", a)
    info = small.move("a", Level.DISK)
    assert info.level == Level.DISK and spill_files(small)
    np.testing.assert_array_equal(small.get("a"), a)  # read from the file, without moving it
    assert level_of(small, "a") == Level.DISK
    got = small.get("a", levels=[Level.MEMORY])
    assert level_of(small, "a") == Level.MEMORY and not spill_files(small)
    np.testing.assert_array_equal(got, a)
    del got
    gc.collect()
    check_accounting(small)
    cap = small.get_capacity()
    assert cap[Level.DISK].used == 0
    assert cap[Level.MEMORY].spilled >= a.nbytes and cap[Level.MEMORY].restored >= a.nbytes


@pytest.mark.parametrize("value", [b"raw bytes" * 1000, {"w": np.arange(10), "meta": "x"}, b"",
                                   np.asfortranarray(np.arange(12.0).reshape(3, 4))])
def test_every_kind_survives_a_round_trip_through_disk(small, value):
    small.put("v", value)
    small.move("v", Level.DISK)
    for levels in (None, Level.MEMORY):  # read from the file, then brought back
        got = small.get("v", levels=levels)
        if isinstance(value, dict):
            assert got["meta"] == "x" and (got["w"] == value["w"]).all()
        elif isinstance(value, np.ndarray):
            np.testing.assert_array_equal(got, value)
        else:
            assert bytes(got) == value
        del got
        gc.collect()
    assert level_of(small, "v") == Level.MEMORY


def test_pinned_objects_are_never_moved(small):
    small.put("a", np.ones(MiB))
    view = small.get("a")
    with pytest.raises(shmstore.ObjectLockedError, match="pinned"):
        small.move("a", Level.DISK)
    reader = small.open_reader("a")
    del view
    gc.collect()
    with pytest.raises(shmstore.ObjectLockedError):
        small.move("a", Level.DISK)
    assert reader.read(8) == np.ones(1)[0].tobytes()
    reader.close()
    small.pin("a")
    with pytest.raises(shmstore.ObjectLockedError):
        small.move("a", Level.DISK)
    small.unpin("a")
    assert small.move("a", Level.DISK).level == Level.DISK


def test_background_spill_keeps_memory_under_the_high_watermark(name, tmp_path):
    with shmstore.connect(name, capacity="32MiB", spill_dir=str(tmp_path), high_watermark=0.5,
                          low_watermark=0.25) as s:
        for i in range(12):  # 12 MiB: above the 16 MiB high watermark? no: below it
            s.put(f"a{i}", np.full(MiB // 4, i, np.float32))
        for i in range(12, 28):  # now 28 MiB in all, above 16 MiB
            s.put(f"a{i}", np.full(MiB // 4, i, np.float32))
        assert wait_for(lambda: s.get_capacity()[Level.MEMORY].used <= 16 * MiB, timeout=15)
        assert any(level_of(s, f"a{i}") == Level.DISK for i in range(28))
        for i in range(28):
            assert s.get(f"a{i}")[3] == i
        check_accounting(s)


def test_delete_during_spill_leaves_no_file_and_no_quota(name, tmp_path):
    with shmstore.connect(name, capacity="512MiB", spill_dir=str(tmp_path)) as s:
        s.put("big", np.ones(256 * MiB, np.uint8))
        mover = Child("""
import shmstore, os, sys
from shmstore import Level
s = shmstore.connect(os.environ['N'], create=False)
print('ready', flush=True)
try:
    s.move('big', Level.DISK)
    print('moved', flush=True)
except shmstore.ShmStoreError as exc:
    print('gone', type(exc).__name__, flush=True)
s.close()
""", env={"N": name})
        assert mover.readline() == "ready"
        assert wait_for(lambda: L.unpack_spill_state(s.node_store.meta.mm).moving or level_of(s, "big") == Level.DISK,
                        timeout=10, interval=0.001)
        s.delete("big")
        mover.readline()
        mover.wait()
        assert wait_for(lambda: s.get_capacity()[Level.MEMORY].used == 0 and s.get_capacity()[Level.DISK].used == 0,
                        timeout=10)
        assert wait_for(lambda: not spill_files(s), timeout=10), spill_files(s)
        assert L.ALLOC.get(s.node_store.meta.mm, "disk_reserved") == 0


def test_failed_spill_leaves_object_readable_and_reports_spill_error(name, tmp_path):
    with shmstore.connect(name, capacity="16MiB", spill_dir=str(tmp_path)) as s:
        spill_pid = s.spill_pid
        blocker = s.node_store.spill_path
        with open(blocker, "w") as f:  # a file where the store's spill directory should be
            f.write("not a directory")
        try:
            s.put("a", np.full(3 * MiB, 7, np.float32))  # 12 MiB
            with pytest.raises(shmstore.SpillError, match="cannot spill 'a'"):
                s.put("b", np.ones(3 * MiB, np.float32), levels=[Level.MEMORY])
            assert level_of(s, "a") == Level.MEMORY and s.get("a")[0] == 7
            assert "b" not in s and s.spill_pid == spill_pid and spill_running(spill_pid)
            with pytest.raises(shmstore.SpillError):
                s.move("a", Level.DISK)
        finally:
            os.unlink(blocker)
        assert s.move("a", Level.DISK).level == Level.DISK  # works once the directory can be made
        check_accounting(s)


def test_disk_quota_is_enforced(name, tmp_path):
    with shmstore.connect(name, capacity="8MiB", spill_dir=str(tmp_path), disk_capacity="4MiB") as s:
        s.put("a", np.ones(3 * MiB, np.uint8), levels=[Level.DISK])
        with pytest.raises(shmstore.StorageFullError, match="disk_capacity"):
            s.put("b", np.ones(2 * MiB, np.uint8), levels=[Level.DISK])
        s.delete("a")
        s.put("b", np.ones(2 * MiB, np.uint8), levels=[Level.DISK])
        assert s.get_capacity()[Level.DISK].total == 4 * MiB


@pytest.mark.slow
def test_spill_process_killed_mid_spill_loses_nothing(name, tmp_path):
    with shmstore.connect(name, capacity="768MiB", spill_dir=str(tmp_path)) as s:
        data = np.arange(64 * MiB, dtype=np.int32)  # 256 MiB
        s.put("big", data)
        mover = Child("""
import shmstore, os
from shmstore import Level
s = shmstore.connect(os.environ['N'], create=False)
print('ready', flush=True)
try:
    s.move('big', Level.DISK)
    print('moved', flush=True)
except shmstore.ShmStoreError as exc:
    print('failed', exc, flush=True)
s.close()
""", env={"N": name})
        assert mover.readline() == "ready"
        old = s.spill_pid
        assert wait_for(lambda: L.unpack_spill_state(s.node_store.meta.mm).progress > 0, timeout=20, interval=0.001)
        os.kill(old, signal.SIGKILL)
        assert wait_for(lambda: not spill_running(old), timeout=10)
        new = s.spill_pid  # restarted; it rolls back (or the waiting mover's retry finishes) the move
        assert new != old
        out = mover.readline(timeout=60)
        mover.wait()
        assert out.startswith(("moved", "failed"))
        assert wait_for(lambda: not L.unpack_spill_state(s.node_store.meta.mm).moving, timeout=10)
        lvl = level_of(s, "big")
        np.testing.assert_array_equal(s.get("big")[::4096], data[::4096])
        assert not [f for f in spill_files(s) if f.endswith(".tmp")]
        assert spill_files(s) == ([] if lvl == Level.MEMORY else spill_files(s))
        check_accounting(s)
        assert s.move("big", Level.DISK).level == Level.DISK
        assert s.move("big", Level.MEMORY).level == Level.MEMORY
        check_accounting(s)


def test_two_processes_needing_room_at_once_both_succeed(name, tmp_path):
    with shmstore.connect(name, capacity="64MiB", spill_dir=str(tmp_path), high_watermark=1.0,
                          low_watermark=0.9) as s:
        for i in range(14):
            s.put(f"old{i}", np.full(MiB, i, np.float32))  # 56 MiB, all spillable
        code = """
import shmstore, os, sys, numpy as np
from shmstore import Level
s = shmstore.connect(os.environ['N'], create=False)
print('ready', flush=True)
sys.stdin.readline()
s.put(os.environ['K'], np.ones(5 * (1 << 18), np.float32) * 3, levels=[Level.MEMORY])
print('ok', flush=True)
s.close()
"""
        kids = [Child(code, env={"N": name, "K": k}) for k in ("x", "y")]
        for k in kids:
            assert k.readline() == "ready"
        for k in kids:
            k.send("go")
        for k in kids:
            assert k.readline(timeout=60) == "ok"
            k.wait()
        assert level_of(s, "x") == level_of(s, "y") == Level.MEMORY
        for i in range(14):
            assert s.get(f"old{i}")[0] == i
        check_accounting(s)


def test_disk_writer_and_dead_disk_writer(small):
    with small.open_writer("w", 3000, levels=[Level.DISK]) as w:
        w.write(b"abc" * 1000)
    assert level_of(small, "w") == Level.DISK and bytes(small.get("w")) == b"abc" * 1000
    child = Child("""
import shmstore, os, sys
from shmstore import Level
s = shmstore.connect(os.environ['N'], create=False)
w = s.open_writer('half', 1 << 20, levels=[Level.DISK])
w.write(b'x' * 1000)
print('half', flush=True)
sys.stdin.readline()
""", env={"N": small.name})
    assert child.readline() == "half"
    assert any(f.endswith(".tmp") for f in spill_files(small))
    child.kill()
    assert wait_for(lambda: not any(f.endswith(".tmp") for f in spill_files(small)), timeout=10)
    assert "half" not in small
    check_accounting(small)
    assert L.ALLOC.get(small.node_store.meta.mm, "disk_reserved") == small.get_capacity()[Level.DISK].used


def test_store_removal_removes_spill_files(name, tmp_path):
    s = shmstore.connect(name, capacity="8MiB", spill_dir=str(tmp_path))
    s.put("a", b"x" * 1000, levels=[Level.DISK])
    path = s.node_store.spill_path
    assert os.listdir(path)
    assert os.stat(path).st_mode & 0o777 == 0o700
    s.close()
    assert wait_for(lambda: not os.path.exists(path), timeout=10)


def test_cli_status_and_move_with_progress(small):
    import json
    import subprocess
    import sys
    small.put("a", np.ones(2 * MiB))
    def run(*a):
        return subprocess.run([sys.executable, "-m", "shmstore", "--name", small.name, *a],
                              capture_output=True, text=True, timeout=60)
    r = run("move", "a", "disk")
    assert r.returncode == 0, r.stderr
    assert level_of(small, "a") == Level.DISK
    st = json.loads(run("--json", "status").stdout)
    assert st["levels"]["disk"]["objects"] == 1 and st["levels"]["memory"]["spilled"] >= 16 * MiB
    assert {"used", "pinned", "spillable", "spilled", "restored"} <= set(st["levels"]["memory"])
    assert "moving" in st
    assert run("move", "a", "memory").returncode == 0
    assert level_of(small, "a") == Level.MEMORY


# ---- a store's names unlinked behind its back (issue 19, item 2) ----------------------------------------------

NEW_STORE = """
import os, sys, time, numpy as np, shmstore
s = shmstore.connect(os.environ['N'], capacity='8MiB', spill_dir=os.environ['D'])
s.put('new', np.arange(100_000), levels=[shmstore.Level.DISK])
deadline = time.monotonic() + 60
while not s.status()['spill']['heartbeat'] and time.monotonic() < deadline:  # its spill process has started
    time.sleep(0.01)                                                          # (and recovered) by its first beat
# a file this store would take for a stray of its own (no entry 5 of gen 7)
stray = s.node_store.levels[shmstore.Level.DISK].files.file(5, 7)
open(stray, 'wb').close()
print(stray, flush=True)
sys.stdin.readline()
print(os.path.exists(stray), flush=True)
s.node_store.levels[shmstore.Level.DISK].files.unlink('5.7')
np.testing.assert_array_equal(s.get('new'), np.arange(100_000))
assert s.check() == [], s.check()
s.close()
"""


def _unlink_names(store) -> None:
    """What ``rm /dev/shm/shmstore-<uid>-<name>-*`` does (a cleaner; the test suite's leak check once did)."""
    seg = store.node_store.prefix.lstrip("/")
    for path in (f"/dev/shm/{seg}-meta", f"/dev/shm/{seg}-arena", f"/dev/shm/sem.{seg}-wake"):
        os.unlink(path)


def _old_store_with_spilled_objects(name, spill_dir):
    old = shmstore.connect(name, capacity="8MiB", spill_dir=spill_dir)
    old.put("disk", b"d" * 100_000, levels=[Level.DISK])
    old.put("spilled", np.full(MiB, 3, np.float32))
    assert old.move("spilled", Level.DISK).level == Level.DISK
    return old


def _check_old(old) -> None:
    assert bytes(old.get("disk")) == b"d" * 100_000  # SpillError: no such file, before the fix
    np.testing.assert_array_equal(old.get("spilled"), np.full(MiB, 3, np.float32))
    assert old.check() == []


@pytest.mark.slow
def test_a_new_store_under_an_unlinked_name_leaves_the_old_store_s_files_alone(name, tmp_path):
    """The old store's clients go on using it while a new store is made under its name, with the same spill
    directory. The new store's files took the old one's names (entry 31 of generation 0 in both: the old store
    read the new one's bytes), its spill process removed the old store's files as strays of its own
    (``SpillError: ... No such file or directory: '32.0'``), and the old store's removal took the new store's
    names with it. Each now keeps to its own files and names."""
    old, child = _old_store_with_spilled_objects(name, str(tmp_path)), None
    try:
        _unlink_names(old)
        child = Child(NEW_STORE, env={"N": name, "D": str(tmp_path)})
        child.readline(timeout=60)  # the new store and its spill process are up
        _check_old(old)
        old_spill, folder = old.spill_pid, old.node_store.spill_path
        tag = old.node_store.levels[shmstore.Level.DISK].files.tag
        old.close()
        assert wait_for(lambda: not spill_running(old_spill), timeout=15)  # the old store went, with its files
        assert not [f for f in os.listdir(folder) if f.startswith(tag + ".")]
        with shmstore.connect(name, create=False) as again:  # the new store still has the name
            np.testing.assert_array_equal(again.get("new"), np.arange(100_000))
        child.send("")
        assert child.readline() == "True"
        child.wait()
        assert wait_for(lambda: not os.path.exists(folder), timeout=15)  # and nothing is left of either
    finally:
        old.close()
        if child is not None and child.proc.poll() is None:
            child.kill()


@pytest.mark.slow
def test_a_spill_process_started_for_an_unlinked_store_leaves_the_new_one_alone(name, tmp_path):
    """A client of the old store restarted its dead spill process, which opened the store by name and got the
    new one: it recovered that store under its running spill process (rolling back the moves in flight there,
    removing what it took for strays). Now no client starts one for a store whose names are gone, one started
    anyway leaves as soon as it sees the store is not the one it was started for, and the old store's last
    client removes the old store."""
    old, child = _old_store_with_spilled_objects(name, str(tmp_path)), None
    try:
        _unlink_names(old)
        child = Child(NEW_STORE, env={"N": name, "D": str(tmp_path)})
        stray = child.readline(timeout=60)
        folder, dead = old.node_store.spill_path, old.spill_pid
        os.kill(dead, signal.SIGKILL)
        assert wait_for(lambda: not spill_running(dead), timeout=10)
        assert old.spill_pid == dead  # not started again: it would open the new store by name
        # what still starts one: the names go between a client's look and the start of the spill process it
        # spawned (a slow start); it opens the store by name, as here
        started = subprocess.run([sys.executable, "-m", "shmstore.spill", "--name", name, "--node", old.node,
                                  "--spill-dir", str(tmp_path)], env=dict(os.environ, PYTHONPATH=ROOT),
                                 capture_output=True, text=True, timeout=60)
        assert started.returncode == 0 and "no longer has this name" in started.stderr, started.stderr
        assert os.path.exists(stray)  # the new store's own file, untouched by a spill process not its own
        _check_old(old)
        old.close()  # no spill process: its last client removes it
        child.send("")
        assert child.readline() == "True"
        child.wait()
        assert wait_for(lambda: not os.path.exists(folder), timeout=15)
    finally:
        old.close()
        if child is not None and child.proc.poll() is None:
            child.kill()


@pytest.mark.slow
def test_the_old_store_leaves_the_directory_to_a_new_one_that_has_it_open(name, tmp_path):
    """The new store has the directory open but no file in it yet when the old store goes: the old store's
    removal took the empty directory, the new store's next spill failed (``No such file or directory``: its
    descriptor named the removed directory) or, once another process made the directory again, went where
    the others could not see it."""
    old = _old_store_with_spilled_objects(name, str(tmp_path))
    try:
        _unlink_names(old)
        folder = old.node_store.spill_path
        with shmstore.connect(name, capacity="8MiB", spill_dir=str(tmp_path)) as new:
            assert new.check() == []  # looks into the directory (none of its files there yet)
            old_spill = old.spill_pid
            old.close()
            assert wait_for(lambda: not spill_running(old_spill), timeout=15)  # gone, its files with it
            assert os.path.isdir(folder) and not os.listdir(folder)
            new.put("x", b"x" * 1000, levels=[Level.DISK])
            with shmstore.connect(name, create=False) as other:  # a descriptor of its own
                assert bytes(other.get("x")) == b"x" * 1000
        assert wait_for(lambda: not os.path.exists(folder), timeout=15)
    finally:
        old.close()


def test_a_forked_child_does_not_keep_the_spill_directory(tmp_path):
    """Each process holds a lock on the spill directory while it has it open, and the directory goes only when
    no other holds one: a child forked meanwhile lets go of what it inherited, or it would keep the directory
    from going (for as long as it lives) once the parent has closed its store."""
    import time

    from shmstore.levels.spillfiles import LINGER, SpillFiles
    d = SpillFiles(str(tmp_path), "store-dir")
    d.ensure()
    pid = os.fork()
    if pid == 0:  # the child lives on a while
        time.sleep(30)
        os._exit(0)
    try:
        d.close()  # the parent is done with it
        last = SpillFiles(str(tmp_path), "store-dir")  # the store's last process (its spill process) removes it
        start = time.monotonic()
        assert last.remove_all() == 0
        assert not os.path.exists(d.path) and time.monotonic() - start < LINGER
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
