"""An MPI job that completes one checkpoint, then a rank SIGKILLs itself while the next one is being copied to the
partner node and flushed (argv: store name, persist dir, who: ``holder`` a rank of the node whose part is being
copied, ``copier`` a rank fetching it).

Run by tests/mpi/test_jobs.py on two emulated nodes; checkpointed values are ``rank * 1000 + step`` everywhere.
"""
import os
import signal
import sys
import threading
import time

import numpy as np

from shmstore.mpi import Cluster

name, persist, who = sys.argv[1], sys.argv[2], sys.argv[3]


def state(rank: int, step: int) -> dict:
    return {f"r{rank}.a{i}": np.full(4 << 20, rank * 1000.0 + step) for i in range(8)}  # 256 MiB per rank


with Cluster(name=name, capacity="2GiB", prefault=0, persist_dir=persist, peer_timeout=20) as c:
    ck = c.checkpoint("good", dict(state(c.rank, 1), step=1) if c.rank == 0 else state(c.rank, 1))
    assert ck.wait(120)
    c.barrier()
    print(f"rank {c.rank}: checkpoint 'good' complete", flush=True)
    # rank 1 is on node 0 (its part is copied to node 1), rank 3 on node 1 (it fetches node 0's part)
    victim = 1 if who == "holder" else 3
    if c.rank == victim:
        def die() -> None:
            time.sleep(0.05)  # inside the copy and the flush of 1 GiB
            print(f"rank {c.rank}: killing myself during the next checkpoint's copy and flush", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=die, daemon=True).start()
    ck = c.checkpoint("doomed", dict(state(c.rank, 2), step=2) if c.rank == 0 else state(c.rank, 2))
    ck.wait(120)
    c.barrier()
    print(f"rank {c.rank}: checkpoint 'doomed' complete (the kill came too late)", flush=True)
