"""An MPI job whose fetching rank SIGKILLs itself in the middle of a transfer.

Run by tests/mpi/test_jobs.py on two emulated nodes; the stores are persistent so
the test can look at them after the job died.
"""
import os
import signal
import sys
import threading
import time

import numpy as np

from shmstore.meta import layout as L
from shmstore.mpi import Cluster

with Cluster(name=sys.argv[1], capacity="1GiB", persist=True, prefault=0) as c:
    if c.rank == c.leaders[0]:
        c.put("big", np.ones(512 << 20, np.uint8))
    c.barrier()
    if c.rank == c.leaders[-1]:
        node = c.store.kernel.node

        def kill_when_under_way() -> None:
            while not any(L.unpack_migration(node.buf, node.layout, s).state == L.MIG_FLIGHT
                          for s in range(L.NMIGRATIONS)):
                time.sleep(0.001)
            time.sleep(0.05)
            print("killing myself mid-transfer", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_when_under_way, daemon=True).start()
        c.fetch("big", block_size=1 << 20)
        print("fetch finished before the kill", flush=True)
    c.barrier()
