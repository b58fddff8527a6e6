"""Checkpoints from a real Jupyter kernel: interrupted (the notebook's stop button) and restarted mid-checkpoint.

A notebook user checkpoints in a cell that loops; the stop button sends the kernel SIGINT (ipykernel resets the
SIGINT handler around every cell, and the store defers a signal that lands inside its verbs to the verb's end),
and "Restart kernel" SIGKILLs it. Here a kernel started by ``jupyter_client`` (ipykernel, as a notebook server
starts it) runs such a loop, is interrupted 8 times at random moments and then killed by a restart; each
interrupt must end the cell with ``KeyboardInterrupt`` and leave the store consistent (``check()`` clean in the
kernel), and after the restart the new kernel restores a checkpoint at least as new as the last one the old
kernel saw complete, every value whole and of one step. Nothing of the store is left in /dev/shm after.
"""
from __future__ import annotations

import asyncio
import os
import queue
import random
import time
import warnings

import pytest

from helpers import ROOT, shm_segments, unique_name, wait_for

pytestmark = pytest.mark.slow

jupyter_client = pytest.importorskip("jupyter_client", reason="pip install jupyter_client ipykernel ([test] extra)")
pytest.importorskip("ipykernel", reason="pip install ipykernel ([test] extra)")

SETUP = r'''
import numpy as np, shmstore
s = shmstore.connect(NAME, capacity="64MiB", persist_dir=PDIR)
i = 0
'''

# the cell a user stops: it checkpoints until interrupted, printing D<step> for each complete one
LOOP = r'''
while True:
    i += 1
    ck = s.checkpoint(f"ck{i}", {"a": np.full(50_000, i, dtype=np.int64), "step": i,
                                 "b": bytes([i % 251]) * (i % 5000)})
    if ck.wait(60):
        print(f"D{i}", flush=True)
'''

# after each interrupt: the store as the kernel sees it, and the newest complete checkpoint
CHECK = r'''
problems = s.check()
got = s.restore()
step = int(got["step"])
whole = bool((got["a"] == step).all()) and bytes(got["b"]) == bytes([step % 251]) * (step % 5000)
print(f"CHECK {len(problems)} {step} {whole} {got.name}", flush=True)
del got
'''

RESTORE = r'''
import numpy as np, shmstore
with shmstore.connect(NAME, capacity="16MiB", persist_dir=PDIR) as s2:
    got = s2.restore()
    step = int(got["step"])
    whole = bool((got["a"] == step).all()) and bytes(got["b"]) == bytes([step % 251]) * (step % 5000)
    print(f"RESTORED {step} {whole} {got.name}", flush=True)
    del got
'''


class _Kernel:
    """One ipykernel started as a notebook server starts it, and its output, cell by cell."""

    def __init__(self, cwd: str) -> None:
        import zmq
        self.context = zmq.Context()  # its own, destroyed at close (the shared one keeps its sockets open)
        self.km = jupyter_client.KernelManager(kernel_name="python3", context=self.context)
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
        self.km.start_kernel(cwd=cwd, env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.lines: list[str] = []

    def restart(self) -> None:
        """Jupyter's "Restart kernel": the kernel process is killed (SIGKILL) and a new one started."""
        self.km.restart_kernel(now=True)
        self.kc.stop_channels()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def send(self, code: str) -> str:
        return self.kc.execute(code)

    def pump(self, until: str | None = None, timeout: float = 60.0) -> bool:
        """Read the kernel's output lines into :attr:`lines` until one starts with ``until`` (True), or for
        ``timeout`` seconds (False; with ``until`` None: until the output is quiet for 0.2 s)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                m = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if until is None:
                    return True
                continue
            if m["msg_type"] == "stream":
                new = m["content"]["text"].splitlines()
                self.lines.extend(new)
                if until is not None and any(line.startswith(until) for line in new):
                    return True
            elif m["msg_type"] == "error" and until is None:
                self.lines.append(f"ERROR {m['content']['ename']}")
        return False

    def reply(self, msg_id: str, timeout: float = 60.0) -> dict:
        end = time.monotonic() + timeout
        while True:
            m = self.kc.get_shell_msg(timeout=max(0.1, end - time.monotonic()))
            if m["parent_header"].get("msg_id") == msg_id:
                return m["content"]

    def run(self, code: str, timeout: float = 60.0) -> dict:
        content = self.reply(self.send(code), timeout)
        self.pump()
        return content

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
        self.context.destroy(linger=0)
        # jupyter_client's blocking calls run on an event loop that jupyter_core made and left open
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            loop = asyncio.get_event_loop_policy().get_event_loop()
        loop.close()
        asyncio.set_event_loop(None)


def _with(cell: str, name: str, pdir: str) -> str:
    return cell.replace("NAME", repr(name)).replace("PDIR", repr(pdir))


def _done_steps(lines: list[str]) -> list[int]:
    return [int(line[1:]) for line in lines if line[:1] == "D" and line[1:].isdigit()]


@pytest.mark.timeout(300)
def test_a_notebook_stopped_and_restarted_while_it_checkpoints_restores_the_newest_complete_one(tmp_path):
    name = unique_name("jup")
    pdir = str(tmp_path / "ck")
    rng = random.Random(7)
    k = _Kernel(str(tmp_path))
    try:
        assert k.run(_with(SETUP, name, pdir))["status"] == "ok"
        for n in range(8):
            msg_id = k.send(LOOP)
            assert k.pump(until="D"), f"interrupt {n}: the loop saw no checkpoint complete: {k.lines[-5:]}"
            time.sleep(rng.uniform(0.0, 0.05))  # somewhere in a checkpoint's put, wait or the next one
            k.km.interrupt_kernel()
            content = k.reply(msg_id)
            assert content["status"] == "error" and content["ename"] == "KeyboardInterrupt", content
            k.pump()
            last_done = max(_done_steps(k.lines))
            assert k.run(CHECK)["status"] == "ok", k.lines[-5:]
            check = [line.split() for line in k.lines if line.startswith("CHECK ")][-1]
            problems, step, whole = int(check[1]), int(check[2]), check[3] == "True"
            assert problems == 0 and whole and step >= last_done, (check, last_done)
        # "Restart kernel" while the loop checkpoints: the kernel is SIGKILLed wherever it is
        k.send(LOOP)
        assert k.pump(until="D")
        time.sleep(rng.uniform(0.0, 0.05))
        k.restart()
        last_done = max(_done_steps(k.lines))
        assert k.run(_with(RESTORE, name, pdir), timeout=120)["status"] == "ok", k.lines[-5:]
        restored = [line.split() for line in k.lines if line.startswith("RESTORED ")]
        assert restored, k.lines[-5:]
        step, whole = int(restored[-1][1]), restored[-1][2] == "True"
        assert whole and step >= last_done, (restored[-1], last_done)
    finally:
        k.close()
    import shmstore
    shmstore.destroy(name)
    assert wait_for(lambda: not [s for s in shm_segments() if f"-{name}-" in s], timeout=60)
