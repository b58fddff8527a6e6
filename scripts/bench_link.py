#!/usr/bin/env python3
"""Fetches between two nodes against raw mpi4py over the same link, cold and warm, and against the link.

    mpi/testnodes start /tmp/nodes 2 --rate 1gbit
    mpi/testnodes exec /tmp/nodes n0 mpiexec -launcher ssh -launcher-exec /tmp/nodes/bin/launch \\
        -hosts n0:1,n1:1 -n 2 python -m mpi4py scripts/bench_link.py --link-gbit 1

(or on shared-host emulated nodes: ``mpiexec -launcher fork -hosts n0:1,n1:1 -n 2 ...``). Rank 0 (node n0)
holds the objects, rank 1 (node n1) fetches them. For each size (``--sizes``, MiB):

- raw cold: ``Recv`` into a fresh buffer (its pages faulted in as the bytes come), median of ``--repeats``;
- raw warm: ``Recv`` into the same buffer again;
- first fetch: into a store whose memory no object used yet (created with ``prefault=0``: its pages are
  faulted in as the bytes come, as raw cold's are), once per size;
- warm fetch: the object deleted and fetched again (the same, now warm, memory), median of ``--repeats``.

Then a 1,000-array state dict of ``--dict-mib`` against raw ``Send``/``Recv`` of one buffer of the same
bytes (warm), and a 64-byte object fetched 200 times (distinct keys, back to back) against the raw 8-byte
round trip. With ``--link-gbit`` each rate is also given as a fraction of the link's. Medians; the ranks
not measuring wait without spinning.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shmstore.mpi import Cluster, quiet_barrier  # noqa: E402

MiB = 1 << 20
SRC, DST = 0, 1


def raw(comm: MPI.Comm, nbytes: int, repeats: int, fresh: bool) -> float:
    """Median seconds for rank SRC to Send ``nbytes`` that rank DST receives (``fresh``: into a new buffer
    each time)."""
    times = []
    src = np.ones(nbytes, np.uint8) if comm.rank == SRC else None
    dst = np.empty(nbytes, np.uint8) if comm.rank == DST and not fresh else None
    for _ in range(repeats):
        if comm.rank == DST and fresh:
            dst = np.empty(nbytes, np.uint8)
        quiet_barrier(comm)
        if comm.rank == SRC:
            comm.Send([src, MPI.BYTE], dest=DST, tag=7)
            comm.Recv([np.empty(1, np.uint8), MPI.BYTE], source=DST, tag=8)
        elif comm.rank == DST:
            t = time.perf_counter()
            comm.Recv([dst, MPI.BYTE], source=SRC, tag=7)
            times.append(time.perf_counter() - t)
            comm.Send([np.zeros(1, np.uint8), MPI.BYTE], dest=SRC, tag=8)
        if fresh:
            dst = None
    return statistics.median(times) if times else 0.0


def rtt(comm: MPI.Comm, n: int = 1000) -> float:
    buf = np.zeros(8, np.uint8)
    times = []
    quiet_barrier(comm)
    for _ in range(n):
        if comm.rank == DST:
            t = time.perf_counter()
            comm.Send([buf, MPI.BYTE], dest=SRC, tag=9)
            comm.Recv([buf, MPI.BYTE], source=SRC, tag=9)
            times.append(time.perf_counter() - t)
        elif comm.rank == SRC:
            comm.Recv([buf, MPI.BYTE], source=DST, tag=9)
            comm.Send([buf, MPI.BYTE], dest=DST, tag=9)
    return statistics.median(times) if times else 0.0


def fetches(cluster: Cluster, key: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        quiet_barrier(cluster.comm)
        if cluster.rank == DST:
            t = time.perf_counter()
            cluster.fetch(key)
            times.append(time.perf_counter() - t)
            cluster.store.delete(key)
    quiet_barrier(cluster.comm)  # (the holder may delete the object next)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,128,1024", help="MiB, comma-separated (default 1,128,1024)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dict-mib", type=int, default=256)
    ap.add_argument("--link-gbit", type=float, help="the link's rate (tc tbf), for the ratios against it")
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    cap = 2 * max(sizes + [args.dict_mib * MiB]) + 256 * MiB
    name = comm.bcast("bl" + uuid.uuid4().hex[:8] if comm.rank == 0 else None)
    rows = []
    with Cluster(name=name, capacity=cap, prefault=0) as cluster:
        if len(cluster.nodes) != 2 or comm.size != 2:
            raise SystemExit("bench_link runs on 2 ranks, one on each of two nodes: see the usage line")
        link = args.link_gbit * 1e9 / 8 if args.link_gbit else None
        for n in sizes:
            r_cold = raw(comm, n, args.repeats, fresh=True)
            r_warm = raw(comm, n, args.repeats, fresh=False)
            if cluster.rank == SRC:
                cluster.put("obj", np.ones(n, np.uint8))
            first = fetches(cluster, "obj", 1)
            warm = fetches(cluster, "obj", args.repeats)
            if cluster.rank == SRC:
                cluster.delete("obj")
            if cluster.rank == DST:
                f_first, f_warm = first[0], statistics.median(warm)
                rows.append({"mib": n // MiB, "raw_cold_s": r_cold, "raw_warm_s": r_warm, "first_s": f_first,
                             "warm_s": f_warm, "first_vs_raw_cold": r_cold / f_first,
                             "warm_vs_raw_warm": r_warm / f_warm,
                             "warm_vs_link": n / f_warm / link if link else None,
                             "raw_vs_link": n / r_warm / link if link else None})
        nd = args.dict_mib * MiB
        r_dict = raw(comm, nd, args.repeats, fresh=False)
        if cluster.rank == SRC:
            cluster.put("sd", {f"layer{i}.weight": np.full(nd // 1000 // 4, i, np.float32) for i in range(1000)})
        fetches(cluster, "sd", 1)  # its memory warm, as raw's buffer is
        t_dict = fetches(cluster, "sd", args.repeats)
        r_rtt = rtt(comm)
        if cluster.rank == SRC:
            for i in range(200):
                cluster.put(f"tiny{i}", np.arange(8, dtype=np.float64))
        quiet_barrier(comm)
        tiny = []
        if cluster.rank == DST:
            for i in range(200):
                t = time.perf_counter()
                cluster.get(f"tiny{i}")
                tiny.append(time.perf_counter() - t)
        quiet_barrier(comm)
        out = {"nodes": cluster.nodes, "link_gbit": args.link_gbit, "sizes": rows,
               "dict_vs_raw": statistics.median(t_dict) / r_dict if t_dict else None,
               "dict_ms": statistics.median(t_dict) * 1e3 if t_dict else None, "raw_dict_ms": r_dict * 1e3,
               "rtt_us": r_rtt * 1e6, "get64_us": statistics.median(tiny) * 1e6 if tiny else None,
               "get64_p99_us": float(np.percentile(tiny, 99)) * 1e6 if tiny else None}
        out = comm.bcast(out if cluster.rank == DST else None, root=DST)
    if comm.rank == 0:
        gb = lambda n, s: n * MiB / s / 1e9  # noqa: E731
        print(f"bench_link: nodes {out['nodes']}, link {args.link_gbit or 'unlimited'} Gbit/s "
              f"({os.environ.get('UCX_TLS', 'default transport')}), medians of {args.repeats}")
        for r in out["sizes"]:
            extra = (f" | warm {r['warm_vs_link']:.2f}x link, raw {r['raw_vs_link']:.2f}x link"
                     if r["warm_vs_link"] else "")
            print(f"{r['mib']:>5} MiB: raw cold {gb(r['mib'], r['raw_cold_s']):.2f} GB/s, first fetch "
                  f"{gb(r['mib'], r['first_s']):.2f} GB/s ({r['first_vs_raw_cold']:.2f}x) | raw warm "
                  f"{gb(r['mib'], r['raw_warm_s']):.2f} GB/s, warm fetch {gb(r['mib'], r['warm_s']):.2f} GB/s "
                  f"({r['warm_vs_raw_warm']:.2f}x){extra}")
        print(f"state dict 1000 arrays / {args.dict_mib} MiB: {out['dict_ms']:.1f} ms vs raw one buffer "
              f"{out['raw_dict_ms']:.1f} ms ({out['dict_vs_raw']:.2f}x)")
        print(f"64 B get, 200 distinct back to back: median {out['get64_us']:.0f} us, p99 {out['get64_p99_us']:.0f} us"
              f" | raw 8 B round trip {out['rtt_us']:.1f} us ({out['get64_us'] / out['rtt_us']:.1f}x)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
