"""An MPI job that completes one checkpoint, then has a process SIGSTOPped for a few seconds and SIGCONTed while the
next one is put, copied to the partner node and flushed (argv: store name, persist dir, who: ``holder`` rank 1,
of node 0 whose part is being copied; ``copier`` rank 3, of node 1, fetching it; ``spill`` node 0's spill
process, flushing it; phase: ``put`` (the stop comes ``delay`` seconds after the checkpoint starts, while the
ranks put) or ``background`` (``delay`` seconds after the victim's checkpoint call returned: the partner copy and
the flush)).

A stop shorter than ``peer_timeout`` is a slow peer, not a dead one: the checkpoint must complete everywhere, its
partner copies whole, and a restore inside the job must return every rank's values (from this node's store or
the partner's). Run by tests/mpi/test_jobs.py on two emulated nodes; values are ``rank * 1000 + step``.
"""
import os
import subprocess
import sys
import time

import numpy as np

from shmstore.mpi import Cluster

name, persist, who, phase, delay = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
STOP_S = 4.0


def state(rank: int, step: int) -> dict:
    return {f"r{rank}.a{i}": np.full(2 << 20, rank * 1000.0 + step) for i in range(8)}  # 128 MiB per rank


with Cluster(name=name, capacity="2GiB", prefault=0, persist_dir=persist, peer_timeout=30) as c:
    ck = c.checkpoint("first", dict(state(c.rank, 1), step=1) if c.rank == 0 else state(c.rank, 1))
    assert ck.wait(120)
    c.barrier()
    print(f"rank {c.rank}: checkpoint 'first' complete", flush=True)
    victim = {"holder": 1, "copier": 3, "spill": 0}[who]

    def stop() -> subprocess.Popen:
        pid = c.store.spill_pid if who == "spill" else os.getpid()
        print(f"rank {c.rank}: stopping pid {pid} ({who}) for {STOP_S} s, {delay} s into the checkpoint's {phase}",
              flush=True)
        # another process stops and resumes it (a stopped process cannot resume itself)
        return subprocess.Popen(["sh", "-c", f"sleep {delay}; kill -STOP {pid}; sleep {STOP_S}; kill -CONT {pid}"])

    stopper = stop() if c.rank == victim and phase == "put" else None
    t0 = time.monotonic()
    ck = c.checkpoint("second", dict(state(c.rank, 2), step=2) if c.rank == 0 else state(c.rank, 2))
    t1 = time.monotonic()
    if c.rank == victim and phase == "background":  # the put is done: the partner copy and the flush run now
        stopper = stop()
    assert ck.wait(180), "the checkpoint's background work did not end in 180 s"
    print(f"rank {c.rank}: 'second' returned after {t1 - t0:.2f} s, done after {time.monotonic() - t0:.2f} s",
          flush=True)
    if stopper is not None:
        assert stopper.wait(60) == 0
    c.barrier()
    print(f"rank {c.rank}: checkpoint 'second' complete", flush=True)
    # every rank reads every rank's values from the stores (its node's, else the partner's): all of step 2
    got = c.restore("second")
    assert got["step"] == 2
    for rank in range(c.size):
        for i in range(8):
            v = got[f"r{rank}.a{i}"]
            assert v.shape == (2 << 20,) and (v == rank * 1000.0 + 2).all(), (rank, i)
    assert set(got.origins.values()) <= {"store", "nodes"}, set(got.origins.values())
    del got, v
    c.barrier()
    print(f"rank {c.rank}: restored every rank's values of 'second'", flush=True)
