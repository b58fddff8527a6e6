"""The spill process (``spill/process.py``, ``python -m shmstore.spill``) as its own program.

Each test makes a store of its own with no ``Store`` around it: the node
store (``NodeStore.open``), one client (a ``Kernel`` on a slot, its levels
opened as a ``Store`` opens them) and the spill process started the way a
store starts it (``spill/supervisor.ensure_spill``: ``python -m shmstore.spill``,
its pid written into the store's header). The client talks to it through its
request record (``spill/requests.py``); the process is watched from outside:
its exit status, its log, the store's segments and spill files.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from shmstore import Level
from shmstore.client.kernel import Kernel
from shmstore.config import Config
from shmstore.levels.registry import open_levels
from shmstore.meta import layout as L
from shmstore.node.check import check
from shmstore.node.nodestore import NodeStore
from shmstore.spill import requests
from shmstore.spill.process import POLL, TERM_GRACE
from shmstore.spill.supervisor import ensure_spill, spill_alive

from helpers import ROOT, Child, shm_segments, spill_popen, spill_running, wait_for

MiB = 1 << 20
CAPACITY = 32 * MiB
OBJECTS = 6  # of 4 MiB: 24 MiB of 32, under the high watermark (nothing spills unasked)


class Client:
    """A store made here, one client on it, and (once started) its spill process."""

    def __init__(self, node: NodeStore) -> None:
        self.node = node
        slot = node.register()
        node.use_levels(open_levels(node, functools.partial(requests.request_arena, node, slot)))
        self.kernel = Kernel(node, slot, "")
        self.slot = slot
        self.proc: subprocess.Popen[bytes] | None = None
        self.left = False

    def leave(self) -> None:
        """Detach as a ``Store``'s last client does: wake the spill process, which removes the store, or
        remove it here when none runs; then unmap (and let go of the spill directory)."""
        if self.left:
            return
        self.left = True
        self.kernel.close()
        if spill_alive(self.node):
            self.node.wake.post()
        else:
            self.node.remove_if_unused()
        self.node.close()

    def start_spill(self) -> int:
        """Start the spill process as a store does; returns its pid once it has gone round its loop."""
        since = time.time()
        pid = ensure_spill(self.node)
        self.proc = spill_popen(pid)
        assert wait_for(lambda: L.unpack_spill_state(self.node.buf).heartbeat > since, timeout=30), \
            f"spill process {pid} never went round its loop (exit status {self.proc.poll()})"
        return pid

    def exit_status(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)

    def fill(self) -> dict[str, int]:
        """Put OBJECTS arrays of 4 MiB in memory; returns their CRCs by key."""
        crcs = {}
        for i in range(OBJECTS):
            value = np.full(MiB // 2, i, np.float64)
            self.kernel.put(f"o{i}", value)
            crcs[f"o{i}"] = zlib.crc32(value)
        return crcs

    def crcs(self) -> dict[str, int]:
        out = {}
        for info in self.kernel.list():
            view = self.kernel.get(info.key)
            out[info.key] = zlib.crc32(np.ascontiguousarray(view))
            del view  # a pin: the spill process would not move it
        return out

    def ask(self, kind: int, nbytes: int = 0, level: int = int(Level.MEMORY), timeout: float = 30) -> L.Request:
        """Send a request and wait for its answer (fails on no answer within ``timeout``)."""
        seq = requests.submit(self.node, self.slot, kind, nbytes=nbytes, level=level)
        r = requests.wait(self.node, self.slot, seq, timeout)
        assert r is not None, f"no answer from the spill process in {timeout} s"
        return r

    def segments(self) -> list[str]:
        return [s for s in shm_segments() if f"-{self.node.cfg.name}-" in s]


@pytest.fixture
def client(name, tmp_path):
    cfg = Config.from_kwargs(name=name, capacity=CAPACITY, spill_dir=str(tmp_path / "spill"), prefault=0)
    node = NodeStore.open(cfg)
    try:
        c = Client(node)
    except BaseException:
        node.unlink()
        node.close()
        raise
    try:
        yield c
    finally:
        c.leave()  # the last client: its spill process removes the store and exits
        if c.proc is not None:
            assert c.exit_status(30) == 0


def largest_free(c: Client) -> int:
    return c.node.levels[Level.MEMORY].largest_free()


def test_it_makes_room_when_asked(client):
    crcs = client.fill()
    client.start_spill()
    assert largest_free(client) < 16 * MiB and not client.kernel.list(Level.DISK)  # nothing spilled unasked
    r = client.ask(L.REQ_SPACE, 16 * MiB)
    assert r.status == L.RS_DONE, r.message
    assert largest_free(client) >= 16 * MiB
    assert len(client.kernel.list(Level.DISK)) >= 2  # 4 MiB objects, spilled least recently used first
    assert client.crcs() == crcs
    assert check(client.node) == []


def test_a_request_it_cannot_serve_fails_with_the_reason(client):
    crcs = client.fill()
    for key in crcs:
        client.kernel.pin(key)
    client.start_spill()
    r = client.ask(L.REQ_SPACE, 16 * MiB)
    assert r.status == L.RS_FAILED and r.error == L.ERR_FULL
    assert "cannot make 16.0 MiB of room" in r.message and "pinned" in r.message, r.message
    r = client.ask(L.REQ_SPACE, MiB, level=7)
    assert r.status == L.RS_FAILED and "no level 7" in r.message, r.message
    for key in crcs:
        client.kernel.unpin(key)
    assert not client.kernel.list(Level.DISK) and client.crcs() == crcs
    assert client.proc is not None and client.proc.poll() is None  # a failed request costs the node nothing


@pytest.fixture
def logged(tmp_path, monkeypatch):
    """The spill processes started from now on log to this file, at ``info``."""
    path = tmp_path / "spill.log"
    monkeypatch.setenv("SHMSTORE_LOG_FILE", str(path))
    monkeypatch.setenv("SHMSTORE_LOG", "info")
    return path


def test_sigterm_with_its_client_gone_removes_the_store_and_exits(client, logged):
    """SIGTERM, then the job's last client leaves within the grace: the spill process, draining, removes the
    store (segments and spill files) and exits 0, its log saying so."""
    assert 2 * POLL < TERM_GRACE / 2
    client.kernel.put("d", np.arange(100_000), Level.DISK)
    folder = client.node.spill_path
    pid = client.start_spill()
    assert client.segments() and os.listdir(folder)
    os.kill(pid, signal.SIGTERM)
    time.sleep(TERM_GRACE / 2)  # in its drain by now (it looks at the flag every POLL seconds), waiting for us
    assert spill_running(pid)
    client.leave()  # the job's client goes, within the grace
    assert client.exit_status(TERM_GRACE + 20) == 0
    assert client.segments() == [] and not os.path.exists(folder)
    log = logged.read_text()
    assert f"shmstore-spill[{pid}]" in log and "last client gone; removed the store and 1 spill file(s)" in log, log


@pytest.mark.slow
def test_sigterm_with_a_client_attached_exits_and_leaves_the_store_to_it(client, logged):
    """SIGTERM while a client stays: the spill process waits its grace, logs that the client keeps the
    store, and exits 0; the store is whole, and the client (the last) removes it."""
    crcs = client.fill()
    pid = client.start_spill()
    started = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    assert client.exit_status(TERM_GRACE + 20) == 0
    assert time.monotonic() - started >= TERM_GRACE * 0.9  # it waited for the client to leave
    assert not spill_running(pid) and client.segments()
    assert client.crcs() == crcs and check(client.node) == []
    log = logged.read_text()
    assert "SIGTERM: 1 client(s) still attached; they keep the store" in log, log


def spill_main(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m shmstore.spill`` with ``args``, to its end."""
    return subprocess.run([sys.executable, "-m", "shmstore.spill", *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))


