"""Signals that land inside the store's verbs reach the program under the tools users run it with.

The store defers a signal that lands in its code to the end of the verb (``interrupts.py``). It used to see
that end only through the frame's ``f_trace``, which coverage's C tracer (``coverage run``, ``pytest
--cov``) never calls: 10 of 20 Ctrl-Cs inside verbs never raised, a handler that counts saw 12 calls for 25
signals, and a SIGTERM handler calling ``sys.exit(0)`` never ran (the process was alive 15 s later: a
cancelled Slurm job waits for its kill timeout). Here a program loops over verbs (puts, gets, overwrites)
under plain Python, ``coverage run``, ``cProfile`` and a pdb breakpoint, and another process signals it:
every SIGINT must come out as one ``KeyboardInterrupt``, every SIGUSR1 as one handler call, and SIGTERM must
end it through its handler (exit status 0, the store closed behind it), each within seconds.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import ROOT, shm_segments, unique_name, wait_for

# what both programs start with: a SIGUSR1 handler that counts, a SIGTERM handler that exits
HANDLERS = r'''
import os, signal, sys
import numpy as np
import shmstore

counts = {"usr1": 0, "int": 0}


def on_usr1(signum, frame):
    counts["usr1"] += 1
    os.write(1, b"U%d\n" % counts["usr1"])


def on_term(signum, frame):
    os.write(1, b"TERM\n")
    sys.exit(0)


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGTERM, on_term)
'''

PROGRAM = HANDLERS + r'''
name = sys.argv[1]


def never_called():
    return "never"  # pdb's breakpoint: its tracer stays on, and it never stops

with shmstore.connect(name, capacity="64MiB") as s:
    os.write(1, b"READY\n")
    i = 0
    while True:
        try:
            while True:
                s.put(f"k{i % 50}", np.full(2000, i), overwrite=True)
                s.get(f"k{(i * 7) % 50}", None)
                s.put(f"b{i % 20}", b"x" * (i % 300), overwrite=True)
                i += 1
        except KeyboardInterrupt:
            counts["int"] += 1
            os.write(1, b"I%d\n" % counts["int"])
'''
NEVER_HIT = PROGRAM.splitlines().index('    return "never"  # pdb\'s breakpoint: its tracer stays on, and it never '
                                       'stops') + 1

TOOLS = {
    "plain": [],
    "coverage": ["-m", "coverage", "run", "--data-file={data}"],
    "cprofile": ["-m", "cProfile", "-o", "{data}"],
    "pdb": ["-m", "pdb", "-c", "break {program}:" + str(NEVER_HIT), "-c", "continue"],
}


class _Lines:
    """The child's stdout, line by line, with a deadline per line."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.q: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(p,), name=f"child-{p.pid}-stdout", daemon=True).start()

    def _read(self, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            self.q.put(line.strip())

    def expect(self, want: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {want!r} within {timeout:g} s; saw {self.seen[-10:]}")
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line == want:
                return


def _signal_and_end(p: subprocess.Popen, lines: _Lines, tool: str, ready: list[str], exit_wait: float) -> None:
    """Wait for the ``ready`` lines, then 20 Ctrl-Cs (none under pdb: it takes Ctrl-C for itself, breaking into
    the debugger), 20 SIGUSR1s, each answered before the next, and a SIGTERM that must end the program with
    status 0; the program is killed if it is still there after."""
    try:
        for want in ready:
            lines.expect(want, 60)
        for n in range(1, 21 if tool != "pdb" else 1):
            time.sleep(0.02)  # it is inside a verb most of the time
            p.send_signal(signal.SIGINT)
            lines.expect(f"I{n}")
        for n in range(1, 21):
            time.sleep(0.02)
            p.send_signal(signal.SIGUSR1)
            lines.expect(f"U{n}")
        time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        lines.expect("TERM")
        assert p.wait(timeout=exit_wait) == 0, lines.seen[-20:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_signal_inside_verbs_reaches_the_program_under(tool, tmp_path):
    if tool == "coverage":
        pytest.importorskip("coverage", reason="pip install coverage (in the [test] extra)")
    name = unique_name("sig")
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    args = [a.format(data=tmp_path / "data", program=program) for a in TOOLS[tool]]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, *args, str(program), name], cwd=tmp_path, env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _signal_and_end(p, _Lines(p), tool, ["READY"], 30)
    assert wait_for(lambda: not [s for s in shm_segments() if f"-{name}-" in s], timeout=15)


CHECKPOINTS = HANDLERS + r'''
name, pdir = sys.argv[1], sys.argv[2]
with shmstore.connect(name, capacity="64MiB", persist_dir=pdir) as s:
    os.write(1, b"READY\n")
    i = 0
    while True:
        try:
            while True:
                i += 1
                ck = s.checkpoint(f"ck{i}", {"a": np.full(50_000, i, dtype=np.int64), "step": i,
                                             "b": bytes([i % 251]) * (i % 5000)})
                if ck.wait(60):
                    os.write(1, b"D%d\n" % i)  # complete: a restore may never find an older one
        except KeyboardInterrupt:
            counts["int"] += 1
            os.write(1, b"I%d\n" % counts["int"])
'''


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.slow
def test_signals_inside_checkpoints_under_tools_reach_the_program_and_the_newest_complete_one_restores_whole(
        tool, tmp_path):
    """Issue 34 under the tools of issue 30: a program checkpointing in a loop (the put, then the wait for the
    spill process's flush) takes 20 Ctrl-Cs, 20 SIGUSR1s and a SIGTERM whose handler exits; every signal reaches
    it, and after it a restore from the folder gives a checkpoint at least as new as the last one it saw
    complete, every value of it whole and of one step."""
    if tool == "coverage":
        pytest.importorskip("coverage", reason="pip install coverage (in the [test] extra)")
    name = unique_name("sigck")
    pdir = tmp_path / "ck"
    program = tmp_path / "program.py"
    program.write_text(CHECKPOINTS)
    args = [a.format(data=tmp_path / "data", program=program) for a in TOOLS[tool]]
    if tool == "pdb":
        args = ["-m", "pdb", "-c", "continue"]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, *args, str(program), name, str(pdir)], cwd=tmp_path, env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = _Lines(p)
    _signal_and_end(p, lines, tool, ["READY", "D1"], 60)
    last_done = max(int(line[1:]) for line in lines.seen if line[:1] == "D" and line[1:].isdigit())
    assert wait_for(lambda: not [s for s in shm_segments() if f"-{name}-" in s], timeout=60)

    import shmstore
    with shmstore.connect(name, capacity="16MiB", persist_dir=pdir) as s:
        got = s.restore()
        step = int(got["step"])
        assert got.name == f"ck{step}" and step >= last_done, (got.name, last_done)
        a = got["a"]
        assert a.shape == (50_000,) and bool((a == step).all())
        assert bytes(got["b"]) == bytes([step % 251]) * (step % 5000)
        assert set(got.origins.values()) == {"folder"}
        del got, a
    shmstore.destroy(name)
