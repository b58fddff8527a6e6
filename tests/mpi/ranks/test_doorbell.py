"""The idle node service's doorbell (``shmstore/mpi/doorbell.py``) across the job's ranks: requests after
silence are answered whether they ring or not (a lost ring costs only the safety net's delay), and a service
that was rung awake serves what comes next. Correctness only: the latency it buys is measured by
``scripts/bench_latency.py``."""
from __future__ import annotations

import time

import numpy as np

from shmstore.mpi.doorbell import RING_AFTER, SAFETY


def test_gets_after_silence_are_answered_rung_or_not(cluster, comm, key):
    holder = cluster.leaders[-1]
    if comm.rank == holder:
        for i in range(8):
            cluster.put(f"{key}-{i}", np.full(4, i))
    comm.Barrier()
    msg = cluster._msg
    bells = msg.bells
    rings = bells.rings if bells is not None else 0
    try:
        for i in range(8):
            if i % 2:
                msg.bells = None  # this rank rings nothing: the service's safety net must still see it
            time.sleep(max(SAFETY, RING_AFTER) * 3)  # silence: the holder's service back asleep
            assert int(cluster.get(f"{key}-{i}")[0]) == i
            msg.bells = bells
    finally:
        msg.bells = bells
    # after silence, the gets of the even turns rang: on every node but the holder's, one rank at least (the
    # other ranks of a node find the object fetched already when one of them was first, which under load may
    # be the same rank every turn)
    rung = comm.allgather((cluster.node_index, bells is not None, (bells.rings - rings) if bells is not None else 0))
    for node in range(len(cluster.nodes) - 1):
        if all(has for n, has, _ in rung if n == node):
            assert sum(r for n, _, r in rung if n == node) > 0, rung
    comm.Barrier()
    if comm.rank == holder:
        for i in range(8):
            cluster.delete(f"{key}-{i}")
