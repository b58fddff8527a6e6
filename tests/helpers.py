"""Helpers for tests with real processes: spawn interpreters, wait with deadlines."""
from __future__ import annotations

import os
import queue
import signal
import threading
import subprocess
import sys
import textwrap
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def shm_segments(prefix: str = "shmstore-") -> list[str]:
    """This user's shmstore segments and semaphores in /dev/shm."""
    mine = (prefix + str(os.getuid()), "sem." + prefix + str(os.getuid()))
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(mine))


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


def spill_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


class Child:
    """A Python interpreter running ``code``; talks over stdin/stdout lines."""

    def __init__(self, code: str, env: dict[str, str] | None = None) -> None:
        full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
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


def check_arena(node) -> None:
    """Assert the arena's extents tile it exactly and every live object lies in its extent."""
    import numpy as np
    from shmstore.kernel import layout as L
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
