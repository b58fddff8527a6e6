"""A job whose ranks are pinned to one core each (``srun --cpu-bind=cores``) and whose stores must spill.

    srun --cpu-bind=cores python -m mpi4py pinned_spill.py

Each rank prints the CPUs it may run on and those of its node's spill process, which the node's first rank
started (issue 35 item 5: the spill process inherited that rank's pinning, ran 0.16 s in a minute beside it,
and puts gave up after waiting 60 s for it). Then every rank puts four times its share of the node's memory
level (the spill process must move the older objects to disk to make room), reads every object back and checks
it; ``RESULT rank R cpus A spill B ok`` on success.
"""
from __future__ import annotations

import os

import numpy as np

from shmstore.mpi import Cluster


def cpus(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))


def main() -> None:
    with Cluster(capacity="32MiB", prefault=0, spill_timeout=60) as c:
        spill = c.store.status()["spill"]["pid"]
        mine = cpus(os.getpid())
        keys = [f"r{c.rank}-{i}" for i in range(16)]  # 16 x 4 MiB a rank: 4x the node's 32 MiB with 2 ranks
        for i, k in enumerate(keys):
            c.put(k, np.full(1 << 19, c.rank * 100 + i, np.float64))
        for i, k in enumerate(keys):
            v = c.get(k)
            assert v.shape == (1 << 19,) and v[0] == v[-1] == c.rank * 100 + i, (k, v[0])
            del v
        c.barrier()
        print(f"RESULT rank {c.rank} cpus {mine} spill {cpus(spill)} ok", flush=True)


if __name__ == "__main__":
    main()
