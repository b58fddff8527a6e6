"""An MPI job one of whose ranks raises inside ``with Cluster()`` while the others wait for it.

    mpiexec -launcher fork -hosts n0:2,n1:2 -n 4 python [-m mpi4py] raise_in_cluster.py NAME WHO WHERE

NAME ``-`` takes the default store name (``job-$SLURM_JOB_ID`` under Slurm).

WHO is ``leader`` (rank 0: node n0's leader, whose service sends the object the others fetch) or
``non-leader`` (rank 1). WHERE is what the others do meanwhile: ``get`` (node n1's ranks fetch a large object
from node n0 over and over, rank 0 or 1 asks the directory over and over) or ``barrier``. Every node has objects
in memory and one spilled to disk first (SHMSTORE_SPILL_DIR). The raiser prints ``raising`` and raises
``RuntimeError('boom from rank R')`` half a second in (WHERE ``sigint``: it waits in a barrier the others reach
only after a minute, and Ctrl-C, SIGINT to itself, interrupts that wait); the job must end within seconds, the traceback
printed, whether started with ``python -m mpi4py`` or as a plain ``python`` script (shmstore then aborts
the job itself), and leave no segment, spill file or spill process of the store behind.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from shmstore import Level, TransferError
from shmstore.mpi import Cluster


def main(name: str, who: str, where: str) -> None:
    raiser = 0 if who == "leader" else 1
    with Cluster(name=None if name == "-" else name, capacity="128MiB", prefault=0) as c:
        if c.rank == c.leaders[c.node_index]:
            c.put(f"cold-{c.node}", np.ones(1 << 16), levels=[Level.DISK])  # a spill file on every node
            c.put(f"warm-{c.node}", np.ones(1 << 16))
        if c.rank == 0:
            c.put("model", np.ones(8 << 20, np.uint8))
        c.barrier()
        if c.rank == raiser and where == "sigint":
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            print(f"raising on rank {c.rank}: Ctrl-C in a barrier", flush=True)
            c.barrier()  # the others come in a minute: KeyboardInterrupt must not wait for them
        if c.rank == raiser:
            time.sleep(0.5)
            print(f"raising on rank {c.rank}", flush=True)
            raise RuntimeError(f"boom from rank {c.rank}")
        if where == "sigint":
            time.sleep(60)  # computing
            c.barrier()
        elif where == "barrier":
            c.barrier()
        elif c.node_index == 1:
            while True:  # fetches from node n0 (rank 0's service sends), for ever
                try:
                    c.get("model")
                except TransferError as exc:  # the other rank of n1 deleted each copy this one fetched
                    if "kept being interrupted" not in str(exc):
                        raise
                c.store.delete("model", missing_ok=True)  # (the other rank of n1 may have)
        else:
            while True:  # asks a key's home (a node's service, maybe the raiser's) over and over
                c.locate("nobody-puts-this")
                time.sleep(0.01)
        print(f"rank {c.rank} got past the raise: wrong", flush=True)
        MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
