#!/usr/bin/env python3
"""Multi-node demo: a model put on one node, fetched by every rank, migrated.

    mpiexec -launcher fork -hosts n0:2,n1:2 -genv MPIR_CVAR_CH4_NUM_VCIS 4 -n 4 python -m mpi4py scripts/demo.py

(two emulated nodes on one machine; under Slurm: ``srun python -m mpi4py
scripts/demo.py``). Rank 0 puts a state dict into its node's store; every rank
then gets it: ranks on rank 0's node read it in place, every other node
receives exactly one copy however many of its ranks ask, and all ranks read
zero-copy views. Each rank reduces its shard of the layers and the results
are checked; finally the model is migrated to the last node. Rank 0 prints
what moved and how fast, beside raw MPI ``Send``/``Recv`` of the same bytes
between the same nodes measured in the same run: the first fetch against raw
MPI into a fresh buffer (both fault their pages in), and a second fetch of
the model put again (the receiving node's memory now warm) against raw MPI
into a warm buffer; and how long after the transfer's end the ranks that
joined it returned.
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
        raw = raw_mpi(cluster, model if rank == 0 else None, info.size if rank == 0 else 0)
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
        if rank != 0:
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
                times = sorted(r[1] for r in rows if r[0] == node)
                rate = row[3] / times[-1] / 1e9 if row[3] else 0.0
                say(f"node {node!r}: received {format_size(row[3])} in {row[4]} transfer(s)"
                    + (f" at {rate:.2f} GB/s" if row[3] else " (it had the model)")
                    + f", {row[5]} request(s) joined a transfer in flight"
                    + (f" (returned within {1e3 * (times[-1] - times[0]):.1f} ms of the first rank)"
                       if row[3] and len(times) > 1 else ""))
                if row[3] and raw:
                    say(f"  raw MPI Send/Recv of the same bytes between the same nodes, this run: "
                        f"{raw[0]:.2f} GB/s into a fresh buffer: the first fetch ran at {rate / raw[0]:.2f}x")
            say(f"partial sums of all {len(merged)} layers checked: {'ok' if ok else 'WRONG'}")
        comm.Barrier()
        if raw:  # again, the receiving node's memory warm now: the model put anew, fetched again
            if rank == 0:
                cluster.delete("model")
                cluster.put("model", model)
                del model
            comm.Barrier()
            t = time.perf_counter()
            model = cluster.get("model")
            got_s = time.perf_counter() - t
            del model
            rows = comm.gather((cluster.node, got_s), root=0)
            if rank == 0:
                last = max(r[1] for r in rows if r[0] == cluster.nodes[-1])
                rate = info.size / last / 1e9
                say(f"second fetch into node {cluster.nodes[-1]!r} (its memory warm): {rate:.2f} GB/s; raw MPI into a "
                    f"warm buffer, this run: {raw[1]:.2f} GB/s: {rate / raw[1]:.2f}x")
        elif rank == 0:
            del model
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


def raw_mpi(cluster: Cluster, model: dict[str, np.ndarray] | None, nbytes: int) -> tuple[float, float] | None:
    """(GB/s into a fresh buffer, GB/s into a warm one, median of 3) of raw MPI Send/Recv of the model's bytes
    from rank 0 to the first rank of the last node, on every rank; None on one node."""
    comm = cluster.comm
    if len(cluster.nodes) < 2:
        return None
    nbytes = comm.bcast(nbytes)
    peer = cluster.leaders[-1]
    flat = np.concatenate([a.reshape(-1).view(np.uint8) for a in model.values()]) if model is not None else None
    small = np.zeros(1 << 20, np.uint8)  # the pair's first large message (connection set-up) is not measured
    if comm.rank == 0:
        comm.Send(small, dest=peer)
    elif comm.rank == peer:
        comm.Recv(small, source=0)
    buf = np.empty(nbytes, np.uint8) if comm.rank == peer else None  # fresh pages: faulted in by the receive
    rates = []
    for _ in range(4):
        comm.Barrier()
        t = time.perf_counter()
        if comm.rank == 0:
            comm.Send(flat, dest=peer)
        elif comm.rank == peer:
            comm.Recv(buf, source=0)
        rates.append(nbytes / (time.perf_counter() - t) / 1e9)
    got = comm.bcast((rates[0], sorted(rates[1:])[1]) if comm.rank == peer else None, root=peer)
    comm.Barrier()
    return got


if __name__ == "__main__":
    main()
