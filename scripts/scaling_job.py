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

Every baseline is taken in turns with what it is compared to, ``--repeats``
times, and both are the medians (one sample of a baseline on a shared machine
read a round trip of 217 us in one job and 6 us in the next).
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
    """Rank 0's JSON lines: one row per measurement, its baseline from the same run beside it."""

    def __init__(self, cluster: Cluster, out: str, repeats: int) -> None:
        self.c, self.out, self.repeats = cluster, out, repeats
        self.rpn = cluster.size // len(cluster.nodes)

    def row(self, workload: str, size: int, value: float, unit: str, baseline: str, base: float) -> None:
        if self.c.rank != 0:
            return
        higher_better = unit.endswith("/s")
        ratio = (value / base if higher_better else base / value) if base and value else 0.0
        rec = {"workload": workload, "nodes": len(self.c.nodes), "node_names": " ".join(self.c.nodes),
               "ranks_per_node": self.rpn, "size": size, "value": value, "unit": unit, "baseline": baseline,
               "baseline_value": base, "ratio_to_baseline": ratio, "repeats": self.repeats}
        with open(self.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleaved(measured, baseline, repeats: int) -> tuple[float, float]:
    """Medians of ``repeats`` timings of each, taken in turns (baseline, measured, baseline, ...): a noisy
    moment of a shared machine hits both alike, and neither is one lucky or unlucky sample."""
    ms, bs = [], []
    for _ in range(repeats):
        bs.append(timed(baseline))
        ms.append(timed(measured))
    return statistics.median(ms), statistics.median(bs)


def local_ops(c: Cluster, rec: Recorder, n: int, repeats: int) -> None:
    """Small puts and gets on node 0: one rank alone, then every rank of the node at once, in turns
    ``repeats`` times (medians)."""
    comm = c.comm
    node0 = [r for r, node in enumerate(comm.allgather(c.node_index)) if node == 0]
    rates: dict[str, list[float]] = {"put": [], "get": []}
    if c.rank in node0:  # warm up: the first puts take fresh table entries and chunks
        for i in range(min(n, 500)):
            c.store.put(f"warm-{c.rank}-{i}", b"x" * 64)
            c.store.get(f"warm-{c.rank}-{i}")
            c.store.delete(f"warm-{c.rank}-{i}")
    for alone in (True, False) * repeats:
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
            one, many = statistics.median(rates[verb][0::2]), statistics.median(rates[verb][1::2])
            rec.row(f"local_{verb}_ops", 64, many, "ops/s", "one rank x ranks (ideal)", one * len(node0))


def local_bandwidth(c: Cluster, rec: Recorder, size: int, repeats: int) -> None:
    if c.rank != 0:
        return
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # both targets warm: the store's arena is prefaulted, so is this buffer now
    c.store.put("bw-warm", src)
    c.store.delete("bw-warm")

    puts, copies = [], []
    for _ in range(repeats):  # in turns; the delete (freed at once: no view holds it) is not timed
        copies.append(timed(lambda: np.copyto(dst, src)))
        puts.append(timed(lambda: c.store.put("bw", src)))
        c.store.delete("bw")
    put_s, copy_s = statistics.median(puts), statistics.median(copies)
    rec.row("local_put_bw", size, size / put_s / 2**30, "GiB/s", "np.copyto", size / copy_s / 2**30)
    c.store.put("bw-get", src)
    get, read = interleaved(lambda: int(c.store.get("bw-get").sum(dtype=np.uint64)),
                            lambda: int(src.sum(dtype=np.uint64)), repeats)
    c.store.delete("bw-get")
    rec.row("local_get_bw", size, size / get / 2**30, "GiB/s", "sum over a private array", size / read / 2**30)


def raw_send_recv(c: Cluster, a: int, b: int, buf: np.ndarray) -> float:
    """One raw Send/Recv of ``buf`` from rank ``a`` to rank ``b``: its time on ``b`` (0 elsewhere)."""
    comm = c.comm
    quiet_barrier(comm)
    t = time.perf_counter()
    if c.rank == a:
        comm.Send(buf, dest=b, tag=77)
    elif c.rank == b:
        comm.Recv(buf, source=a, tag=77)
    return time.perf_counter() - t if c.rank == b else 0.0


def remote(c: Cluster, rec: Recorder, size: int, repeats: int) -> None:
    """Fetch and many-blob migration of SIZE bytes from node 0 to node 1, against raw Send/Recv of the same
    bytes between the same ranks, taken in turns with them (into a warm buffer, as the store's arena is)."""
    a, b = c.leaders[0], c.leaders[1]
    comm = c.comm
    buf = np.zeros(size, np.uint8)
    raw_send_recv(c, a, b, buf)  # warm
    data = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    blobs = {f"w{i}": data[i * (size // 64):(i + 1) * (size // 64)] for i in range(64)}
    fetch, mig, raws = [], [], []
    for i in range(repeats):
        raws.append(raw_send_recv(c, a, b, buf))
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
    raw = comm.bcast(statistics.median(raws) if c.rank == b else 0.0, root=b)
    rec.row("fetch_bw", size, size / f / 2**30, "GiB/s", "MPI Send/Recv", size / raw / 2**30)
    rec.row("migrate_blobs_bw", size, size / statistics.median(mig) / 2**30, "GiB/s", "MPI Send/Recv",
            size / raw / 2**30)


def latency(c: Cluster, rec: Recorder, n: int) -> None:
    """A 64 B get from the last node and a locate, against a raw 8 B round trip (rank 0 and the last leader)."""
    comm, last = c.comm, c.leaders[-1]
    buf = np.zeros(8, np.uint8)
    rtts: list[float] = []

    def pingpong() -> None:  # the raw round trip, taken again before each get (in turns with it)
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
    if c.rank == last:  # the last leader's own service answers the gets; here it also answers the round trips
        for _ in range(n):
            pingpong()
    if c.rank == 0:
        for k in keys[:20]:
            c.get(k)
            c.locate(k)
        msgs = {"get": 0, "locate": 0}
        for k in keys[20:]:
            pingpong()
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


def broadcast(c: Cluster, rec: Recorder, size: int, repeats: int) -> None:
    """Every node's leader gets one SIZE-byte object (the copies spread as a tree), against ``MPI_Bcast`` of
    the same bytes, in turns."""
    comm = c.comm
    data = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8)
    leader = c.rank == c.leaders[c.node_index]
    buf = data.copy() if c.rank == 0 else np.zeros(size, np.uint8)
    trees, bcasts = [], []
    for i in range(repeats):
        quiet_barrier(comm)
        t = time.perf_counter()
        comm.Bcast(buf, root=0)
        quiet_barrier(comm)
        bcasts.append(time.perf_counter() - t)
        if c.rank == 0:
            c.put(f"bcast-{i}", data)
        quiet_barrier(comm)
        t = time.perf_counter()
        if leader:
            c.get(f"bcast-{i}")
        quiet_barrier(comm)
        trees.append(time.perf_counter() - t)
        if c.rank == 0:
            c.delete(f"bcast-{i}")
    rec.row("broadcast", size, statistics.median(trees), "s", "MPI_Bcast", statistics.median(bcasts))
    quiet_barrier(comm)


def spill(c: Cluster, rec: Recorder, size: int, repeats: int) -> None:
    """Four SIZE-byte puts into a store that holds about one (three spill to disk), against writing the same
    bytes to a file in the same directory, in turns."""
    if c.rank != 0:
        return
    data = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8)
    with tempfile.TemporaryDirectory() as d:
        with shmstore.connect("sp" + uuid.uuid4().hex[:8], capacity=max(size + (4 << 20), 8 * MiB), spill_dir=d,
                              prefault=0) as s:
            def raw() -> None:
                with open(os.path.join(d, "raw"), "wb") as f:
                    for _ in range(4):
                        f.write(data)
                os.unlink(os.path.join(d, "raw"))

            def puts() -> None:
                for i in range(4):
                    s.put(f"s{i}", data, levels=[Level.MEMORY, Level.DISK])
            times, raws = [], []
            for _ in range(repeats):  # in turns; clearing the store is not timed
                raws.append(timed(raw))
                times.append(timed(puts))
                s.clear()
            put_s, raw_s = statistics.median(times), statistics.median(raws)
    rec.row("spill_bw", size, 4 * size / put_s / 2**30, "GiB/s", "file write", 4 * size / raw_s / 2**30)


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
        rec = Recorder(c, args.out, args.repeats)
        local_ops(c, rec, args.ops, args.repeats)
        for size in sizes:
            local_bandwidth(c, rec, size, args.repeats)
        if len(c.nodes) > 1:
            latency(c, rec, 200)
            for size in sizes:
                remote(c, rec, size, args.repeats)
            broadcast(c, rec, max(sizes), args.repeats)
        spill(c, rec, sizes[0], args.repeats)
        c.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
