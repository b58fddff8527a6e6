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
import statistics
import sys
import time
import uuid
import os

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpi4py import MPI  # noqa: E402

import shmstore  # noqa: E402
from shmstore.mpi import Cluster, quiet_barrier  # noqa: E402



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=500, help="gets before the timed ones (not timed)")
    ap.add_argument("--blocks", type=int, default=10, help="blocks of operations, each with its raw round trip")
    ap.add_argument("--batch", type=int, default=1000, help="small keys fetched one by one, then with get_many")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    last = world.size - 1
    buf = np.zeros(8, np.uint8)
    rtts = []
    for _ in range(args.repeats):
        if world.rank == 0:
            t = time.perf_counter()
            world.Send(buf, dest=last)
            world.Recv(buf, source=last)
            rtts.append(time.perf_counter() - t)
        elif world.rank == last:
            world.Recv(buf, source=0)
            world.Send(buf, dest=0)
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
        gets, locates, misses, fetches = [], [], [], []
        msgs = {"get": 0, "locate": 0, "miss": 0, "fetch": 0}  # messages sent and received by rank 0, per op
        blocks: list[tuple[float, ...]] = []  # per block: its raw round trip, fetch, get, locate, miss medians

        def sent() -> int:
            r = cluster.requests
            return 2 * r["calls"] + r["posts"] + r["forwarded"]  # call: request, reply; post: one; forward: one

        if world.rank == 0:
            for k in warm:
                cluster.get(k)
        quiet_barrier(world)
        per = max(1, args.repeats // args.blocks)
        for b in range(0, args.repeats, per):
            # a block: the raw round trip again (this machine has noisy spells of seconds), then the operations
            block_rtt = []
            for _ in range(100):
                if world.rank == 0:
                    t = time.perf_counter()
                    world.Send(buf, dest=last)
                    world.Recv(buf, source=last)
                    block_rtt.append(time.perf_counter() - t)
                elif world.rank == last:
                    world.Recv(buf, source=0)
                    world.Send(buf, dest=0)
            if world.rank == 0:
                n0 = len(gets)
                for k, fk in zip(keys[b: b + per], fkeys[b: b + per]):  # side by side: noise hits all alike
                    m, t = sent(), time.perf_counter()
                    cluster.fetch(fk)  # bring it here (what get does on a miss, without reading it after)
                    fetches.append(time.perf_counter() - t)
                    msgs["fetch"] += sent() - m
                    m, t = sent(), time.perf_counter()
                    cluster.get(k)
                    gets.append(time.perf_counter() - t)
                    m2, t = sent(), time.perf_counter()
                    cluster.locate(k)
                    locates.append(time.perf_counter() - t)
                    m3, t = sent(), time.perf_counter()
                    try:
                        cluster.get(k + "-missing")
                    except shmstore.ObjectNotFoundError:
                        pass
                    misses.append(time.perf_counter() - t)
                    msgs["get"] += m2 - m
                    msgs["locate"] += m3 - m2
                    msgs["miss"] += sent() - m3
                blocks.append(tuple(statistics.median(x) for x in (
                    block_rtt, fetches[n0:], gets[n0:], locates[n0:], misses[n0:])))
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
        g, lo, m = statistics.median(gets), statistics.median(locates), statistics.median(misses)
        f = statistics.median(fetches)
        print(f"{where}: raw 8 B round trip {r * 1e6:.1f} us | 64 B fetch {f * 1e6:.0f} us ({f / r:.1f}x) "
              f"| remote 64 B get {g * 1e6:.0f} us "
              f"({g / r:.1f}x) | locate {lo * 1e6:.0f} us ({lo / r:.1f}x) | miss {m * 1e6:.0f} us ({m / r:.1f}x)",
              flush=True)
        ratios = [[blk[i] / blk[0] for blk in blocks] for i in range(1, 5)]
        print(f"{where}: per block of {per} (raw round trip taken again in each, median of "
              f"{len(blocks)} blocks and their range): " + ", ".join(
                  f"{name} {statistics.median(r):.1f}x ({min(r):.1f}-{max(r):.1f})"
                  for name, r in zip(("fetch", "get", "locate", "miss"), ratios)), flush=True)
        n = len(gets)
        print(f"{where}: messages per operation (this rank's requests and their replies): "
              f"fetch {msgs['fetch'] / n:.2f}, get {msgs['get'] / n:.2f}, locate {msgs['locate'] / n:.2f}, "
              f"miss {msgs['miss'] / n:.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
