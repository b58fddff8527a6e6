"""Helpers for tests with real processes: spawn interpreters, wait with deadlines."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every store this test run makes is named SUITE + something: the leak check removes only names of this run
# (another program's store, another test run's, is reported and left alone). Set in the environment so that
# processes the tests start (mpiexec ranks) name their stores the same way.
SUITE = os.environ.setdefault("SHMSTORE_TEST_SUITE", "t" + uuid.uuid4().hex[:6] + "s")


def unique_name(tag: str = "") -> str:
    """A fresh store name of this test run (``SUITE``, ``tag``, random hex)."""
    return SUITE + tag + uuid.uuid4().hex[:8]


def job_name(tag: str = "") -> str:
    """A fresh store name of this test run, the same on every rank of ``MPI.COMM_WORLD`` (collective: rank 0's
    :func:`unique_name`; the ranks of a job the suite starts share its ``SUITE``)."""
    from mpi4py import MPI
    return MPI.COMM_WORLD.bcast(unique_name(tag) if MPI.COMM_WORLD.rank == 0 else None)


def drain(comm, seconds: float = 0.5) -> None:
    """Take every message left on ``comm`` for ``seconds`` (a communicator no service reads, after a test's
    calls on it gave up: MPI warns of messages never received when it is freed)."""
    from mpi4py import MPI
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if comm.iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
            comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` with backoff until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
        interval = min(interval * 1.5, 0.2)


def view_arena(store) -> tuple[int, int]:
    """(address, size) of the arena's read-only mapping in this process: what the views ``get`` hands out point
    into (the writable mapping that puts copy into is another range, ``store.kernel._at.arena_addr``)."""
    import numpy as np
    first = np.frombuffer(store.node_store.arena_ro, np.uint8, 1)
    return int(first.ctypes.data), store.node_store.capacity


def shm_segments(prefix: str = "shmstore-") -> list[str]:
    """This user's shmstore segments and semaphores in /dev/shm."""
    mine = (prefix + str(os.getuid()), "sem." + prefix + str(os.getuid()))
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(mine))


def of_this_run(segment: str) -> bool:
    """Whether a /dev/shm entry (``shmstore-<uid>-<name>-...``, ``sem.shmstore-...``) is a store of this test
    run's (its name starts with ``SUITE``)."""
    bare = segment[len("sem."):] if segment.startswith("sem.") else segment
    return bare.startswith(f"shmstore-{os.getuid()}-{SUITE}")


