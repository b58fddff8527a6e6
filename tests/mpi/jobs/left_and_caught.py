"""An MPI job one of whose ranks leaves ``with Cluster()`` by an exception that it then catches, and goes on to a
collective call of its own, while the other ranks close the cluster (or wait in its barrier).

    mpiexec -launcher fork -hosts n0:2,n1:2 -n 4 python -m mpi4py left_and_caught.py NAME close|barrier

Rank 1 raises ``RuntimeError('boom from rank 1')`` inside the block, catches it outside and calls
``COMM_WORLD.Barrier()``, which the others never reach. Before, the others waited in ``close()`` for ever,
silently (issue 30, item 6). Now rank 1 warns on stderr that the others will fail, and each of them raises
``TransferError`` naming rank 1 from its ``close()`` (``barrier()``), uncaught: the job ends (MPI_Abort).
"""
from __future__ import annotations

import sys
import time

from mpi4py import MPI

from shmstore.mpi import Cluster


def main(name: str, where: str) -> None:
    try:
        with Cluster(name=name, capacity="64MiB", prefault=0) as c:
            c.put(f"k{c.rank}", b"x" * 100)
            c.barrier()
            if c.rank == 1:
                time.sleep(0.5)
                print("raising on rank 1", flush=True)
                raise RuntimeError("boom from rank 1")
            if where == "barrier":
                c.barrier()
            print(f"rank {c.rank} leaves the block", flush=True)
    except RuntimeError as exc:
        print(f"rank {MPI.COMM_WORLD.rank} caught {exc}, calls a collective of its own", flush=True)
        MPI.COMM_WORLD.Barrier()
        print(f"rank {MPI.COMM_WORLD.rank} got past its barrier: wrong", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
