"""The shmstore command, run as a real process."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

import shmstore

from helpers import ROOT, dead_store, hand_over


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
