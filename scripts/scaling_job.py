#!/usr/bin/env python3
"""One measurement run of the scaling suite (launched by scripts/scaling.py under mpiexec or srun).

Every rank opens one Cluster; rank 0 appends one JSON line per measurement to
``--out``, each with the raw baseline measured in the same run beside it:

- ``local_put_ops`` / ``local_get_ops``: 64 B objects per second on one node,
  every rank of node 0 at once, against the rate of one rank alone times the
  ranks (ideal scaling);
- ``local_put_bw``: a put of SIZE bytes against one ``np.copyto`` of them;
- ``local_get_bw``: a get of a SIZE-byte array and one pass over its bytes
  (``sum``: a get is a zero-copy view) against the same pass over a private
  array;
- ``fetch_bw``: a get on node 1 of an object of SIZE bytes put on node 0,
  against a raw ``Send``/``Recv`` of SIZE bytes between the same ranks;
- ``migrate_blobs_bw``: a dict of 64 arrays (SIZE bytes in all) migrated to
  node 1, against the same raw ``Send``/``Recv``;
- ``remote_get_lat`` / ``locate_lat``: a 64 B get from another node and a
  ``locate``, against a raw 8 B round trip; ``remote_get_msgs`` /
  ``locate_msgs``: the messages each cost (``cluster.requests``), against
  the bound that holds for any node count (4 and 2);
- ``broadcast``: every node gets one SIZE-byte object, against ``MPI_Bcast``;
- ``spill_bw``: SIZE-byte puts into a store four times smaller than what is
  put (spilling to disk), against writing the same bytes to a file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpi4py import MPI  # noqa: E402

import shmstore  # noqa: E402
from shmstore import Level  # noqa: E402
from shmstore.mpi import Cluster, quiet_barrier  # noqa: E402

MiB = 1 << 20



class Recorder:
    def __init__(self, cluster: Cluster, out: str) -> None:
        self.c, self.out = cluster, out
        self.rpn = cluster.size // len(cluster.nodes)

    def row(self, workload: str, size: int, value: float, unit: str, baseline: str, base: float) -> None:
        if self.c.rank != 0:
            return
        higher_better = unit.endswith("/s")
        ratio = (value / base if higher_better else base / value) if base and value else 0.0
        rec = {"workload": workload, "nodes": len(self.c.nodes), "ranks_per_node": self.rpn, "size": size,
               "value": value, "unit": unit, "baseline": baseline, "baseline_value": base,
               "ratio_to_baseline": ratio}
        with open(self.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def local_ops(c: Cluster, rec: Recorder, n: int) -> None:
    """Small puts and gets on node 0: one rank alone, then every rank of the node at once."""
    comm = c.comm
    node0 = [r for r, node in enumerate(comm.allgather(c.node_index)) if node == 0]
    rates: dict[str, list[float]] = {"put": [], "get": []}
    if c.rank in node0:  # warm up: the first puts take fresh table entries and chunks
        for i in range(min(n, 500)):
            c.store.put(f"warm-{c.rank}-{i}", b"x" * 64)
            c.store.get(f"warm-{c.rank}-{i}")
            c.store.delete(f"warm-{c.rank}-{i}")
    for alone in (True, False):
        active = c.rank in node0 and (not alone or c.rank == node0[0])
        tag = "a" if alone else "b"
        keys = [f"ops-{tag}-{c.rank}-{i}" for i in range(n)]
        value = b"x" * 64
        quiet_barrier(comm)
        t = time.perf_counter()
        if active:
            for k in keys:
                c.store.put(k, value)
        put = time.perf_counter() - t
        quiet_barrier(comm)
        t = time.perf_counter()
        if active:
            for k in keys:
                c.store.get(k)
        get = time.perf_counter() - t
        ops = comm.gather((n / put if active else 0.0, n / get if active else 0.0))
        if c.rank == 0:
            rates["put"].append(sum(o[0] for o in ops))
            rates["get"].append(sum(o[1] for o in ops))
        quiet_barrier(comm)
        if active:
            for k in keys:
                c.store.delete(k)
    if c.rank == 0:
        for verb in ("put", "get"):
            one, many = rates[verb]
            rec.row(f"local_{verb}_ops", 64, many, "ops/s", "one rank x ranks (ideal)", one * len(node0))


def local_bandwidth(c: Cluster, rec: Recorder, size: int, repeats: int) -> None:
    if c.rank != 0:
        return
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    copy = median_time(lambda: np.copyto(dst, src), repeats)
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        c.store.put(f"bw-{i}", src)
        times.append(time.perf_counter() - t)
        c.store.delete(f"bw-{i}")
    put = statistics.median(times)
    rec.row("local_put_bw", size, size / put / 2**30, "GiB/s", "np.copyto", size / copy / 2**30)
    c.store.put("bw-get", src)
    read = median_time(lambda: int(src.sum(dtype=np.uint64)), repeats)
    get = median_time(lambda: int(c.store.get("bw-get").sum(dtype=np.uint64)), repeats)
    c.store.delete("bw-get")
    rec.row("local_get_bw", size, size / get / 2**30, "GiB/s", "sum over a private array", size / read / 2**30)


def raw_send_recv(c: Cluster, a: int, b: int, buf: np.ndarray, repeats: int) -> float:
    comm = c.comm
    times = []
    for _ in range(repeats):
        quiet_barrier(comm)
        t = time.perf_counter()
        if c.rank == a:
            comm.Send(buf, dest=b, tag=77)
        elif c.rank == b:
            comm.Recv(buf, source=a, tag=77)
        times.append(time.perf_counter() - t)
    return statistics.median(times) if c.rank == b else 0.0


def remote(c: Cluster, rec: Recorder, size: int, repeats: int) -> None:
    """Fetch and many-blob migration of SIZE bytes from node 0 to node 1, against raw Send/Recv."""
    a, b = c.leaders[0], c.leaders[1]
    comm = c.comm
    buf = np.zeros(size, np.uint8)
    raw = comm.bcast(raw_send_recv(c, a, b, buf, repeats), root=b)
    data = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    blobs = {f"w{i}": data[i * (size // 64):(i + 1) * (size // 64)] for i in range(64)}
    fetch, mig = [], []
    for i in range(repeats):
        if c.rank == a:
            c.put(f"f-{i}", data)
            c.put(f"m-{i}", blobs)
        quiet_barrier(comm)
        t = time.perf_counter()
        if c.rank == b:
            c.get(f"f-{i}")
        fetch.append(time.perf_counter() - t)
        quiet_barrier(comm)
        t = time.perf_counter()
        if c.rank == a:
            c.migrate(f"m-{i}", 1)
        mig.append(time.perf_counter() - t)
        quiet_barrier(comm)
        if c.rank == a:
            c.delete(f"f-{i}")
            c.delete(f"m-{i}")
        quiet_barrier(comm)
    f = comm.bcast(statistics.median(fetch) if c.rank == b else 0.0, root=b)
    rec.row("fetch_bw", size, size / f / 2**30, "GiB/s", "MPI Send/Recv", size / raw / 2**30)
    rec.row("migrate_blobs_bw", size, size / statistics.median(mig) / 2**30, "GiB/s", "MPI Send/Recv",
            size / raw / 2**30)


def latency(c: Cluster, rec: Recorder, n: int) -> None:
    """A 64 B get from the last node and a locate, against a raw 8 B round trip (rank 0 and the last leader)."""
    comm, last = c.comm, c.leaders[-1]
    buf = np.zeros(8, np.uint8)
    rtts = []
    quiet_barrier(comm)
    for _ in range(n):
        if c.rank == 0:
            t = time.perf_counter()
            comm.Send(buf, dest=last, tag=78)
            comm.Recv(buf, source=last, tag=78)
            rtts.append(time.perf_counter() - t)
        elif c.rank == last:
            comm.Recv(buf, source=0, tag=78)
            comm.Send(buf, dest=0, tag=78)
    keys = [f"lat-{i}" for i in range(n + 20)]  # the first 20: warming up, not counted
    if c.rank == last:
        for k in keys:
            c.put(k, np.full(8, 1, np.int64))
    quiet_barrier(comm)
    gets, locs = [], []
    if c.rank == 0:
        for k in keys[:20]:
            c.get(k)
            c.locate(k)
        msgs = {"get": 0, "locate": 0}
        for k in keys[20:]:
            m, t = c.requests["messages"], time.perf_counter()
            c.get(k)
            gets.append(time.perf_counter() - t)
            m2, t = c.requests["messages"], time.perf_counter()
            c.locate(k)
            locs.append(time.perf_counter() - t)
            msgs["get"] += m2 - m
            msgs["locate"] += c.requests["messages"] - m2
        rtt = statistics.median(rtts)
        rec.row("remote_get_lat", 64, statistics.median(gets) * 1e6, "us", "MPI 8 B round trip", rtt * 1e6)
        rec.row("locate_lat", 64, statistics.median(locs) * 1e6, "us", "MPI 8 B round trip", rtt * 1e6)
        # what carries to any machine: messages per operation, bounded whatever the node count
        rec.row("remote_get_msgs", 64, msgs["get"] / n, "messages", "bound for any node count", 4.0)
        rec.row("locate_msgs", 64, msgs["locate"] / n, "messages", "bound for any node count", 2.0)
    quiet_barrier(comm)
    if c.rank == last:
        for k in keys:
            c.delete(k)
    quiet_barrier(comm)


def broadcast(c: Cluster, rec: Recorder, size: int) -> None:
    comm = c.comm
    data = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8)
    leader = c.rank == c.leaders[c.node_index]
    if c.rank == 0:
        c.put("bcast", data)
    quiet_barrier(comm)
    t = time.perf_counter()
    if leader:
        c.get("bcast")
    quiet_barrier(comm)
    tree = time.perf_counter() - t
    buf = data.copy() if c.rank == 0 else np.empty(size, np.uint8)
    quiet_barrier(comm)
    t = time.perf_counter()
    comm.Bcast(buf, root=0)
    quiet_barrier(comm)
    bc = time.perf_counter() - t
    rec.row("broadcast", size, tree, "s", "MPI_Bcast", bc)
    if c.rank == 0:
        c.delete("bcast")
    quiet_barrier(comm)


def spill(c: Cluster, rec: Recorder, size: int) -> None:
    if c.rank != 0:
        return
    data = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8)
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        with open(os.path.join(d, "raw"), "wb") as f:
            for _ in range(4):
                f.write(data)
        raw = time.perf_counter() - t
        os.unlink(os.path.join(d, "raw"))
        with shmstore.connect("sp" + uuid.uuid4().hex[:8], capacity=max(size + (4 << 20), 8 * MiB), spill_dir=d,
                              prefault=0) as s:
            t = time.perf_counter()
            for i in range(4):
                s.put(f"s{i}", data, levels=[Level.MEMORY, Level.DISK])
            put = time.perf_counter() - t
    rec.row("spill_bw", size, 4 * size / put / 2**30, "GiB/s", "file write", 4 * size / raw / 2**30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="1,16", help="object sizes in MiB")
    ap.add_argument("--ops", type=int, default=2000, help="small objects per rank")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]
    world = MPI.COMM_WORLD
    name = world.bcast("sc" + uuid.uuid4().hex[:8])
    cap = max(sizes) * 6 + 128 * MiB
    with Cluster(name=name, capacity=cap, prefault=cap) as c:
        if c.rank == c.leaders[c.node_index]:
            c.store.wait_prefaulted(cap, timeout=120)  # warm pages: time the store, not first touches
        rec = Recorder(c, args.out)
        local_ops(c, rec, args.ops)
        for size in sizes:
            local_bandwidth(c, rec, size, args.repeats)
        if len(c.nodes) > 1:
            latency(c, rec, 200)
            for size in sizes:
                remote(c, rec, size, args.repeats)
            broadcast(c, rec, max(sizes))
        spill(c, rec, sizes[0])
        c.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