def children() -> list[int]:
    """Pids of live (non-zombie) child processes of this process."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] not in (b"Z", b"X"):
            out.append(int(entry))
    return out


def spill_popen(pid: int):
    """The Popen of a spill process this test process started."""
    from shmstore.primitives.procs import spawned
    return next(p for p in spawned if p.pid == pid)


def spill_processes(name: str) -> list[str]:
    """Command lines of the live spill processes of store ``name`` (any process's)."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "shmstore.spill" in cmd and name in cmd:
            out.append(cmd)
    return out


def spill_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def child_path() -> str:
    """The PYTHONPATH of a child Python: this checkout, and the CuPy stand-in where the run uses it (so that a
    child's ``import cupy`` finds the same CuPy as the test)."""
    stand_in = os.environ.get("SHMSTORE_FAKE_CUPY")
    return os.pathsep.join([ROOT, stand_in] if stand_in else [ROOT])


class Child:
    """A Python interpreter running ``code``; talks over stdin/stdout lines."""

    def __init__(self, code: str, env: dict[str, str] | None = None) -> None:
        full_env = dict(os.environ, PYTHONPATH=child_path(), **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, daemon=True, name=f"child-{self.pid}-stdout")
        self._reader.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def readline(self, timeout: float = 30.0) -> str:
        """Next stdout line (raises if the child dies or takes too long)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            os.kill(self.pid, signal.SIGKILL)
            err = self.proc.stderr.read()
            self.kill()
            raise TimeoutError(f"child {self.pid} silent for {timeout} s; stderr: {err}") from None
        if line is None:
            rc, err = self.proc.wait(), self.proc.stderr.read()
            self._close_pipes()
            raise RuntimeError(f"child {self.pid} exited ({rc}): {err}")
        return line.strip()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._close_pipes()

    def wait(self, timeout: float = 60.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        if rc != 0:
            err = self.proc.stderr.read()
            self._close_pipes()
            raise AssertionError(f"child {self.pid} failed with {rc}: {err}")
        self._close_pipes()
        return rc

    def _close_pipes(self) -> None:
        self._reader.join(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f and not f.closed:
                f.close()


DEAD_JOB = """
import os, sys, numpy as np, shmstore
s = shmstore.connect(os.environ['N'], capacity='16MiB', spill_dir=os.environ['D'])
s.put('a', np.arange(1000))
s.put('b', np.arange(1000), levels=[shmstore.Level.DISK])
print(s.spill_pid, flush=True)
sys.stdin.readline()
"""


def dead_store(name: str, spill_dir: str) -> None:
    """A store whose job was SIGKILLed whole, its spill process too (what a batch system's cleanup does)."""
    child = Child(DEAD_JOB, env={"N": name, "D": spill_dir})
    spill = int(child.readline(timeout=60))
    os.kill(spill, signal.SIGKILL)
    child.kill()
    assert wait_for(lambda: not spill_running(spill), timeout=10)


def hand_over(name: str, spill_dir: str, uid: int) -> None:
    """A dead store of user ``uid``: made here (this interpreter lives under root's home, which another user
    cannot run), then given its names, files and header."""
    import mmap

    from shmstore.meta import layout as L
    dead_store(name, spill_dir)
    for seg in [s for s in os.listdir("/dev/shm") if f"-{name}-" in s]:
        new = seg.replace(f"shmstore-{os.getuid()}-", f"shmstore-{uid}-", 1)
        os.rename(os.path.join("/dev/shm", seg), os.path.join("/dev/shm", new))
        os.chown(os.path.join("/dev/shm", new), uid, uid)
        if new.endswith("-meta"):
            fd = os.open(os.path.join("/dev/shm", new), os.O_RDWR)
            with mmap.mmap(fd, L.HEADER_SIZE) as mm:
                L.HEADER.set(mm, 0, "uid", uid)
            os.close(fd)
    (folder,) = os.listdir(spill_dir)
    moved = os.path.join(spill_dir, folder.replace(f"shmstore-{os.getuid()}-", f"shmstore-{uid}-", 1))
    os.rename(os.path.join(spill_dir, folder), moved)
    for f in [moved] + [os.path.join(moved, x) for x in os.listdir(moved)]:
        os.chown(f, uid, uid)


def check_arena(node) -> None:
    """Assert the arena's extents tile it exactly and every live object lies in its extent."""
    import numpy as np

    from shmstore.meta import layout as L
    buf, lay = node.buf, node.layout
    with node.alloc_lock:
        ext = L.extent_table(buf, lay).copy()
        t = L.entry_table(buf, lay).copy()
    used = ext[np.isin(ext["flags"], [L.EXT_USED, L.EXT_CHUNK, L.EXT_RETIRED])]
    spans = sorted([(int(o), int(s)) for o, s in zip(used["offset"], used["size"])] + node.alloc.free_extents())
    pos = 0
    for off, size in spans:
        assert off == pos, f"extents overlap or leave a gap at {pos} (next at {off})"
        pos = off + size
    assert pos == node.capacity
    live = np.isin(t["state"], [L.WRITING, L.SEALED, L.DELETED]) & (t["level"] == 1)
    for i in np.flatnonzero(live):
        x = ext[t["extent"][i] - 1]
        assert x["flags"] in (L.EXT_USED, L.EXT_CHUNK, L.EXT_RETIRED)
        assert x["offset"] <= t["offset"][i] and t["offset"][i] + t["size"][i] <= x["offset"] + x["size"]


_BYSTANDER = """
import os, sys, numpy as np, shmstore
s = shmstore.connect(os.environ['N'], capacity='8MiB', spill_dir=os.environ['D'], prefault=0)
a = np.random.default_rng(19).integers(0, 1 << 40, 50_000)
s.put('mem', a)
s.put('disk', a[::-1].copy(), levels=[shmstore.Level.DISK])
print('ready', flush=True)
sys.stdin.readline()  # attached until the run ends
s.close()
"""

_VERIFY = """
import os, numpy as np, shmstore
a = np.random.default_rng(19).integers(0, 1 << 40, 50_000)
with shmstore.connect(os.environ['N'], create=False, prefault=0) as s:
    assert np.array_equal(s.get('mem'), a) and np.array_equal(s.get('disk'), a[::-1]), 'its objects changed'
    problems = s.check()
    assert not problems, problems
print('intact', flush=True)
"""


class Bystander:
    """A live store of another program (its name is not of this run): one client attached all along, an
    object in memory and one on disk. Each test's teardown checks that every file of it is still the very
    same file (inode by inode: removed and remade is caught too); the end of the run also reads its objects
    from a fresh process and checks its invariants. A test or a leak check that removes others' segments
    (the bug of issue 19: this conftest unlinked whatever appeared while a test ran) fails right there."""

    def __init__(self, spill_dir: str) -> None:
        self.name = "bystander" + uuid.uuid4().hex[:10]
        assert not self.name.startswith(SUITE)
        self.child = Child(_BYSTANDER, env={"N": self.name, "D": spill_dir})
        assert self.child.readline(timeout=60) == "ready"
        from shmstore.config import Config
        prefix = f"shmstore-{os.getuid()}-{self.name}-{Config.from_kwargs().node}"
        folder = os.path.join(spill_dir, prefix)
        paths = [f"/dev/shm/{prefix}-meta", f"/dev/shm/{prefix}-arena", f"/dev/shm/sem.{prefix}-wake", folder]
        paths += [os.path.join(folder, f) for f in os.listdir(folder)]
        self.files = {p: os.lstat(p).st_ino for p in paths}
        assert len(self.files) >= 5, self.files  # three names in /dev/shm, the spill directory and a file

    def owns(self, segment: str) -> bool:
        return f"-{self.name}-" in segment

    def damage(self) -> list[str]:
        """What happened to it: files removed or replaced, its client gone."""
        out = []
        for path, ino in self.files.items():
            try:
                if os.lstat(path).st_ino != ino:
                    out.append(f"{path} was replaced")
            except FileNotFoundError:
                out.append(f"{path} was removed")
        if self.child.proc.poll() is not None:
            out.append(f"its client (pid {self.child.pid}) died")
        return out

    def verify(self) -> None:
        check = Child(_VERIFY, env={"N": self.name})
        assert check.readline(timeout=60) == "intact"
        check.wait()

    def close(self) -> None:
        if self.child.proc.poll() is None:
            self.child.send("")
            self.child.wait()
        else:
            self.child.kill()  # reaps it and closes the pipes
        assert wait_for(lambda: not any(self.owns(s) for s in shm_segments()), timeout=15)
