"""The shmstore command, run as a real process."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from helpers import ROOT


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
    for args in (("gc", "--json"), ("--json", "gc")):
        r = run(*args)
        assert r.returncode == 0 and "removed" in json.loads(r.stdout)
    st = json.loads(run("status", "--name", store.name, "--json").stdout)
    assert st["name"] == store.name


def test_check_command(store):
    store.put("a", np.arange(10))
    r = run("check", "--name", store.name)
    assert r.returncode == 0 and "ok" in r.stdout
    assert json.loads(run("--name", store.name, "--json", "check").stdout) == {"ok": True, "problems": []}
