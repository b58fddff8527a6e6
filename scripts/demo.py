#!/usr/bin/env python3
"""Multi-node demo: a model put on one node, fetched by every rank, migrated.

    mpiexec -launcher fork -hosts n0:2,n1:2 -genv MPIR_CVAR_CH4_NUM_VCIS 4 -n 4 python -m mpi4py scripts/demo.py

(two emulated nodes on one machine; under Slurm: ``srun python -m mpi4py
scripts/demo.py``). Rank 0 puts a state dict into its node's store; every rank
then gets it: ranks on rank 0's node read it in place, every other node
receives exactly one copy however many of its ranks ask, and all ranks read
zero-copy views. Each rank reduces its shard of the layers and the results
are checked; finally the model is migrated to the last node. Rank 0 prints
what moved and how fast.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shmstore.mpi import Cluster  # noqa: E402
from shmstore.units import format_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="model size (default 128 MiB)")
    ap.add_argument("--layers", type=int, default=200)
    args = ap.parse_args()
    with Cluster() as cluster:
        comm, rank = cluster.comm, cluster.rank
        say = print if rank == 0 else (lambda *a, **k: None)
        say(f"{cluster.size} ranks on {len(cluster.nodes)} node(s) {cluster.nodes}; store {cluster.store.name!r}")
        per = args.mib * (1 << 20) // args.layers // 4
        if rank == 0:
            rng = np.random.default_rng(0)
            model = {f"layer{i:04d}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(args.layers)}
            t = time.perf_counter()
            info = cluster.put("model", model)
            say(f"put the model on node {cluster.node!r}: {args.layers} arrays, {format_size(info.size)} "
                f"in {1e3 * (time.perf_counter() - t):.1f} ms")
            expect = {n: float(a.sum(dtype=np.float64)) for n, a in model.items()}
            del model
        comm.Barrier()
        before = cluster.stats()
        comm.Barrier()
        t = time.perf_counter()
        model = cluster.get("model")  # local hit, or one transfer into this node
        got_s = time.perf_counter() - t
        comm.Barrier()
        after = cluster.stats()
        names = sorted(model)[rank::cluster.size]
        t = time.perf_counter()
        partial = {n: float(model[n].sum(dtype=np.float64)) for n in names}
        comp_s = time.perf_counter() - t
        del model
        rows = comm.gather((cluster.node, got_s, comp_s, after["bytes_received"] - before["bytes_received"],
                            after["transfers"] - before["transfers"], after["migrations_deduplicated"]
                            - before["migrations_deduplicated"], partial), root=0)
        if rank == 0:
            merged = {k: v for row in rows for k, v in row[6].items()}
            ok = merged.keys() == expect.keys() and all(abs(merged[k] - expect[k]) < 1e-3 * (1 + abs(expect[k]))
                                                        for k in merged)
            say(f"{'rank':>4} {'node':>6} {'get ms':>8} {'reduce ms':>10}")
            for r, row in enumerate(rows):
                say(f"{r:>4} {row[0]:>6} {row[1] * 1e3:>8.1f} {row[2] * 1e3:>10.1f}")
            seen = {}
            for row in rows:
                seen.setdefault(row[0], row)
            for node, row in seen.items():
                rate = row[3] / max(r[1] for r in rows if r[0] == node) / 1e9 if row[3] else 0.0
                say(f"node {node!r}: received {format_size(row[3])} in {row[4]} transfer(s)"
                    + (f" at {rate:.2f} GB/s" if row[3] else " (it had the model)")
                    + f", {row[5]} request(s) joined a transfer in flight")
            say(f"partial sums of all {len(merged)} layers checked: {'ok' if ok else 'WRONG'}")
        comm.Barrier()
        if rank == 0 and len(cluster.nodes) > 1:
            dest = cluster.nodes[-1]
            t = time.perf_counter()
            cluster.migrate("model", dest)
            say(f"migrated the model to node {dest!r} in {1e3 * (time.perf_counter() - t):.1f} ms "
                f"(already there: no bytes moved); copies now on {cluster.locate('model')}")
        comm.Barrier()
        if rank == 0:
            cluster.delete("model")
        comm.Barrier()
    say("done; every store is removed when its last rank leaves")


if __name__ == "__main__":
    main()
