#!/usr/bin/env python3
"""The sporadic request: a remote 64 B get after a pause, against the same get back to back.

    mpiexec -launcher fork -hosts n0:1,n1:1 -n 2 python -m mpi4py scripts/bench_sporadic.py
    ... scripts/bench_sporadic.py --idle-us 50     # as where the node has a core to spare

Applications ask between compute steps, not in tight loops. Rank 1 (node n1)
puts ``--objects`` 64-byte objects; rank 0 (node n0) then gets them one by one,
each a first fetch into its node (a directory lookup and the object from n1's
service), waiting ``--gap-ms`` between two gets (sleeping: its core is free),
then the same number of gets back to back. Rank 1 waits without spinning
meanwhile, as a rank that computes would leave its node's service alone. It
prints the median and 90th percentile of each, and their ratio. Baselines
in the same run, before the Cluster exists: raw 8-byte MPI round trips
``--gap-ms`` apart between the same ranks, the answering rank waiting in a
blocking ``Recv`` (MPICH busy-polls: the floor), or probing every 50 us or
1 ms with naps between (as an idle node service does): what the machine
itself adds to a request after a pause.

Where the host has a core per rank and one to spare, an idle node service
probes every 50 us (``shmstore.mpi.poll.idle_nap``); where ranks fill the cores
every 1 ms (``SHMSTORE_SERVICE_IDLE_US`` sets it; ``--idle-us`` sets that
variable on every rank before the Cluster starts).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpi4py import MPI  # noqa: E402

from shmstore.mpi import Cluster  # noqa: E402
from shmstore.mpi.poll import idle_nap, quiet_barrier  # noqa: E402


def raw_sporadic(comm: MPI.Comm, n: int, gap: float, nap: float | None) -> list[float]:
    """Round trips of 8 B from rank 0 to rank 1 and back, ``gap`` seconds apart (rank 0 sleeping between); rank 1
    waits in a blocking Recv (``nap`` None) or probes after naps of ``nap`` seconds. Seconds, on rank 0."""
    buf, times = np.zeros(8, np.uint8), []
    quiet_barrier(comm)
    for _ in range(n):
        if comm.rank == 0:
            time.sleep(gap)
            t = time.perf_counter()
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
            times.append(time.perf_counter() - t)
        else:
            if nap is not None:
                while not comm.Iprobe(source=0):
                    time.sleep(nap)
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
    quiet_barrier(comm)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=60, help="gets of each kind")
    ap.add_argument("--gap-ms", type=float, default=100.0)
    ap.add_argument("--idle-us", type=float, help="SHMSTORE_SERVICE_IDLE_US for this run")
    args = ap.parse_args()
    if args.idle_us is not None:
        os.environ["SHMSTORE_SERVICE_IDLE_US"] = str(args.idle_us)
    world = MPI.COMM_WORLD
    if world.size != 2:
        raise SystemExit("bench_sporadic runs on exactly 2 ranks (see the usage line)")
    name = world.bcast("sp" + uuid.uuid4().hex[:8])
    raw = {label: raw_sporadic(world, args.objects, args.gap_ms / 1e3, nap)
           for label, nap in (("blocking Recv", None), ("probe every 50 us", 50e-6), ("probe every 1 ms", 1e-3))}
    with Cluster(name=name, capacity="64MiB", prefault=0) as cluster:
        n = args.objects
        keys = [f"s{i}" for i in range(2 * n)]
        if world.rank == 1:
            for k in keys:
                cluster.put(k, np.full(8, 7, np.int64))  # 64 B
        quiet_barrier(world)
        cluster.get(keys[0])  # (both ranks: the first request of each kind is not what is measured)
        quiet_barrier(world)
        sporadic, tight = [], []
        if world.rank == 0:
            for k in keys[1:n]:
                time.sleep(args.gap_ms / 1e3)
                t = time.perf_counter()
                cluster.get(k)
                sporadic.append(time.perf_counter() - t)
            time.sleep(args.gap_ms / 1e3)
            for k in keys[n:]:
                t = time.perf_counter()
                cluster.get(k)
                tight.append(time.perf_counter() - t)
        quiet_barrier(world)
        if world.rank == 0:
            def stat(xs: list[float]) -> str:
                xs = sorted(xs)
                return f"median {statistics.median(xs) * 1e6:7.1f} us, p90 {xs[int(0.9 * (len(xs) - 1))] * 1e6:7.1f} us"
            nap = idle_nap(2)
            print(f"bench_sporadic: 2 ranks on 2 emulated nodes, {os.cpu_count()} cpus, idle service probe every "
                  f"{nap * 1e6:.0f} us{' (SHMSTORE_SERVICE_IDLE_US)' if args.idle_us is not None else ''}")
            print(f"  remote 64 B get, {args.gap_ms:g} ms apart: {stat(sporadic)}")
            print(f"  remote 64 B get, back to back:   {stat(tight)}")
            print(f"  ratio (medians): {statistics.median(sporadic) / statistics.median(tight):.1f}x")
            for label, xs in raw.items():
                print(f"  raw MPI 8 B round trip {args.gap_ms:g} ms apart, the other rank in a {label + ':':19} "
                      f"{stat(xs)}")
        quiet_barrier(world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
