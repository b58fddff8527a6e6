"""An MPI job in which the rank asking for a pushed object is stopped between the answer and its receive.

    mpiexec -launcher fork -hosts n0:1,n1:1,n2:1 -n 3 python -m mpi4py stopped_asker.py NAME DIR

Run with a long SHMSTORE_PEER_TIMEOUT (the test sets 60 s). Rank 1 (node n1) holds ``pushed`` (1 MiB, at most
``tags.PUSH_MAX``: its lookup pushes it as one frame after the answer) and the objects rank 2 fetches. Rank 0
(node n0) gets ``pushed`` and is stopped (SIGSTOP, by a child of its own) right after the answer came and
before its receive of the frame is posted: the holder's service has started the frame's send and tests it
(``service._PUSH_DRIVE``). While rank 0 is stopped, rank 2 (node n2) gets 40 small and 4 1 MiB objects from
rank 1 (keys whose home is not n0, whose service is stopped with rank 0) and checks each, then writes
``DIR/done``. The child SIGCONTs rank 0 once ``DIR/done`` is there, or after 60 s; it writes what woke rank 0
into ``DIR/woken`` (``done`` or ``deadline``). So a holder's service that waited for the stopped asker's
frame would leave rank 2's gets waiting until rank 0 came back (``deadline``). Rank 0's get then completes
and its value is checked.

Prints ``RESULT <rank> ok`` per rank whose values were right, and rank 0 ``WOKEN <done|deadline>``.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from shmstore.mpi import Cluster
from shmstore.mpi import fetch as fetch_module
from shmstore.mpi.directory import home_of

MiB = 1 << 20
RESUME = """
import os, signal, sys, time
pid, d = int(sys.argv[1]), sys.argv[2]
os.kill(pid, signal.SIGSTOP)
open(os.path.join(d, "stopped"), "w").close()
end = time.monotonic() + 60
while not os.path.exists(os.path.join(d, "done")) and time.monotonic() < end:
    time.sleep(0.02)
woken = "done" if os.path.exists(os.path.join(d, "done")) else "deadline"
with open(os.path.join(d, "woken"), "w") as f:
    f.write(woken)
os.kill(pid, signal.SIGCONT)
"""


def keys_not_homed_on(node: int, prefix: str, count: int, nnodes: int) -> list[str]:
    """``count`` keys starting with ``prefix`` whose home node is not ``node``."""
    out, i = [], 0
    while len(out) < count:
        k = f"{prefix}{i}"
        if home_of(k, nnodes) != node:
            out.append(k)
        i += 1
    return out


def stop_before_receive(directory: str) -> None:
    """Rank 0: stop this process once, at the start of its first pushed frame's receive."""
    import subprocess
    original = fetch_module.Fetcher._pushed
    state = {"stopped": False}

    def pushed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not state["stopped"]:
            state["stopped"] = True
            subprocess.Popen([sys.executable, "-c", RESUME, str(os.getpid()), directory])
            end = time.monotonic() + 90  # stopped in here, until the child's SIGCONT
            while not os.path.exists(os.path.join(directory, "woken")) and time.monotonic() < end:
                time.sleep(0.01)
        return original(self, *args, **kwargs)

    fetch_module.Fetcher._pushed = pushed  # type: ignore[method-assign]


def main(name: str, directory: str) -> None:
    with Cluster(name=name, capacity="256MiB") as c:
        assert c.nodes == ["n0", "n1", "n2"] and c.size == 3, (c.nodes, c.size)
        smalls = keys_not_homed_on(0, "s", 40, 3)
        bigs = keys_not_homed_on(0, "b", 4, 3)
        if c.rank == 1:
            c.put("pushed", np.arange(MiB // 8, dtype=np.int64))
            for i, k in enumerate(smalls):
                c.put(k, np.full(8, i, np.int64))
            for i, k in enumerate(bigs):
                c.put(k, np.full(MiB // 8, 1000 + i, np.int64))
        c.barrier()
        if c.rank == 0:
            stop_before_receive(directory)
            v = c.get("pushed")
            ok = v.shape == (MiB // 8,) and bool(np.array_equal(v, np.arange(MiB // 8, dtype=np.int64)))
            with open(os.path.join(directory, "woken")) as f:
                print(f"WOKEN {f.read()}", flush=True)
            print(f"RESULT 0 {'ok' if ok else 'WRONG'}", flush=True)
        elif c.rank == 2:
            end = time.monotonic() + 60
            while not os.path.exists(os.path.join(directory, "stopped")) and time.monotonic() < end:
                time.sleep(0.01)
            ok = os.path.exists(os.path.join(directory, "stopped"))
            for i, k in enumerate(smalls):
                ok = ok and bool((c.get(k) == i).all())
            for i, k in enumerate(bigs):
                ok = ok and bool((c.get(k) == 1000 + i).all())
            open(os.path.join(directory, "done"), "w").close()
            print(f"RESULT 2 {'ok' if ok else 'WRONG'}", flush=True)
        c.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
