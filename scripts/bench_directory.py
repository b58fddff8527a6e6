#!/usr/bin/env python3
"""Lookup costs against the node count: remote small get, locate and a miss, next to a raw MPI round trip.

    for n in 2 4 8; do
        hosts=$(python -c "print(','.join(f'n{i}:1' for i in range($n)))")
        mpiexec -launcher fork -hosts $hosts -n $n python -m mpi4py scripts/bench_directory.py
    done

One rank per emulated node. Before the Cluster exists, rank 0 and the last
rank time an 8-byte ``Send``/``Recv`` round trip (the raw baseline). Then
rank 0 gets ``--warmup`` keys untimed (the first gets fault pages in), and
times, for keys put on the last node: a 64-byte ``get`` that fetches,
``locate``, a ``get`` of a key no node has, and 1,000 small keys fetched one
by one against ``get_many`` of 1,000 others. It also counts the messages
each operation sent and received (``cluster.requests``: a call is two, a
posted registration one, a question the home forwarded to the holder one
more). With the location directory each costs a bounded number of messages
whatever the node count (a miss: one round trip to the key's home; a
remote get: the question to the home, which answers with the object where
it holds it or forwards the question to the holder, which answers; a round
trip to the holder where this node is the home; then a posted
registration: at most 4), so the counts stay under the bound from 2 to 8
nodes, and the times would too where every rank has a core of its own. Other ranks wait without spinning (MPICH
busy-polls in blocking calls; 8 ranks share 2 cores here). Medians.
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

import shmstore  # noqa: E402
from shmstore.mpi import Cluster, quiet_barrier  # noqa: E402


def pingpong(world: MPI.Comm, last: int, n: int) -> list[float]:
    """``n`` 8-byte Send/Recv round trips between rank 0 and rank ``last``: their times, on rank 0."""
    buf = np.zeros(8, np.uint8)
    rtts = []
    for _ in range(n):
        if world.rank == 0:
            t = time.perf_counter()
            world.Send(buf, dest=last)
            world.Recv(buf, source=last)
            rtts.append(time.perf_counter() - t)
        elif world.rank == last:
            world.Recv(buf, source=0)
            world.Send(buf, dest=0)
    return rtts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=500, help="gets before the timed ones (not timed)")
    ap.add_argument("--blocks", type=int, default=10, help="blocks of operations, each with its raw round trip")
    ap.add_argument("--batch", type=int, default=1000, help="small keys fetched one by one, then with get_many")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    last = world.size - 1
    rtts = pingpong(world, last, args.repeats)
    quiet_barrier(world)
    name = "bd" + uuid.uuid4().hex[:8]
    name = world.bcast(name)
    with Cluster(name=name, capacity="64MiB", prefault=0) as cluster:
        keys = [f"k{i}" for i in range(args.repeats)]
        warm = [f"w{i}" for i in range(args.warmup)]  # not timed: the first gets fault pages in, fill caches
        fkeys = [f"f{i}" for i in range(args.repeats)]
        if world.rank == last:
            for k in keys + warm + fkeys:
                cluster.put(k, np.full(8, 1, np.int64))  # 64 bytes
        quiet_barrier(world)
        ops = ("fetch", "get", "locate", "miss")
        times: dict[str, list[float]] = {op: [] for op in ops}
        msgs = dict.fromkeys(ops, 0)  # messages sent and received by rank 0, per operation
        blocks: list[tuple[float, ...]] = []  # per block: its raw round trip, fetch, get, locate, miss medians

        def timed(op: str, run, key: str) -> None:
            m, t = cluster.requests["messages"], time.perf_counter()
            run(key)
            times[op].append(time.perf_counter() - t)
            msgs[op] += cluster.requests["messages"] - m

        def miss(k: str) -> None:
            try:
                cluster.get(k)
            except shmstore.ObjectNotFoundError:
                pass

        if world.rank == 0:
            for k in warm:
                cluster.get(k)
        quiet_barrier(world)
        per = max(1, args.repeats // args.blocks)
        for b in range(0, args.repeats, per):
            # a block: the raw round trip again (this machine has noisy spells of seconds), then the operations
            block_rtt = pingpong(world, last, 100)
            if world.rank == 0:
                n0 = len(times["get"])
                for k, fk in zip(keys[b: b + per], fkeys[b: b + per]):  # side by side: noise hits all alike
                    timed("fetch", cluster.fetch, fk)  # what get does on a miss, without the read after
                    timed("get", cluster.get, k)
                    timed("locate", cluster.locate, k)
                    timed("miss", miss, k + "-missing")
                blocks.append((statistics.median(block_rtt),) + tuple(statistics.median(times[op][n0:])
                                                                       for op in ops))
            quiet_barrier(world)
        batch = [f"b{i}" for i in range(args.batch)]
        single = [f"s{i}" for i in range(args.batch)]
        if world.rank == last:
            for k in batch + single:
                cluster.put(k, np.full(8, 2, np.int64))
        quiet_barrier(world)
        one_by_one = many = 0.0
        if world.rank == 0 and args.batch:
            t = time.perf_counter()
            for k in single:
                cluster.get(k)
            one_by_one = time.perf_counter() - t
            t = time.perf_counter()
            cluster.get_many(batch)
            many = time.perf_counter() - t
        quiet_barrier(world)
        where = f"{len(cluster.nodes)} nodes" + (f" ({world.size} ranks)" if world.size != len(cluster.nodes) else "")
    if world.rank == 0 and args.batch:
        print(f"{where}: {args.batch} remote 64 B objects: get one by one {one_by_one * 1e3:.0f} ms, "
              f"get_many {many * 1e3:.0f} ms ({one_by_one / many:.0f}x faster)", flush=True)
    if world.rank == 0:
        r = statistics.median(rtts)
        f, g, lo, m = (statistics.median(times[op]) for op in ops)
        print(f"{where}: raw 8 B round trip {r * 1e6:.1f} us | 64 B fetch {f * 1e6:.0f} us ({f / r:.1f}x) "
              f"| remote 64 B get {g * 1e6:.0f} us "
              f"({g / r:.1f}x) | locate {lo * 1e6:.0f} us ({lo / r:.1f}x) | miss {m * 1e6:.0f} us ({m / r:.1f}x)",
              flush=True)
        ratios = [[blk[i] / blk[0] for blk in blocks] for i in range(1, 5)]
        print(f"{where}: per block of {per} (raw round trip taken again in each, median of "
              f"{len(blocks)} blocks and their range): " + ", ".join(
                  f"{name} {statistics.median(r):.1f}x ({min(r):.1f}-{max(r):.1f})"
                  for name, r in zip(ops, ratios)), flush=True)
        n = len(times["get"])
        print(f"{where}: messages per operation (this rank's requests and their replies): "
              f"fetch {msgs['fetch'] / n:.2f}, get {msgs['get'] / n:.2f}, locate {msgs['locate'] / n:.2f}, "
              f"miss {msgs['miss'] / n:.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
