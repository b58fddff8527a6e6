#!/usr/bin/env python3
"""Transfer benchmark between two nodes, against raw mpi4py Send/Recv in the same run.

    mpiexec -launcher fork -hosts n0:1,n1:4 -genv MPIR_CVAR_CH4_NUM_VCIS 4 -n 5 \
        python -m mpi4py scripts/bench_transfer.py

(``MPIR_CVAR_CH4_NUM_VCIS`` > 1 gives MPICH one virtual communication
interface per communicator, so the cluster's two transfer streams are copied
on two cores at once; the raw baselines are single ``Send``/``Recv`` pairs
under the same setting.)

Rank 0 (node n0) is the source, the first rank of the other node the
destination; with four ranks there, they also fetch one key all at once.

- raw baseline: ``Send``/``Recv`` of one contiguous buffer of the same bytes
  between the same two ranks (warm private buffers, which numpy backs with
  huge pages), the same between buffers inside the two stores (shared-memory
  pages, 4 KiB where the kernel gives tmpfs no huge pages), and an 8-byte
  ping-pong;
- fetch of a 1 GiB array into the other node's (prefaulted) store;
- fetch of a 1,000-array 256 MiB state dict, against raw 256 MiB;
- fetch of a 64-byte object: round-trip latency;
- four ranks of one node fetching the same key: bytes received by the node.

Medians over ``--repeats``; idle ranks wait without spinning (MPICH busy-polls
in blocking calls, which would steal the cores of the measured pair).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shmstore.mpi import Cluster, quiet_barrier  # noqa: E402

MiB = 1 << 20



def raw_bandwidth(comm: MPI.Comm, a: int, b: int, nbytes: int, repeats: int) -> float:
    """Median seconds for rank ``a`` to Send ``nbytes`` to rank ``b``."""
    times = []
    buf = np.ones(nbytes, np.uint8) if comm.rank in (a, b) else None
    for _ in range(repeats):
        quiet_barrier(comm)
        if comm.rank == a:
            comm.Send([buf, MPI.BYTE], dest=b, tag=7)
            comm.Recv([buf[:1], MPI.BYTE], source=b, tag=8)
        elif comm.rank == b:
            t = time.perf_counter()
            comm.Recv([buf, MPI.BYTE], source=a, tag=7)
            times.append(time.perf_counter() - t)
            comm.Send([buf[:1], MPI.BYTE], dest=a, tag=8)
    return statistics.median(times) if times else 0.0


def raw_arena_bandwidth(cluster: Cluster, a: int, b: int, nbytes: int, repeats: int) -> float:
    """Like raw_bandwidth, but between buffers in the two nodes' stores (shared-memory pages)."""
    comm = cluster.comm
    times = []
    if comm.rank == a:
        cluster.store.put("raw-src", np.ones(nbytes, np.uint8), levels=["memory"])
        buf = cluster.store.get("raw-src")
    elif comm.rank == b:
        writer = cluster.store.open_writer("raw-dst", nbytes, levels=["memory"])
        buf = np.frombuffer(writer.buffer, np.uint8)
    for _ in range(repeats):
        quiet_barrier(comm)
        if comm.rank == a:
            comm.Send([buf, MPI.BYTE], dest=b, tag=7)
            comm.Recv([np.empty(1, np.uint8), MPI.BYTE], source=b, tag=8)
        elif comm.rank == b:
            t = time.perf_counter()
            comm.Recv([buf, MPI.BYTE], source=a, tag=7)
            times.append(time.perf_counter() - t)
            comm.Send([buf[:1].copy(), MPI.BYTE], dest=a, tag=8)
    if comm.rank == a:
        del buf
        cluster.store.delete("raw-src")
    elif comm.rank == b:
        del buf
        writer.abort()
    return statistics.median(times) if times else 0.0


def raw_latency(comm: MPI.Comm, a: int, b: int, n: int = 1000) -> float:
    """Median round trip of 8 bytes between ``a`` and ``b`` (seconds)."""
    buf = np.zeros(8, np.uint8)
    times = []
    quiet_barrier(comm)
    for _ in range(n):
        if comm.rank == a:
            t = time.perf_counter()
            comm.Send([buf, MPI.BYTE], dest=b, tag=9)
            comm.Recv([buf, MPI.BYTE], source=b, tag=9)
            times.append(time.perf_counter() - t)
        elif comm.rank == b:
            comm.Recv([buf, MPI.BYTE], source=a, tag=9)
            comm.Send([buf, MPI.BYTE], dest=a, tag=9)
    return statistics.median(times) if times else 0.0


