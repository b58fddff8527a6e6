"""The shmstore command, run as a real process."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.config import Config
from shmstore.units import format_size

from helpers import ROOT, dead_store, hand_over, unique_name, wait_for


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmstore", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_status_ls_info_rm(store):
    store.put("arr", np.zeros(1000))
    store.put("blob", b"x" * 10)
    st = json.loads(run("--name", store.name, "--json", "status").stdout)
    assert st["name"] == store.name and st["levels"]["memory"]["objects"] == 2
    assert st["spill"]["alive"] and [c["pid"] for c in st["clients"]] == [__import__("os").getpid()]
    text = run("--name", store.name, "status").stdout
    assert "memory" in text and "spill process" in text
    ls = json.loads(run("--name", store.name, "--json", "ls").stdout)
    assert sorted(i["key"] for i in ls) == ["arr", "blob"]
    info = json.loads(run("--name", store.name, "--json", "info", "arr").stdout)
    assert info["size"] == 8000 and info["kind"] == "ndarray" and info["level"] == "memory"
    assert run("--name", store.name, "rm", "blob").returncode == 0
    assert "blob" not in store
    r = run("--name", store.name, "info", "blob")
    assert r.returncode == 1 and "'blob'" in r.stderr


def test_destroy_and_missing_store(store):
    r = run("destroy", store.name)
    assert r.returncode == 1 and "attached" in r.stderr
    r = run("--name", "no-such-store-here", "status")
    assert r.returncode == 1 and "no store" in r.stderr
    assert run("destroy", "no-such-store-here").stdout.strip() == "nothing to remove"


def test_options_go_before_or_after_the_command(store):
    """Regression: `shmstore gc --json` was refused while `shmstore --json gc` worked."""
    for args in (("gc", "--json", "--name", store.name), ("--json", "--name", store.name, "gc")):
        r = run(*args)
        assert r.returncode == 0 and "removed" in json.loads(r.stdout)
    st = json.loads(run("status", "--name", store.name, "--json").stdout)
    assert st["name"] == store.name


def test_check_command(store):
    store.put("a", np.arange(10))
    r = run("check", "--name", store.name)
    assert r.returncode == 0 and "ok" in r.stdout
    assert json.loads(run("--name", store.name, "--json", "check").stdout) == {"ok": True, "problems": []}


def _segments(name: str) -> list[str]:
    import os
    return [s for s in os.listdir("/dev/shm") if f"-{name}-" in s]


@pytest.mark.slow
def test_a_look_at_a_dead_store_changes_nothing_and_gc_removes_it(name, tmp_path):
    """Regression: `shmstore status` on a store whose job died restarted a spill process, which then removed
    the store; looking must not change anything (stores, status, ls, info, check)."""
    import os
    dead_store(name, str(tmp_path))
    before = _segments(name)
    assert before and os.listdir(tmp_path)
    (mine,) = [s for s in json.loads(run("--json", "stores").stdout) if s["name"] == name]
    assert mine["stale"] and mine["clients"] == 0 and not mine["spill_alive"] and mine["uid"] == os.getuid()
    assert name in run("stores").stdout
    st = json.loads(run("--name", name, "--json", "status").stdout)
    assert not st["spill"]["alive"] and st["levels"]["memory"]["objects"] == 1
    (client,) = st["clients"]
    assert not client["alive"]
    text = run("--name", name, "status").stdout  # regression: said "clients 0 alive: 26040" (read as alive pids)
    assert f"clients: 0 alive, 1 dead (pid {client['pid']}: gone;" in text, text
    assert sorted(i["key"] for i in json.loads(run("--name", name, "--json", "ls").stdout)) == ["a", "b"]
    assert run("--name", name, "info", "a").returncode == 0
    assert json.loads(run("--name", name, "--json", "check").stdout)["ok"]
    time.sleep(1.0)  # a spill process started by a look would have removed the store by now
    assert _segments(name) == before and os.listdir(tmp_path)
    (mine,) = [s for s in json.loads(run("--json", "stores").stdout) if s["name"] == name]
    assert mine["stale"] and not mine["spill_alive"]
    removed = json.loads(run("gc", "--json", "--name", name).stdout)["removed"]
    assert removed == [f"{name}@{mine['node']}"]
    assert not _segments(name) and not os.listdir(tmp_path)


def test_gc_of_other_users_needs_root_and_removes_only_what_they_own(name, tmp_path):
    import os

    import pytest
    if os.getuid() != 0:
        r = run("gc", "--all-users")
        assert r.returncode == 1 and "root" in r.stderr
        pytest.skip("removing another user's store needs root (the Slurm epilog case); refused above as asked")
    user = 65534
    # Another user's job, killed whole. Python here lives under /root, which another user cannot run, so the
    # store is made as root and then handed over: its names, files and header become those of uid 65534.
    hand_over(name, str(tmp_path), user)
    segs = _segments(name)
    assert segs and all(s.startswith(("shmstore-65534-", "sem.shmstore-65534-")) for s in segs), segs
    theirs = [s for s in json.loads(run("--json", "stores", "--all-users").stdout) if s["name"] == name]
    assert theirs and theirs[0]["uid"] == user and theirs[0]["stale"]
    assert not [s for s in json.loads(run("--json", "stores").stdout) if s["name"] == name]  # not root's own
    removed = json.loads(run("gc", "--uid", str(user), "--name", name, "--json").stdout)["removed"]
    assert removed == [f"{name}@{theirs[0]['node']} (uid {user})"], removed
    assert not _segments(name) and not os.listdir(tmp_path)


def test_ls_all_sessions_lists_every_session_with_a_session_column(store):
    """Issue 21 item 8: objects put through the connector live in session 'proxystore'; `ls` shows the
    connection's session only, `ls --all-sessions` every session's, each line led by its session."""
    store.put("plain", b"x")
    with shmstore.connect(store.name, session="proxystore") as proxied:
        proxied.put("proxied", np.zeros(10))
        assert run("--name", store.name, "ls").stdout.split() == ["plain", "1", "B", "memory", "bytes"]
        text = run("--name", store.name, "ls", "--all-sessions").stdout
        assert [line.split("\t")[:2] for line in text.splitlines()] == [["-", "plain"], ["proxystore", "proxied"]]
        listed = json.loads(run("--name", store.name, "--json", "ls", "--all-sessions").stdout)
        assert sorted((i["session"], i["key"]) for i in listed) == [("", "plain"), ("proxystore", "proxied")]
        r = run("--name", store.name, "info", "proxied")  # a miss names the session that holds it
        assert r.returncode == 1 and "session 'proxystore' holds it" in r.stderr


# ---- issue item 9: what the command says ------------------------------------------------------------------

def test_info_says_sizes_in_binary_units_and_created_as_a_local_date_time(store):
    """Regression: `info` printed size and stored in bytes and created as seconds since the epoch; --json keeps
    those raw values."""
    store.put("arr", np.zeros(1 << 17))
    info = store.get_info("arr")
    text = run("--name", store.name, "info", "arr").stdout
    fields = dict(line.split(": ", 1) for line in text.splitlines())
    assert fields["size"] == "1.0 MiB" and fields["stored"] == format_size(info.stored), text
    made = time.mktime(time.strptime(fields["created"][:19], "%Y-%m-%d %H:%M:%S"))  # local time
    assert abs(made - info.created) < 1.0, text
    raw = json.loads(run("--name", store.name, "--json", "info", "arr").stdout)
    assert raw["size"] == 1 << 20 and raw["stored"] == info.stored and raw["created"] == info.created


def test_status_names_a_process_connected_twice_once(store):
    """Regression: a process with two connections (two sessions) was listed as `clients: 2 alive (pids 7, 7)`."""
    with shmstore.connect(store.name, session="other"):
        text = run("--name", store.name, "status").stdout
        st = json.loads(run("--name", store.name, "--json", "status").stdout)
    assert f"clients: 1 alive (pid {os.getpid()}, 2 connections)" in text, text
    assert [c["pid"] for c in st["clients"]] == [os.getpid()] * 2  # --json: one entry per connection


def test_destroy_refused_names_the_commands_flag(store):
    """Regression: `shmstore destroy NAME` refused with "... or pass force=True", the Python spelling."""
    r = run("destroy", store.name)
    assert r.returncode == 1 and "or pass --force" in r.stderr and "force=True" not in r.stderr, r.stderr
    assert f"(pid {os.getpid()})" in r.stderr
    with pytest.raises(shmstore.StoreInUseError, match=r"or pass force=True$"):  # the API keeps its own
        shmstore.destroy(store.name)


def test_a_pinned_move_names_the_key_once(name, tmp_path):
    """Regression: "shmstore: 'a': 'a' is pinned (...)"."""
    with shmstore.connect(name, capacity="16MiB", spill_dir=str(tmp_path)) as s:
        s.put("a", b"x")
        s.pin("a")
        r = run("--name", name, "move", "a", "disk")
        assert r.returncode == 1 and r.stderr.count("'a'") == 1 and "is pinned" in r.stderr, r.stderr
        s.unpin("a")


def _stop_mid_move(s, key: str, level: Level) -> tuple[int, threading.Thread]:
    """Start moving ``key`` to ``level`` in a thread and SIGSTOP the spill process while it copies: its pid and
    the thread (join it after SIGCONT).

    Where the copy ended before the stop (a busy machine), the object goes back and it is tried again."""
    spill = s.spill_pid
    for _ in range(5):
        mover = threading.Thread(target=s.move, args=(key, level), name="test-mover")
        mover.start()
        deadline = time.monotonic() + 30
        while s.status()["moving"] is None and mover.is_alive() and time.monotonic() < deadline:
            pass  # no sleep: the copy takes a few tens of milliseconds
        os.kill(spill, signal.SIGSTOP)
        moving = s.status()["moving"]
        if moving is not None and moving["done"] < moving["total"]:
            return spill, mover
        os.kill(spill, signal.SIGCONT)
        mover.join()
        s.move(key, Level.MEMORY)
    raise AssertionError("the spill process never stopped mid-copy in 5 tries")


def test_move_shows_its_own_progress_not_another_objects(name, tmp_path):
    """Regression: `shmstore move cold memory` printed the progress of whatever the spill process was moving,
    here another client's move of 'big' to disk that the command's request waited behind, as its own."""
    with shmstore.connect(name, capacity="256MiB", spill_dir=str(tmp_path)) as s:
        s.put("cold", np.ones(1 << 20), levels=[Level.DISK])
        s.put("big", np.zeros(128 << 17))  # 128 MiB
        spill, mover = _stop_mid_move(s, "big", Level.DISK)
        try:
            cli = subprocess.Popen([sys.executable, "-m", "shmstore", "--name", name, "move", "cold", "memory"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            assert wait_for(lambda: cli.pid in [c["pid"] for c in s.status()["clients"]], timeout=30)
            time.sleep(1.0)  # its request submitted, waiting behind big's move, reading the spill state
        finally:
            os.kill(spill, signal.SIGCONT)
            mover.join()
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 0 and out == "'cold' is on memory\n", (out, err)
        assert "to disk" not in err and all("'cold' to memory" in ln for ln in err.split("\r") if ln.strip()), err
        assert s.get_info("cold").level == Level.MEMORY and s.get_info("big").level == Level.DISK


def test_gc_job_removes_that_jobs_store_and_says_what_plain_gc_covers(tmp_path):
    """`gc --job JOBID` removes the store a Slurm job names job-JOBID (and no MPI segments); the help says that
    plain `gc` removes every stale store of the user on the host, not only this job's."""
    job = unique_name()  # a job id of this test alone
    store = f"job-{job}"
    dead_store(store, str(tmp_path))
    try:
        r = run("gc", "--job", job, "--name", "other")
        assert r.returncode == 1 and f"--job {job} is store {store!r}, not --name 'other'" in r.stderr, r.stderr
        assert _segments(store)
        r = run("gc", "--job", job)
        assert r.returncode == 0 and r.stdout.startswith(f"removed {store}@"), (r.stdout, r.stderr)
        assert not _segments(store) and not os.listdir(tmp_path)
        assert run("gc", "--job", job).stdout.strip() == f"no stale store {store!r} of yours on this host"
    finally:  # not a name of this test run's: the leak check would leave it
        for seg in _segments(store):
            os.unlink(os.path.join("/dev/shm", seg))
    usage = " ".join(run("gc", "--help").stdout.split())
    assert "without --name or --job every such store of yours on this host, not only this job's" in usage


def test_plain_gc_says_it_removed_every_stale_store_of_the_user(name, tmp_path):
    """Plain `gc` (here of a uid of this test alone, so that it touches nobody else's store) says that it took
    every stale store of that user on this host, and how to take one only."""
    if os.getuid() != 0:
        pytest.skip("a store of another uid (of this test alone) needs root; plain gc of yours would remove "
                    "other programs' stale stores")
    uid = 65000 + random.randrange(400)
    hand_over(name, str(tmp_path), uid)
    try:
        r = run("gc", "--uid", str(uid))
        node = Config.from_kwargs().node
        assert r.stdout.splitlines()[0] == (
            f"removed {name}@{node} (uid {uid}): every stale store of uid {uid} on this host, not only this "
            f"job's (--name NAME or --job JOBID removes only that store)"), r.stdout
        assert run("gc", "--uid", str(uid)).stdout.strip() == f"no stale stores of uid {uid} on this host"
    finally:
        for seg in _segments(name):
            os.unlink(os.path.join("/dev/shm", seg))
