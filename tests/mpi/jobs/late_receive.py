"""An MPI job in which one end of a large transfer is SIGSTOPped for longer than peer_timeout in the middle of
it, then SIGCONTed: the transfer is given up on both ends while MPI may still move its bytes.

    mpiexec -launcher fork -hosts n0:1,n1:1 -n 2 python -m mpi4py late_receive.py NAME receiver|sender [reuse]

Run with a short SHMSTORE_PEER_TIMEOUT (the test sets 2 s). Rank 1 (node n1) holds ``big``, 192 MiB of a
pattern every word of which says which object it is and where in it; rank 0 (node n0) gets it. A stopper
process (started by rank 0) watches the arena of node n0: once the incoming object is partly there (its
first page filled, its last one not yet), it SIGSTOPs the fetching rank 0 (``receiver``) or the holder,
rank 1 (``sender``), for peer_timeout + 1.5 s, then SIGCONTs it.

- receiver stopped: rank 1's send passes its deadline; with ``reuse`` rank 1 then deletes ``big`` and puts
  ``trap`` (another pattern, as large) where the space it frees may be: a receiver that wakes and reads the
  source late (UCX over CMA: the receiver copies) must never read that.
- sender stopped: rank 0's receive passes its deadline and its get raises; the sender's bytes come when it
  wakes (over a transport where the sender pushes them, e.g. ``UCX_TLS=tcp,self``).

After the get (a value, or TransferError), rank 0 puts ``mine`` (a third pattern, as large), which lands
wherever the store finds room (before the fix: the space of the abandoned receive), lets MPI run for 4 s
(the stopped rank wakes meanwhile; its late bytes land now), and checks every byte of ``mine``, of the
value its get returned (if any) and of ``big`` fetched again (the key is free again after the failure,
unless ``reuse`` deleted it), and ``check()`` of its store. It prints:

    RESULT get raised|returned ...
    CORRUPT <what> <how>    (the test fails on any)
    CLEAN rank <r>          (every check of that rank passed)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

from shmstore.errors import ShmStoreError, TransferError
from shmstore.mpi import Cluster

SIZE = 192 << 20
STOPPER = r"""
import os, signal, sys, time
import numpy as np
import shmstore
from shmstore.meta import layout as L
pid, name, stop_for = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
size = int(sys.argv[4])
with shmstore.connect(name, node="n0", create=False) as s:
    node = s.node_store
    arena = np.frombuffer(node.arena_mm, np.uint8)
    print("WATCHING", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        t = L.entry_table(node.meta.mm, node.layout)
        hit = np.flatnonzero((t["state"] == L.WRITING) & (t["nbytes"] >= size))
        if len(hit):
            off = int(t["offset"][hit[0]])
            if arena[off] != 0 and arena[off + size - 8] == 0:  # partly there: frames flowing
                os.kill(pid, signal.SIGSTOP)
                print(f"STOPPED {pid} mid-transfer", flush=True)
                time.sleep(stop_for)
                os.kill(pid, signal.SIGCONT)
                sys.exit(0)
        time.sleep(0.0002)
    print("STOPPER saw no transfer", flush=True)
"""


def pattern(kind: int, n: int = SIZE) -> np.ndarray:
    """``n`` bytes that say which object they are (``kind``) and where in it they are (every 8-byte word)."""
    words = np.arange(n // 8, dtype=np.uint64)
    return (words * np.uint64(4) + np.uint64(kind) + np.uint64(1)).view(np.uint8)


def problem(got: object, kind: int) -> str | None:
    """Why ``got`` is not pattern ``kind`` (None: it is): how many words are wrong, and whose they are."""
    a = np.asarray(got).view(np.uint64)
    want = pattern(kind, a.nbytes).view(np.uint64)
    bad = np.flatnonzero(a != want)
    if not len(bad):
        return None
    kinds = np.unique((a[bad] - np.uint64(1)) % np.uint64(4))
    return f"{len(bad) * 8} of {a.nbytes} bytes wrong (first at {bad[0] * 8}; patterns found there: {kinds.tolist()})"


def check(what: str, got: object, kind: int) -> bool:
    p = problem(got, kind)
    if p is not None:
        print(f"CORRUPT {what} {p}", flush=True)
    return p is None


def progress(c: Cluster, seconds: float) -> None:
    """Let MPI run (this rank tests, its service probes) for ``seconds``: a late receive's bytes land now."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        c.comm.Iprobe(MPI.ANY_SOURCE, 12345)
        time.sleep(0.005)


def receiver(c: Cluster, i: int, name: str, victim: int) -> bool:
    timeout = c.store.config.peer_timeout
    stopper = subprocess.Popen([sys.executable, "-c", STOPPER, str(victim), name, str(timeout + 1.5),
                                str(SIZE)], stdout=subprocess.PIPE, text=True)
    assert stopper.stdout is not None
    print(stopper.stdout.readline().strip(), flush=True)  # WATCHING
    ok, value = True, None
    try:
        value = c.get(f"big{i}")
        print("RESULT get returned", flush=True)
    except TransferError as exc:
        print(f"RESULT get raised {exc}", flush=True)
    print(stopper.communicate(timeout=120)[0].strip(), flush=True)
    if value is not None:
        ok &= check(f"big{i} as get returned it", value, 0)
        del value
    c.store.put(f"mine{i}", pattern(2))  # before the fix: into the space the abandoned receive still fills
    progress(c, 5.0)
    ok &= check(f"mine{i}", c.store.get(f"mine{i}"), 2)
    try:
        again = c.get(f"big{i}")
        ok &= check(f"big{i} fetched again", again, 0)
        del again
    except ShmStoreError as exc:
        print(f"RESULT fetch again raised {type(exc).__name__}: {exc}", flush=True)
    problems = c.store.check()
    if problems:
        print(f"CORRUPT store n0 check {problems}", flush=True)
        ok = False
    return ok


def holder(c: Cluster, i: int, reuse: bool) -> bool:
    if not reuse:
        return True
    # once this node's send is given up (the receiver stopped past the deadline), free the source and put
    # another object of its size: before the fix it took the space the late receiver still reads
    assert c.service is not None
    end = time.monotonic() + 60
    while not c.service.sending and time.monotonic() < end:  # the send begins
        time.sleep(0.001)
    while c.service.sending and time.monotonic() < end:  # and is given up (or done)
        time.sleep(0.01)
    c.store.delete(f"big{i}")
    c.store.put(f"trap{i}", pattern(1))
    progress(c, 4.0)
    return check(f"trap{i}", c.store.get(f"trap{i}"), 1)


def main(name: str, who: str, reuse: bool) -> None:
    with Cluster(name=name, capacity="1GiB", prefault=0) as c:
        assert c.size == 2 and c.nodes == ["n0", "n1"], (c.size, c.nodes)
        pids = c.comm.allgather(os.getpid())
        victim = pids[0 if who == "receiver" else 1]
        for i in range(1):
            if c.rank == 1:
                c.put(f"big{i}", pattern(0))
            c.barrier()
            ok = receiver(c, i, name, victim) if c.rank == 0 else holder(c, i, reuse)
            c.barrier()
            for k in (f"big{i}", f"mine{i}", f"trap{i}"):
                c.store.pop(k, None)
            c.barrier()
            if ok:
                print(f"CLEAN rank {c.rank}", flush=True)
        try:
            from shmstore.mpi import abandon
            print(f"ABANDONED rank {c.rank} {abandon.stats()}", flush=True)
        except ImportError:  # the code before the fix
            pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "reuse")