def timed_fetches(cluster: Cluster, key: str, dest: int, repeats: int, n_obj: int = 1) -> list[float]:
    times = []
    for _ in range(repeats):
        quiet_barrier(cluster.comm)
        if cluster.rank == dest:
            t = time.perf_counter()
            cluster.fetch(key, block_size=cluster.block_size)
            times.append(time.perf_counter() - t)
            cluster.store.delete(key)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--block-mib", type=int, default=0, help="bytes per MPI frame (default: the cluster's)")
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    big = args.big_mib * MiB
    cap = big + 512 * MiB
    name = comm.bcast("bx" + uuid.uuid4().hex[:8] if comm.rank == 0 else None)
    with Cluster(name=name, capacity=cap, prefault=cap) as cluster:
        if len(cluster.nodes) < 2:
            raise SystemExit("bench_transfer needs two nodes: see the usage line")
        src, dest = cluster.leaders[0], cluster.leaders[1]
        if args.block_mib:
            cluster.block_size = args.block_mib * MiB
        out = {"ranks": comm.size, "nodes": cluster.nodes}
        if cluster.rank in (src, dest):
            cluster.store.wait_prefaulted(cap, timeout=300)
        raw_big = raw_bandwidth(comm, src, dest, big, args.repeats)
        raw_arena = raw_arena_bandwidth(cluster, src, dest, big, args.repeats)
        raw_sd = raw_bandwidth(comm, src, dest, 256 * MiB, args.repeats)
        raw_rtt = raw_latency(comm, dest, src)

        if cluster.rank == src:
            cluster.put("big", np.ones(big, np.uint8))
            cluster.put("sd", {f"layer{i}.weight": np.full(64 * 1024, i, np.float32) for i in range(1000)})
            cluster.put("tiny", np.arange(8, dtype=np.float64))
            cluster.put("shared", np.ones(16 * MiB, np.uint8))
        quiet_barrier(comm)
        t_big = timed_fetches(cluster, "big", dest, args.repeats)
        t_sd = timed_fetches(cluster, "sd", dest, args.repeats)
        t_tiny = timed_fetches(cluster, "tiny", dest, 200)
        if cluster.rank == dest:
            out["raw_gbps"] = big / raw_big / 1e9
            out["fetch_big_gbps"] = big / statistics.median(t_big) / 1e9
            out["fetch_big_vs_raw"] = raw_big / statistics.median(t_big)
            out["raw_arena_gbps"] = big / raw_arena / 1e9
            out["fetch_big_vs_raw_arena"] = raw_arena / statistics.median(t_big)
            out["raw_256mib_ms"] = raw_sd * 1e3
            out["fetch_state_dict_ms"] = statistics.median(t_sd) * 1e3
            out["fetch_state_dict_vs_raw"] = statistics.median(t_sd) / raw_sd
            out["raw_rtt_us"] = raw_rtt * 1e6
            out["fetch_64b_us"] = statistics.median(t_tiny) * 1e6

        # every rank of the destination node asks for the same key at once
        node_ranks = [r for r, n in enumerate(comm.allgather(cluster.node)) if n == cluster.nodes[1]]
        before = cluster.stats()
        quiet_barrier(comm)
        if cluster.rank in node_ranks:
            threads = [threading.Thread(target=cluster.fetch, args=("shared",))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        quiet_barrier(comm)
        if cluster.rank == dest:
            after = cluster.stats()
            out["same_key_ranks"] = len(node_ranks)
            out["same_key_bytes_received"] = after["bytes_received"] - before["bytes_received"]
            out["same_key_object_bytes"] = cluster.store.get_info("shared").size
            out["same_key_deduplicated"] = after["migrations_deduplicated"] - before["migrations_deduplicated"]
        quiet_barrier(comm)
        if cluster.rank == src:
            for k in ("big", "sd", "tiny", "shared"):
                cluster.delete(k)
        quiet_barrier(comm)
        results = comm.bcast(out if cluster.rank == dest else None, root=dest)
    if comm.rank == 0:
        r = results
        print(f"bench_transfer: {r['ranks']} ranks on nodes {r['nodes']}")
        print(f"raw Send/Recv {args.big_mib} MiB: {r['raw_gbps']:.2f} GB/s between private buffers, "
              f"{r['raw_arena_gbps']:.2f} GB/s between buffers in the stores | fetch {r['fetch_big_gbps']:.2f} GB/s "
              f"({r['fetch_big_vs_raw']:.2f}x raw private, {r['fetch_big_vs_raw_arena']:.2f}x raw in-store)")
        print(f"state dict 1000 arrays / 256 MiB: fetch {r['fetch_state_dict_ms']:.1f} ms vs raw 256 MiB "
              f"{r['raw_256mib_ms']:.1f} ms ({r['fetch_state_dict_vs_raw']:.2f}x)")
        print(f"64-byte object: fetch round trip {r['fetch_64b_us']:.0f} us "
              f"(raw 8-byte ping-pong {r['raw_rtt_us']:.1f} us)")
        print(f"{r['same_key_ranks']} ranks of one node fetching the same key: node received "
              f"{r['same_key_bytes_received']} bytes for an object of {r['same_key_object_bytes']} bytes "
              f"({r['same_key_deduplicated']} request(s) deduplicated)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
