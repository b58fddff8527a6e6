"""native.set_slice: the scheduler slice a node service's thread asks for, read back from the kernel's own account
of the thread (/proc/thread-self/sched), in a child process of its own (nice values only go up)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

_CHILD = r"""
import json, os, sys, threading
from shmstore.primitives import native

def sched():
    out = {}
    with open("/proc/thread-self/sched") as f:
        for line in f:
            name, _, value = line.partition(":")
            if value.strip().lstrip("-").isdigit():
                out[name.strip()] = int(value)
    return out

os.nice(int(sys.argv[1]))
seen = {}

def run():
    before = sched()
    took = native.set_slice(100_000)
    seen.update(took=took, before=before, after=sched(), nice=os.getpriority(os.PRIO_PROCESS, 0))

t = threading.Thread(target=run)
t.start()
t.join()
seen["main"] = sched()  # the main thread keeps its own slice: set_slice changes only the calling thread
print(json.dumps(seen))
"""


def _kernel() -> tuple[int, int]:
    major, minor = platform.release().split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/sched"), reason="no /proc/thread-self/sched to read it back")
@pytest.mark.parametrize("nice", [0, 3])
def test_set_slice_sets_the_calling_threads_slice_and_keeps_its_nice_value(nice):
    r = subprocess.run([sys.executable, "-c", _CHILD, str(nice)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["took"] is True
    assert seen["after"]["prio"] == seen["before"]["prio"] == 120 + nice  # the nice value kept
    assert seen["nice"] == nice
    if _kernel() >= (6, 12) and "se.slice" in seen["after"]:  # EEVDF's custom slices: the kernel shows it
        assert seen["after"]["se.slice"] == 100_000
        assert seen["main"]["se.slice"] != 100_000
