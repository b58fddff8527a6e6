"""The stores on a host: listing and gc skip whatever is planted under a store's name, never wait on it, and never
remove a store that a live process uses. Every command runs as a real process, with a deadline."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
from typing import NamedTuple

import pytest

import shmstore
from shmstore.config import Config
from shmstore.meta import layout as L
from shmstore.stores import _remove_if_stale, list_stores

from helpers import ROOT, Child, dead_store, hand_over, shm_segments, spill_running, wait_for

SHM = "/dev/shm"


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    wall: float


def run(*args: str, env: dict[str, str] | None = None) -> Ran:
    """The command with a deadline (a hang is a TimeoutExpired, not a stuck suite), and its wall time."""
    t0 = time.monotonic()
    r = subprocess.run(args, capture_output=True, text=True, timeout=30, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))
    return Ran(r.returncode, r.stdout, r.stderr, time.monotonic() - t0)


def cli(*args: str) -> Ran:
    return run(sys.executable, "-m", "shmstore", *args)


def _meta_of(store: shmstore.Store) -> str:
    return os.path.join(SHM, f"shmstore-{os.getuid()}-{store.name}-{store.node}-meta")


def _header(src: str, **change: object) -> bytes:
    """The header of the store whose metadata is ``src``, with ``change``d fields, as bytes."""
    with open(src, "rb") as f:
        buf = bytearray(f.read(L.HEADER_SIZE))
    L.pack_header(buf, L.unpack_header(buf)._replace(**change))
    return bytes(buf)


def _plant(uid: int, base: str, live_meta: str) -> dict[str, str]:
    """Every kind of thing somebody can leave in /dev/shm under a store's metadata name (uid ``uid``):
    kind -> path. Made by this test run (its names start with ``base``), handed to ``uid``."""
    p = {k: os.path.join(SHM, f"shmstore-{uid}-{base}{k}-hx-meta") for k in
         ("fifo", "socket", "link", "dir", "garbage", "short", "truncated", "renamed", "version", "empty")}
    os.mkfifo(p["fifo"])
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(p["socket"])
    os.symlink(live_meta, p["link"])
    os.mkdir(p["dir"])
    rnd = random.Random(19)
    with open(p["garbage"], "wb") as f:
        f.write(bytes(rnd.randrange(256) for _ in range(3 * L.HEADER_SIZE)))
    with open(live_meta, "rb") as f:
        whole = f.read()
    with open(p["short"], "wb") as f:
        f.write(whole[:100])  # a truncated header
    with open(p["truncated"], "wb") as f:  # a whole header of its own name, but nothing after it
        f.write(_header(live_meta, name=f"{base}truncated", node="hx", uid=uid))
    with open(p["renamed"], "wb") as f:  # another store's metadata under this name
        f.write(whole)
    with open(p["version"], "wb") as f:
        f.write(_header(live_meta, name=f"{base}version", node="hx", uid=uid, version=L.LAYOUT_VERSION + 1))
        f.write(whole[L.HEADER_SIZE:])
    open(p["empty"], "wb").close()  # what a store being created looks like for a moment: skipped quietly
    for path in p.values():
        os.lchown(path, uid, uid)
    return p


def _kinds(paths: dict[str, str]) -> dict[str, tuple[int, int]]:
    return {k: (os.lstat(v).st_ino, stat.S_IFMT(os.lstat(v).st_mode)) for k, v in paths.items()}


def _remove(paths: dict[str, str]) -> None:
    for path in paths.values():
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


def _warned(stderr: str, paths: dict[str, str]) -> set[str]:
    """The kinds of planted things that ``stderr`` warns about, naming their paths."""
    return {k for k, v in paths.items() if v in stderr}


QUIET = {"empty"}  # a store being created: no warning


@pytest.mark.slow
def test_planted_fifos_sockets_links_and_garbage_neither_hang_nor_stop_stores_gc_status(store, name, tmp_path):
    """Regression (issue 19): `mkfifo /dev/shm/shmstore-<uid>-x-n-meta` hung `shmstore stores`, `gc`, `gc --uid`,
    `gc --all-users` and the Slurm epilog forever (opened without O_NONBLOCK, looked at only after the open)."""
    store.put("k", b"live")
    planted = _plant(os.getuid(), name, _meta_of(store))
    if os.getuid() == 0:  # another user's files: under this user's store names, and under their own
        planted["owner"] = os.path.join(SHM, f"shmstore-0-{name}owner-hx-meta")
        with open(planted["owner"], "wb") as f:
            f.write(_header(_meta_of(store), name=f"{name}owner", node="hx"))
        planted["theirs"] = os.path.join(SHM, f"shmstore-65534-{name}theirs-hx-meta")
        os.mkfifo(planted["theirs"])
        for kind in ("owner", "theirs"):
            os.lchown(planted[kind], 65534, 65534)
    dead = name + "dead"
    dead_store(dead, str(tmp_path))
    before = _kinds(planted)
    try:
        r = cli("stores")
        assert r.returncode == 0 and r.wall < 15, r.stderr
        assert r.stdout.count(f"{store.name}\t") == 1  # the link to its metadata is not a second store
        assert _warned(r.stderr, planted) == set(planted) - QUIET - {"theirs"}, r.stderr
        for kind, what in (("fifo", "a fifo"), ("socket", "a socket"), ("link", "a symbolic link"),
                           ("dir", "a directory"), ("garbage", "not a shmstore segment"), ("short", "too short"),
                           ("truncated", "shorter than its header says"), ("renamed", "its header names store"),
                           ("version", f"layout version {L.LAYOUT_VERSION + 1}"),
                           ("owner", "belongs to uid 65534, not 0")):
            if kind in planted:
                assert any(planted[kind] in ln and what in ln for ln in r.stderr.splitlines()), (kind, r.stderr)
        if "theirs" in planted:
            r = cli("--json", "stores", "--all-users")
            assert r.returncode == 0 and r.wall < 15 and _warned(r.stderr, planted) == set(planted) - QUIET
            assert [s["name"] for s in json.loads(r.stdout)].count(store.name) == 1
        found = json.loads(cli("--json", "stores").stdout)
        assert {s["name"] for s in found} >= {store.name, dead} and not {s["name"] for s in found} & {
            name + k for k in planted}
        for args in (("gc",), ("gc", "--uid", str(os.getuid())), ("gc", "--all-users"))[:3 if os.getuid() == 0 else 2]:
            r = cli(*args, "--json", "--name", dead)
            assert r.returncode == 0 and r.wall < 15, r.stderr
            theirs = {"theirs"} if "--all-users" not in args else set()
            assert _warned(r.stderr, planted) == set(planted) - QUIET - theirs, r.stderr
        assert not [s for s in shm_segments() if f"-{dead}-" in s]  # the first gc removed it
        r = cli("--name", name + "fifo", "--node", "hx", "status")
        assert r.returncode == 1 and "is a fifo" in r.stderr and r.wall < 15, r.stderr
        r = cli("destroy", name + "socket", "--node", "hx")
        assert r.returncode == 0 and r.stdout.strip() == "nothing to remove" and r.wall < 15, r.stderr
        with pytest.raises(shmstore.PermissionDeniedError, match="is a fifo"):
            shmstore.connect(name + "fifo", node="hx")
        assert _kinds(planted) == before  # nothing planted was opened for good, removed or replaced
        assert store.get("k") == b"live" and store.check() == []
    finally:
        _remove(planted)


def test_the_slurm_epilog_ends_within_seconds_beside_planted_files_and_removes_the_dead_store(name, tmp_path):
    """mpi/slurm/epilog.sh as Slurm runs it (root, SLURM_JOB_UID of the job's user) with a FIFO, a socket and
    garbage under that user's store names: it ends, removes the user's dead store, leaves the rest alone.
    The job's user is a uid of this test alone, so the epilog's gc (all that user's stale stores) touches
    nothing of anybody else's."""
    if os.getuid() != 0:
        pytest.skip("an epilog runs as root: removing another user's store needs root")
    uid = 61000 + random.randrange(4000)
    with shmstore.connect(name + "src", capacity="8MiB") as live:
        planted = _plant(uid, name, _meta_of(live))
    dead = name + "dead"
    hand_over(dead, str(tmp_path), uid)
    try:
        r = run("bash", os.path.join(ROOT, "mpi", "slurm", "epilog.sh"),
                env={"SLURM_JOB_UID": str(uid), "SHMSTORE_PYTHON": sys.executable})
        assert r.returncode == 0 and r.wall < 15, r.stderr
        assert json.loads(r.stdout)["removed"] == [f"{dead}@{Config.from_kwargs().node} (uid {uid})"]
        assert not [s for s in os.listdir(SHM) if f"-{dead}-" in s] and not os.listdir(tmp_path)
        assert _warned(r.stderr, planted) == set(planted) - QUIET, r.stderr
        assert all(os.path.lexists(p) for p in planted.values())
    finally:
        _remove(planted)
        for s in os.listdir(SHM):
            if f"-{dead}-" in s:
                os.unlink(os.path.join(SHM, s))


# ---- gc never removes a store that a live process uses ---------------------------------------------------

JOB = """
import os, sys, shmstore
s = shmstore.connect(os.environ['N'], capacity='8MiB', spill_dir=os.environ['D'])
s.put('a', b'x' * 1000)
print(s.spill_pid, flush=True)
sys.stdin.readline()
s.close()
"""


def _segments(name: str) -> list[str]:
    return [s for s in shm_segments() if f"-{name}-" in s]


def test_gc_leaves_a_store_whose_spill_process_lives_after_its_clients_died(name, tmp_path):
    child = Child(JOB, env={"N": name, "D": str(tmp_path)})
    spill = int(child.readline(timeout=60))
    os.kill(spill, signal.SIGSTOP)  # alive, but not removing the store while gc looks
    try:
        child.kill()
        (st,) = [s for s in list_stores() if s["name"] == name]
        assert not st["stale"] and st["spill_alive"] and st["clients"] == 0
        assert json.loads(cli("gc", "--json", "--name", name).stdout)["removed"] == []
        assert _segments(name)
    finally:
        os.kill(spill, signal.SIGCONT)
    assert wait_for(lambda: not _segments(name) and not spill_running(spill), timeout=15)  # it does, itself


def test_gc_leaves_a_store_with_a_live_client_whose_spill_process_died(name, tmp_path):
    child = Child(JOB, env={"N": name, "D": str(tmp_path)})
    spill = int(child.readline(timeout=60))
    os.kill(spill, signal.SIGKILL)
    assert wait_for(lambda: not spill_running(spill), timeout=10)
    assert json.loads(cli("gc", "--json", "--name", name).stdout)["removed"] == []
    assert _segments(name)
    child.send("")
    child.wait()
    assert wait_for(lambda: not _segments(name), timeout=15)  # the last client removed it


def test_a_client_that_attaches_after_gc_listed_the_store_as_stale_keeps_it(name, tmp_path):
    """The race: gc lists the store as stale; a client attaches; gc comes to remove it. It decides again under the
    store's ADMIN lock (where clients register), so the store stays for the client."""
    dead_store(name, str(tmp_path))
    (st,) = [s for s in list_stores() if s["name"] == name]
    assert st["stale"]
    with shmstore.connect(name, create=False) as s:
        assert not _remove_if_stale(st)
        assert s.get("a").sum() == sum(range(1000)) and s.check() == []
    assert wait_for(lambda: not _segments(name), timeout=15)


def test_gc_of_a_live_store_of_another_program_leaves_it(bystanders):
    b = bystanders[0] if bystanders else pytest.skip("no bystander in an MPI run")
    for args in (("gc",), ("gc", "--all-users") if os.getuid() == 0 else ("gc",)):
        r = cli(*args, "--json", "--name", b.name)
        assert r.returncode == 0 and json.loads(r.stdout)["removed"] == []
    assert not b.damage()


# ---- gc removes only the spill files of the store it removes (issue 30, item 2) -------------------------------

LIVE_UNNAMED = """
import os, sys, numpy as np, shmstore
s = shmstore.connect(os.environ['N'], capacity='8MiB', spill_dir=os.environ['D'])
s.put('a0', np.arange(50_000), levels=[shmstore.Level.DISK])
seg = s.node_store.prefix.lstrip('/')
for path in (f'/dev/shm/{seg}-meta', f'/dev/shm/{seg}-arena', f'/dev/shm/sem.{seg}-wake'):
    os.unlink(path)  # a cleaner's rm: this store goes on, and the next connect makes a new one under the name
print(s.node_store.levels[shmstore.Level.DISK].files.tag, flush=True)
sys.stdin.readline()
np.testing.assert_array_equal(s.get('a0'), np.arange(50_000))
assert s.check() == [], s.check()
print('intact', flush=True)
sys.stdin.readline()
s.close()
"""


def test_gc_of_a_stale_store_leaves_the_files_of_a_live_store_of_the_same_name(name, tmp_path):
    """Two incarnations of one name share the spill directory: a live store whose names were unlinked behind its
    back, and a newer one made under the name whose whole job then died. gc removed every file of the user in
    the directory with the stale one: the live store lost every object on DISK (``SpillError: cannot read 'a0'
    ... No such file or directory``; ``check``: ``entry .. is on disk but its file .. is missing``). Now gc
    removes the stale store's own files (its incarnation's tag) and leaves the directory to the live one."""
    live = Child(LIVE_UNNAMED, env={"N": name, "D": str(tmp_path)})
    try:
        live_tag = live.readline(timeout=60)
        dead_store(name, str(tmp_path))  # the newer store, all its processes SIGKILLed
        (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]  # beside it: the spill processes' log
        dead_tags = {f.split(".")[0] for f in os.listdir(folder)} - {live_tag}
        assert len(dead_tags) == 1, os.listdir(folder)
        r = cli("gc", "--json", "--name", name)
        assert r.returncode == 0 and json.loads(r.stdout)["removed"] == [f"{name}@{Config.from_kwargs().node}"]
        assert not _segments(name)
        left = os.listdir(folder)
        assert left and all(f.startswith(live_tag + ".") for f in left), left  # the dead store's files went
        live.send("")
        assert live.readline() == "intact"
        live.send("")
        live.wait()
        assert wait_for(lambda: not os.path.exists(folder), timeout=15)  # the last store of the name took it
    finally:
        if live.proc.poll() is None:
            live.kill()


def test_gc_as_root_for_another_user_removes_only_that_store_s_own_files(name, tmp_path):
    """The epilog's gc (root, ``--uid``) removes the stale store's files of its own incarnation, each a regular
    file of that user, and leaves the rest: another incarnation's file (a live store of the same name), a file
    of another owner and a symbolic link under the store's tag. The directory stays while anything is in it."""
    if os.getuid() != 0:
        pytest.skip("removing another user's store needs root")
    uid = 61000 + random.randrange(4000)
    dead = name + "dead"
    hand_over(dead, str(tmp_path), uid)
    try:
        (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
        (tag,) = {f.split(".")[0] for f in os.listdir(folder)}
        own = set(os.listdir(folder))
        kept = {"other": f"{int(tag.split('-')[0], 16) + 1:x}-1.3.0", "owner": f"{tag}.99.0", "link": f"{tag}.98.0"}
        for kind, entry in kept.items():
            path = os.path.join(folder, entry)
            if kind == "link":
                os.symlink(os.path.join(folder, kept["other"]), path)
            else:
                with open(path, "wb") as f:
                    f.write(b"x")
            owner = 65534 if kind == "owner" else uid
            os.lchown(path, owner, owner)
        r = cli("gc", "--uid", str(uid), "--json", "--name", dead)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["removed"] == [f"{dead}@{Config.from_kwargs().node} (uid {uid})"]
        assert sorted(os.listdir(folder)) == sorted(kept.values()), (own, os.listdir(folder))
    finally:
        for s in os.listdir(SHM):
            if f"-{dead}-" in s:
                os.unlink(os.path.join(SHM, s))


def test_gc_right_after_an_aborted_job_waits_for_its_young_segments_to_come_of_age(name):
    """A Slurm epilog runs ``shmstore gc`` the moment a job ends; an aborted job's MPI segments are then seconds
    old, under the age below which gc leaves a segment alone (a job starting may not have mapped its own yet):
    under the test Slurm every aborted job left MPICH's 2 x 32 MiB of VCI segments behind. gc now looks at an
    unused young segment again once it is old enough (where that is within 10 s), and removes it then; one
    still in use then stays, and one whose age is far off is not waited for."""
    from shmstore.stores import collect_mpi_orphans
    young, kept, far = f"mpich_vci_{name}_0", f"mpich_vci_{name}_1", f"mpich_vci_{name}_2"
    for seg in (young, kept, far):
        with open(f"/dev/shm/{seg}", "wb") as f:
            f.write(b"\0" * 4096)
    os.utime(f"/dev/shm/{far}", (time.time() + 3600, time.time() + 3600))  # an hour from being old enough
    held = open(f"/dev/shm/{kept}", "rb")  # noqa: SIM115  (a live process holds it once it is old enough)
    try:
        start = time.monotonic()
        removed = collect_mpi_orphans(only={young, kept, far}, min_age=1.0)
        took = time.monotonic() - start
        assert removed == [young] and took >= 0.9, (removed, took)
        assert os.path.exists(f"/dev/shm/{kept}") and os.path.exists(f"/dev/shm/{far}")
        assert took < 60, took  # not the hour
    finally:
        held.close()
        for seg in (young, kept, far):
            try:
                os.unlink(f"/dev/shm/{seg}")
            except OSError:
                pass


def test_gc_removes_the_mpi_librarys_orphaned_segments_and_only_those(name):
    """What an aborted MPI job leaves in /dev/shm (issue 35 item 8): MPICH's and Open MPI's segments that no live
    process maps or holds open go; one a live process maps, one it holds open, a fresh one, another user's,
    a directory and a link under the same names stay. Only segments this test made are looked at (``only``)."""
    from shmstore.stores import collect_mpi_orphans
    made = {p + name + s: None for p, s in (("mpich_shm_", ""), ("mpich_vci_", "_0"), ("sm_segment.", ".0"),
                                            ("vader_segment.", ".1"))}
    for seg in made:
        with open(f"/dev/shm/{seg}", "wb") as f:
            f.write(b"\0" * 4096)
        os.utime(f"/dev/shm/{seg}", (time.time() - 7200, time.time() - 7200))
    mapped, opened, fresh = (f"mpich_shm_{name}_{w}" for w in ("mapped", "open", "fresh"))
    for seg in (mapped, opened, fresh):
        with open(f"/dev/shm/{seg}", "wb") as f:
            f.write(b"\0" * 4096)
    for seg in (mapped, opened):
        os.utime(f"/dev/shm/{seg}", (time.time() - 7200, time.time() - 7200))
    os.mkdir(f"/dev/shm/mpich_dir_{name}")
    os.symlink(f"/dev/shm/{mapped}", f"/dev/shm/mpich_link_{name}")
    others = []
    if os.getuid() == 0:
        others.append(f"mpich_shm_{name}_other")
        with open(f"/dev/shm/{others[0]}", "wb") as f:
            f.write(b"\0" * 4096)
        os.chown(f"/dev/shm/{others[0]}", 65534, 65534)
        os.utime(f"/dev/shm/{others[0]}", (time.time() - 7200, time.time() - 7200))
    holder = Child(f"""
import mmap, os
f = open('/dev/shm/{mapped}', 'r+b'); m = mmap.mmap(f.fileno(), 4096); f.close()
fd = os.open('/dev/shm/{opened}', os.O_RDONLY)
print('holding', flush=True)
input()
""")
    everything = set(made) | {mapped, opened, fresh, f"mpich_dir_{name}", f"mpich_link_{name}", *others}
    try:
        assert holder.readline() == "holding"
        removed = collect_mpi_orphans(only=everything, min_age=3600)  # an hour: `fresh` is younger, however slow
        assert sorted(removed) == sorted(made)
        assert {mapped, opened, fresh, *others} <= set(os.listdir("/dev/shm"))
        assert os.path.isdir(f"/dev/shm/mpich_dir_{name}") and os.path.islink(f"/dev/shm/mpich_link_{name}")
        holder.send("")
        holder.wait()
        assert collect_mpi_orphans(only=everything, min_age=3600) == sorted([mapped, opened])  # holder gone
        assert collect_mpi_orphans(only=everything, min_age=0) == [fresh]
        if others:
            assert collect_mpi_orphans(only=everything, uid=65534, min_age=3600) == others
    finally:
        holder.kill()
        for seg in everything:
            try:
                os.rmdir(f"/dev/shm/{seg}") if os.path.isdir(f"/dev/shm/{seg}") and not os.path.islink(
                    f"/dev/shm/{seg}") else os.unlink(f"/dev/shm/{seg}")
            except OSError:
                pass
