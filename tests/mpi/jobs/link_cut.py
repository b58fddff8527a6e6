"""An MPI job on two nodes apart (mpi/testnodes) in which node n1's network link is cut in the middle of a
transfer or a lookup, and mended afterwards.

    testnodes exec DIR n0 mpiexec -launcher ssh -launcher-exec DIR/bin/launch -hosts n0:1,n1:1 -n 2 \\
        python -m mpi4py link_cut.py NAME fetch|migrate|locate|full

Run with a short SHMSTORE_PEER_TIMEOUT (the test sets 3 s) and a rate limit that makes ``big`` take seconds
to cross (the test sets 200 Mbit/s: 64 MiB in about 2.7 s). Rank 0 (node n0) holds ``big`` (64 MiB of a
pattern every word of which says where it is) and is the home of ``small``'s directory entry; rank 1 (node
n1) then, while a thread of it cuts its node's link (``ip link set eth0 down`` in its network namespace)
0.5 s in:

- ``fetch``: gets ``big``;
- ``migrate``: migrates ``big`` to its node;
- ``locate``: asks where a small object is (a directory lookup at its key's home, node n0), the link cut
  first;
- ``full``: gets ``big`` while its node's own /dev/shm is full (a ballast file fills it but 16 MiB; the link
  stays up; run with SHMSTORE_PREFAULT=0, else the store's arena was faulted in, its pages its own, before).

It must raise TransferError naming node n0 (``full``: StorageFullError naming the key and its size) within
peer_timeout (+ a margin), and nothing is corrupt. Then the link comes back and rank 1 does it again (TCP
may need seconds to resend what the cut lost: up to 10 attempts): the same object comes, every byte right,
and rank 0's copy is still whole (a migrate that failed took nothing away). It prints:

    RAISED <seconds> <the error's message>    (or RETURNED: the test fails)
    AGAIN ok                                  (the second try came, every byte right)
    CLEAN rank <r>                            (every check of that rank passed)
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from shmstore.errors import StorageFullError, TransferError
from shmstore.mpi import Cluster
from shmstore.mpi.directory import home_of

SIZE = 64 << 20


def pattern(n: int = SIZE) -> np.ndarray:
    return (np.arange(n // 8, dtype=np.uint64) * np.uint64(3) + np.uint64(7)).view(np.uint8)


def link(how: str) -> None:
    subprocess.run(["ip", "link", "set", "eth0", how], check=True)
    print(f"LINK {how}", flush=True)


BALLAST = "/dev/shm/link_cut-ballast"


def fill_shm() -> None:
    """Fill this node's /dev/shm but 16 MiB (with real pages, as another job's data would; the store's own
    prefault thread takes pages meanwhile: grow until nothing is left, then give 16 MiB back)."""
    size = 0
    with open(BALLAST, "wb") as f:
        while True:
            try:
                os.posix_fallocate(f.fileno(), size, 4 << 20)
                size += 4 << 20
            except OSError:
                break
        os.ftruncate(f.fileno(), max(0, size - (16 << 20)))
    st = os.statvfs("/dev/shm")
    print(f"FILLED /dev/shm: {(st.f_bavail * st.f_frsize) >> 20} MiB free", flush=True)


def main() -> None:
    name, what = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    with Cluster(name=name, capacity="512MiB") as c:
        timeout = c.store.config.peer_timeout
        small = next(k for k in (f"small{i}" for i in range(100)) if home_of(k, 2) == 0)  # its entry on n0
        if c.rank == 0:
            c.put("big", pattern())
            c.put(small, b"x" * 64)
        c.barrier()
        problems = []
        if c.rank == 1:
            cutter = None
            if what == "locate":
                link("down")
            elif what == "full":
                fill_shm()
            else:
                cutter = threading.Timer(0.5, link, ("down",))
                cutter.start()
            expected: type[Exception] = StorageFullError if what == "full" else TransferError
            t0 = time.monotonic()
            try:
                if what in ("fetch", "full"):
                    got = c.get("big")
                elif what == "migrate":
                    c.migrate("big", "n1")
                    got = c.get("big")
                else:
                    got = c.locate(small)
                print(f"RETURNED {time.monotonic() - t0:.2f} {type(got).__name__}", flush=True)
            except expected as exc:
                took = time.monotonic() - t0
                print(f"RAISED {took:.2f} {exc}", flush=True)
                if took > timeout + 3:
                    problems.append(f"raised after {took:.1f} s > peer_timeout {timeout} + 3 s")
                if what == "full" and not ("'big'" in str(exc) and "64.0 MiB" in str(exc)):
                    problems.append("the error does not name the key and its size")
                elif what != "full" and "n0" not in str(exc):
                    problems.append("the error does not name node n0")
            if cutter is not None:
                cutter.join()
            if what == "full":
                os.unlink(BALLAST)
            else:
                time.sleep(1.0)
                link("up")
            # TCP resends what the cut link lost after its backed-off retransmission timeout: seconds after
            # the link is back, so the second try may need a few attempts (each within peer_timeout)
            for attempt in range(1, 11):
                try:
                    if what == "locate":
                        ok = c.locate(small) == ["n0"]
                    else:
                        if what == "migrate":
                            c.migrate("big", "n1", keep_source=True)
                        got = np.asarray(c.get("big"))
                        ok = got.nbytes == SIZE and np.array_equal(got, pattern())
                    break
                except TransferError as exc:
                    print(f"ATTEMPT {attempt} {exc}", flush=True)
            else:
                ok = False
            print(f"AGAIN {'ok' if ok else 'WRONG'} after {attempt} attempt(s)", flush=True)
            if not ok:
                problems.append("the second try is wrong")
        # rank 0 waits here meanwhile: its service answers (or not) over the cut link
        comm.Barrier()
        if c.rank == 0:
            got = np.asarray(c.store.get("big"))
            if not np.array_equal(got, pattern()):
                problems.append("the holder's copy of big is not whole")
        problems += [f"check(): {p}" for p in c.store.check()]
        c.barrier()
    for p in problems:
        print(f"CORRUPT rank {comm.rank}: {p}", flush=True)
    if not problems:
        print(f"CLEAN rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