def test_a_second_spill_process_leaves_the_store_to_the_first(client):
    """One spill process per store: the one whose pid the store's header holds. Another started by hand
    for the same store says which one serves it and exits 0 without touching the store."""
    crcs = client.fill()
    first = client.start_spill()
    cfg = client.node.cfg
    second = spill_main("--name", cfg.name, "--node", cfg.node, "--spill-dir", cfg.spill_dir)
    assert second.returncode == 0, second.stderr
    assert f"spill process {first} serves this store, not this one" in second.stderr, second.stderr
    assert client.node.spill_pid() == first and spill_running(first)
    assert client.crcs() == crcs and check(client.node) == []
    r = client.ask(L.REQ_SPACE, 16 * MiB)  # the first still serves
    assert r.status == L.RS_DONE, r.message


@pytest.mark.parametrize("args, env, says", [
    (["--name", "bad/name", "--node", "n1"], {}, "bad value for name=: 'bad/name' must be"),
    (["--name", "NAME", "--node", "a b"], {}, "bad value for node=: 'a b' must be"),
    (["--name", "NAME", "--node", "n1"], {"SHMSTORE_LOCK_TIMEOUT": "-1"}, "bad value for SHMSTORE_LOCK_TIMEOUT"),
    (["--node", "n1"], {}, "the following arguments are required: --name"),
], ids=["name", "node", "environment", "missing"])
def test_a_bad_argument_is_refused_naming_the_setting(name, tmp_path, args, env, says):
    log = tmp_path / "spill.log"
    args = [name if a == "NAME" else a for a in args]
    r = spill_main(*args, "--spill-dir", str(tmp_path), "--log-file", str(log), env=env)
    assert r.returncode == 2 and says in r.stderr, (r.returncode, r.stderr)
    if "--name" in args:  # past argparse: the log (where its stderr may be /dev/null) has it too
        assert says in log.read_text()
    assert not [s for s in shm_segments() if f"-{name}-" in s]  # nothing made
    assert os.listdir(tmp_path) == (["spill.log"] if "--name" in args else [])


