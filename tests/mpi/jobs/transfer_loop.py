"""A job that moves a large object between its nodes until it is cancelled (tests/scenarios/test_slurm.py scancels it).

Rank 0 puts a 192 MiB model; the first rank of every other node fetches it, drops its copy and fetches
again, forever; it prints "transferring" once the first copy has moved.
"""
import sys
import time

import numpy as np

from shmstore.mpi import Cluster

with Cluster(capacity="768MiB") as c:
    if c.rank == 0:
        c.put("model", np.ones(192 << 20, np.uint8))
    c.barrier()
    first = c.rank == c.leaders[c.node_index]
    n = 0
    while True:
        if first and c.node_index > 0:
            c.get("model")
            c.store.delete("model")
            n += 1
            if n == 1:
                print(f"transferring (rank {c.rank}, node {c.node})", flush=True)
        else:
            time.sleep(0.05)
        if n > 100000:
            sys.exit(0)
