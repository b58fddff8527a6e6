#!/usr/bin/env python3
"""One object to every node: copies spreading as a tree, against N-1 sequential sends and MPI_Bcast.

    hosts=$(python -c "print(','.join(f'n{i}:1' for i in range(8)))")
    mpiexec -launcher fork -hosts $hosts -n 8 python -m mpi4py scripts/bench_broadcast.py --mib 32

One rank per emulated node. Node 0 puts an object of ``--mib`` MiB; then,
in one run, medians over ``--repeats``:

- one transfer: node 1 alone fetches it (the unit, T; after a first,
  uncounted round of everything has touched the stores' pages);
- sequential: node 0's copy sent to each other node in turn
  (``migrate(key, node, keep_source=True)`` from node 0: what a single
  source costs, N-1 transfers);
- tree: every node calls ``cluster.get(key)`` at once; the directory hands
  each fetcher a holder that is not sending, so holders double per round;
- ``MPI_Bcast`` of a buffer of the same size on ``COMM_WORLD``.

Each figure is printed in units of T, one transfer of the sequential run;
the target is about log2(N). The tree run also prints when each node
finished, in T: the rounds show (1, 2, 4, ... nodes finishing together). On one
machine all copies share its memory bandwidth and cores (8 ranks on 2 cores
here), so concurrent transfers of a round slow each other: the sequential
and MPI_Bcast figures are measured under the same limits.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpi4py import MPI  # noqa: E402

from shmstore.mpi import Cluster, quiet_barrier  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=32, help="object size in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    n = world.size
    if n < 2:
        raise SystemExit("bench_broadcast needs at least 2 ranks on 2 nodes (see the usage line)")
    nbytes = args.mib << 20
    data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    name = world.bcast("bb" + uuid.uuid4().hex[:8])
    one, seq, tree, bcast, finish = [], [], [], [], []
    with Cluster(name=name, capacity=f"{3 * args.mib + 64}MiB", prefault=0) as c:
        if c.size != len(c.nodes):
            raise SystemExit("bench_broadcast wants one rank per node")
        for r in range(args.repeats + 1):  # the first round warms the stores' pages up: not counted
            key = f"b{r}"
            if c.node_index == 0:
                c.put(key, data)
            quiet_barrier(world)
            t = time.perf_counter()
            if c.node_index == 1:
                c.get(key)
            one_t = world.bcast(time.perf_counter() - t, root=1)
            one.append(one_t)
            quiet_barrier(world)
            if c.node_index == 0:
                c.delete(key)
                c.put(key, data)
                t = time.perf_counter()
                for i in range(1, n):
                    c.migrate(key, i, keep_source=True)
                seq.append(time.perf_counter() - t)
                c.delete(key)
                c.put(key, data)
            quiet_barrier(world)
            t0 = time.perf_counter()
            if c.node_index:
                c.get(key)
            done = time.perf_counter() - t0
            finished = world.gather(done)
            quiet_barrier(world)
            tree.append(time.perf_counter() - t0)
            if world.rank == 0:
                finish.append(sorted(finished[1:]))
                c.delete(key)
            buf = data.copy() if world.rank == 0 else np.empty(nbytes, np.uint8)
            quiet_barrier(world)
            t = time.perf_counter()
            world.Bcast(buf, root=0)
            quiet_barrier(world)
            bcast.append(time.perf_counter() - t)
            assert buf[12345] == data[12345]
            quiet_barrier(world)
    one, seq, tree, bcast, finish = one[1:], seq[1:], tree[1:], bcast[1:], finish[1:]
    if world.rank == 0:
        t1 = statistics.median(one)
        s, tr, b = statistics.median(seq), statistics.median(tree), statistics.median(bcast)
        ts = s / (n - 1)  # one transfer as the sequential run does them: the unit
        print(f"bench_broadcast: {args.mib} MiB to {n} nodes ({n} ranks, {os.cpu_count()} cpus), "
              f"medians of {args.repeats}")
        print(f"  one fetch alone {t1 * 1e3:.1f} ms ({nbytes / t1 / 2**30:.2f} GiB/s); "
              f"T = one of the sequential transfers = {ts * 1e3:.1f} ms ({nbytes / ts / 2**30:.2f} GiB/s)")
        print(f"  sequential from one source: {s * 1e3:8.1f} ms = {s / ts:5.2f} T  (N-1)")
        print(f"  tree (every node gets):     {tr * 1e3:8.1f} ms = {tr / ts:5.2f} T  "
              f"(log2 N = {math.log2(n):.1f}; {s / tr:.2f}x faster than sequential, {b / tr:.2f}x than MPI_Bcast)")
        print(f"  MPI_Bcast:                  {b * 1e3:8.1f} ms = {b / ts:5.2f} T")
        print("  tree, when each node finished (T): "
              + ", ".join(f"{x / ts:.2f}" for x in finish[len(finish) // 2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