def test_a_store_that_is_gone_is_no_error(name, tmp_path):
    """Started for a store removed meanwhile (its last client closed): exits 0, creating nothing."""
    r = spill_main("--name", name, "--node", "n1", "--spill-dir", str(tmp_path))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert not [s for s in shm_segments() if f"-{name}-" in s] and os.listdir(tmp_path) == []


def test_wait_spill_ready_returns_once_it_has_started_and_false_when_it_is_dead(name):
    """Store.wait_spill_ready (what a Cluster's constructor waits for): True once the spill process went through
    its start-up (its first heartbeat is written before its first nap), False at once where it is dead."""
    import os
    import signal
    import time

    import shmstore
    with shmstore.connect(name, capacity=CAPACITY, prefault=0) as store:
        t = time.monotonic()
        assert store.wait_spill_ready(30)
        assert store.status()["spill"]["heartbeat"] > 0 and time.monotonic() - t < 30
        pid = store.status()["spill"]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while spill_running(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        L.SPILL_STATE.set(store.node_store.buf, L.SPILL_OFFSET, "heartbeat", 0.0)
        t = time.monotonic()
        assert store.wait_spill_ready(5) is False and time.monotonic() - t < 1


def test_the_spill_process_runs_on_the_jobs_cpus_not_on_the_core_its_starter_is_pinned_to(name, tmp_path):
    """A rank pinned to one core (Intel MPI's default, ``srun --cpu-bind``) starts the store: its spill process
    must not share that one core (issue 35 item 5: it ran 0.16 s in a minute, clients gave up after 60 s)."""
    from shmstore.primitives.procs import allowed_cpus
    cpus = allowed_cpus()
    if len(cpus) < 2:
        pytest.skip(f"this machine's cgroup allows one CPU ({cpus}): nothing to widen to")
    child = Child("""
import json, os, shmstore
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
s = shmstore.connect(os.environ['N'], spill_dir=os.environ['D'])
assert s.wait_spill_ready(60)
print(json.dumps([sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(s.node_store.spill_pid()))]),
      flush=True)
s.close()
""", env={"N": name, "D": str(tmp_path)})
    mine, spill = json.loads(child.readline())
    assert len(mine) == 1 and set(spill) == cpus, (mine, spill)
    child.wait()
