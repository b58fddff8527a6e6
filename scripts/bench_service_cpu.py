#!/usr/bin/env python3
"""What a node service costs its rank's node: CPU time in the half second after a fetch, against idle.

    mpiexec -launcher fork -hosts n0:1,n1:1 -n 2 python -m mpi4py scripts/bench_service_cpu.py

Two ranks on two emulated nodes, each the leader of its node (so each runs a
service). Each turn, every rank sleeps 0.5 s and reads its process's CPU
time (user + system: its service thread and anything else of the store, as
its main thread sleeps), then fetches the other node's small object and
sleeps 0.5 s again. A service that probes busily after a request shows as
CPU time taken from the cores the application computes on (medians over
``--turns``).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import uuid

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shmstore.mpi import Cluster  # noqa: E402


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    if world.size != 2:
        raise SystemExit("bench_service_cpu runs on exactly 2 ranks (see the usage line)")
    name = world.bcast("sc" + uuid.uuid4().hex[:8] if world.rank == 0 else None)
    with Cluster(name=name, capacity="64MiB", prefault=0) as c:
        other = f"k{1 - world.rank}"
        c.put(f"k{world.rank}", np.arange(8))
        world.Barrier()
        quiet, after = [], []
        for _ in range(args.turns):
            world.Barrier()
            c0 = cpu()
            time.sleep(0.5)
            quiet.append(cpu() - c0)
            world.Barrier()
            c.get(other)  # both services answer: a lookup, the directory, a small transfer
            c.store.delete(other)  # (this node's copy: the next turn fetches again)
            world.Barrier()
            c0 = cpu()
            time.sleep(0.5)
            after.append(cpu() - c0)
        rows = world.gather((statistics.median(quiet), statistics.median(after)))
    if world.rank == 0:
        print("CPU time of each rank in 0.5 s (main thread asleep), idle / right after a fetch, medians of "
              f"{args.turns}: " + "; ".join(f"rank {r}: {q * 1e3:.1f} / {a * 1e3:.1f} ms"
                                            for r, (q, a) in enumerate(rows)))


if __name__ == "__main__":
    main()
