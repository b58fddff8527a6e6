#!/usr/bin/env python3
"""Checkpoint benchmark across nodes (issue 34): every rank checkpoints its state at once, side by side in one run.

Run under MPI, e.g. 4 ranks on two emulated nodes::

    mpiexec -launcher fork -hosts n0:2,n1:2 -n 4 python -m mpi4py scripts/bench_checkpoint_mpi.py --mib 128

Per repeat, every rank at once (the slowest rank's time counts, as for a job):

- ``copyto``: ``np.copyto`` of its state into warm memory (the floor of an in-memory snapshot);
- ``torch_save`` (where torch is installed; else ``pickle_save``): its state into the folder, ``fsync``;
- ``blocked``: ``cluster.checkpoint`` (the put into the node's store), and ``complete``: until ``ck.wait()``;
- ``restore_store``: every key of its own from its node's store (views), per object;
- ``restore_partner``: node 0's ranks read their keys after node 0 lost its copies: from the partner node;
  against ``raw_mpi``: the same bytes with ``Send``/``Recv`` between the same nodes;
- ``restore_folder``: after every store lost its copies, from the folder.

Medians over ``--repeats``; ratios printed by rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import mpi4py

mpi4py.rc.thread_level = "multiple"
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shmstore.checkpoint import bundle_key  # noqa: E402
from shmstore.mpi import Cluster  # noqa: E402

MiB = 1 << 20


def _slowest(comm: MPI.Comm, t0: float) -> float:
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def _save(path: str, sd: dict) -> None:
    try:
        import torch
        torch.save({k: torch.from_numpy(v) for k, v in sd.items()}, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    except ImportError:
        with open(path, "wb") as f:
            pickle.dump(sd, f, protocol=5)
            f.flush()
            os.fsync(f.fileno())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="state per rank")
    ap.add_argument("--arrays", type=int, default=250)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    base = world.bcast(tempfile.mkdtemp(prefix="bench-ckm-", dir=args.dir) if world.rank == 0 else None)
    name = world.bcast("bm" + uuid.uuid4().hex[:8] if world.rank == 0 else None)
    n = args.mib * MiB // args.arrays // 4
    rows: dict[str, list[float]] = {}
    with Cluster(name=name, capacity=f"{args.mib * 12}MiB", prefault=f"{args.mib * 6}MiB",
                 persist_dir=os.path.join(base, "persist"), checkpoint_keep=1) as c:
        comm, rank = c.comm, c.comm.rank
        sd = {f"r{rank}.l{i}": np.random.default_rng(rank * 1000 + i).standard_normal(n).astype(np.float32)
              for i in range(args.arrays)}
        nbytes = sum(a.nbytes for a in sd.values())
        warm = {k: np.empty_like(v) for k, v in sd.items()}
        c.store.wait_prefaulted(args.mib * 6 * MiB, 120)
        c.checkpoint("warmup", {f"w{rank}": np.zeros(1)}).wait(120)
        peer = len(c.nodes) > 1
        for rep in range(args.repeats):
            for k in sd:
                np.copyto(warm[k], sd[k])
            comm.Barrier()
            t = time.perf_counter()
            for k in sd:
                np.copyto(warm[k], sd[k])
            rows.setdefault("copyto", []).append(_slowest(comm, t))
            comm.Barrier()
            t = time.perf_counter()
            _save(os.path.join(base, f"save-{rank}.pt"), sd)
            rows.setdefault("save", []).append(_slowest(comm, t))
            comm.Barrier()
            t = time.perf_counter()
            ck = c.checkpoint(f"b{rep}", sd)
            rows.setdefault("blocked", []).append(_slowest(comm, t))
            ck.wait(600)
            rows.setdefault("complete", []).append(_slowest(comm, t))
            got = c.restore(f"b{rep}")
            t = time.perf_counter()
            for k in sd:
                got[k]
            rows.setdefault("restore_store_per_object", []).append(_slowest(comm, t) / len(sd))
            del got
            if peer:  # node 0 loses its copies; its ranks read theirs from the partner (node 1)
                comm.Barrier()
                if c.node_index == 0 and c.leaders[0] == rank:
                    mine = [bundle_key(ck.id, f"r{r}") for r in range(comm.size)]
                    c.store.delete_many(mine, missing_ok=True)
                comm.Barrier()
                got = c.restore(f"b{rep}")
                comm.Barrier()
                t = time.perf_counter()
                if c.node_index == 0:
                    for k in sd:
                        got[k]
                took = time.perf_counter() - t
                rows.setdefault("restore_partner", []).append(comm.allreduce(took if c.node_index == 0 else 0.0,
                                                                             op=MPI.MAX))
                del got
                # raw: the same bytes, node 1's ranks each sending one rank of node 0 its share, all at once
                nodes = comm.allgather(c.node_index)
                pairs = list(zip([r for r in range(comm.size) if nodes[r] == 1],
                                 [r for r in range(comm.size) if nodes[r] == 0]))
                buf = np.empty(nbytes, np.uint8)
                comm.Barrier()
                t = time.perf_counter()
                for src, dst in pairs:
                    if rank == src:
                        comm.Send(buf, dest=dst, tag=7)
                    elif rank == dst:
                        comm.Recv(buf, source=src, tag=7)
                rows.setdefault("raw_mpi", []).append(_slowest(comm, t))
        comm.Barrier()
    med = {k: statistics.median(v) for k, v in rows.items()}
    out = {"ranks": world.size, "bytes_per_rank": nbytes, "median_s": med,
           "blocked_vs_copyto": med["blocked"] / med["copyto"], "save_vs_blocked": med["save"] / med["blocked"],
           "flush_GBps_per_node": nbytes * world.size / max(1, len(set(MPI.COMM_WORLD.allgather(
               os.environ.get("PMI_HOSTNAME", ""))))) / (med["complete"] - med["blocked"]) / 1e9,
           "restore_store_us_per_object": med["restore_store_per_object"] * 1e6}
    if "restore_partner" in med:
        out["restore_partner_vs_raw_mpi"] = med["restore_partner"] / med["raw_mpi"]
    if world.rank == 0:
        print(json.dumps(out, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
