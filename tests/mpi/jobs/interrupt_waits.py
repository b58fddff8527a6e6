"""An MPI job whose ranks are interrupted (SIGINT, as Ctrl-C) while they wait on a rank that hangs.

    mpiexec -launcher fork -hosts n0:2,n1:1 -n 3 python -m mpi4py interrupt_waits.py NAME

Run with a long SHMSTORE_PEER_TIMEOUT (the test sets 60 s, the default). Rank 2 (node n1's only rank, whose
service answers for that node) holds ``small`` (1 KiB) and ``big`` (64 MiB), then is stopped (SIGSTOP, a
child of its own SIGCONTs it 25 s later). Meanwhile:

- rank 0 (node n0's leader) gets ``small`` (a call whose reply never comes), then ``locate``, then ``big``
  (the same, after it took the node's transfer slot for it); each interrupted by a SIGINT 0.5 s in (1.5 s
  for ``big``);
- rank 1 gets ``big`` while rank 0 transfers it: it joins rank 0's transfer (the node's dedup wait) and is
  interrupted there.

Each interrupted call prints ``RESULT <rank> <op> interrupted <seconds from the SIGINT>`` (or ``returned``,
or ``raised <error>``). Once rank 2 is back, rank 0 gets ``small`` and ``big`` again and checks them
(``AGAIN ok``), so an interrupted wait leaves nothing that keeps a later call from working.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from shmstore.errors import ShmStoreError
from shmstore.mpi import Cluster

STOP_FOR = 25.0


def interrupt_after(delay: float) -> list[float]:
    """SIGINT this process ``delay`` seconds from now (from a thread); the list gets the moment it was sent."""
    sent: list[float] = []

    def fire() -> None:
        time.sleep(delay)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()
    return sent


def interrupted(rank: int, op: str, call, delay: float = 0.5) -> None:  # type: ignore[no-untyped-def]
    sent = interrupt_after(delay)
    try:
        call()
        print(f"RESULT {rank} {op} returned", flush=True)
    except KeyboardInterrupt:
        print(f"RESULT {rank} {op} interrupted {time.monotonic() - sent[0]:.3f}", flush=True)
    except ShmStoreError as exc:
        print(f"RESULT {rank} {op} raised {type(exc).__name__}: {exc}", flush=True)
    time.sleep(0.6)  # never a second SIGINT in the next call


def main(name: str) -> None:
    with Cluster(name=name, capacity="512MiB", prefault=0) as c:
        assert c.nodes == ["n0", "n1"] and c.size == 3, (c.nodes, c.size)
        if c.rank == 2:
            c.put("small", np.full(128, 7, np.int64))
            c.put("big", np.full(8 << 20, 9, np.int64))
        c.barrier()
        if c.rank == 2:
            subprocess.Popen([sys.executable, "-c", f"import os, signal, time; os.kill({os.getpid()}, "
                              f"signal.SIGSTOP); time.sleep({STOP_FOR}); os.kill({os.getpid()}, signal.SIGCONT)"])
            time.sleep(1.0)  # stopped in here
        else:
            time.sleep(1.0)  # rank 2 is stopped by now
        if c.rank == 0:
            interrupted(0, "get-small", lambda: c.get("small"))
            interrupted(0, "locate", lambda: c.locate("big"))
            threading.Thread(target=lambda: c.comm.send("go", dest=1, tag=77), daemon=True).start()
            interrupted(0, "get-big", lambda: c.get("big"), 1.5)  # after rank 1's, which joined this transfer
        elif c.rank == 1:
            c.comm.recv(source=0, tag=77)  # rank 0 is fetching big now
            time.sleep(0.2)
            interrupted(1, "join-transfer", lambda: c.get("big"), 0.5)
        c.barrier()  # rank 2 comes back after STOP_FOR seconds
        if c.rank == 0:
            ok = int(c.get("small")[5]) == 7 and int(c.get("big")[-1]) == 9
            print(f"AGAIN {'ok' if ok else 'WRONG'}", flush=True)
        c.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
