#!/usr/bin/env python3
"""Single-node scaling demo: processes share one model through a shmstore.

The parent puts a state dict (a "model") into this node's store, then for
1, 2, 4 ... worker processes: every worker gets the whole model zero-copy,
reduces its shard of the layers, and puts its partial result back; the
parent gathers and checks them. It prints how long each phase took, how the
work scaled, and that the model was stored once however many readers it had.

Usage: python scripts/demo_local.py [--mib 256] [--layers 200] [--max-procs N]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmstore  # noqa: E402
from shmstore.units import format_size  # noqa: E402

WORKER = r"""
import sys, time, numpy as np
sys.path.insert(0, sys.argv[1])
import shmstore
rank, nprocs, run = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with shmstore.connect(session=run) as store:
    t0 = time.perf_counter()
    model = store.get("model")                     # zero-copy views, no matter how big
    t1 = time.perf_counter()
    names = sorted(model)[rank::nprocs]
    partial = {n: float(model[n].sum(dtype=np.float64)) for n in names}
    store.put(f"partial/{rank}", partial)
    print(f"{t1 - t0:.6f} {time.perf_counter() - t1:.6f}", flush=True)
"""


def run_round(root: str, nprocs: int, run: str) -> tuple[float, float, float]:
    """(wall seconds, slowest get, slowest compute) for ``nprocs`` workers."""
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, root, str(r), str(nprocs), run],
                              stdout=subprocess.PIPE, text=True) for r in range(nprocs)]
    outs = [p.communicate(timeout=600)[0].split() for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    wall = time.perf_counter() - t
    return wall, max(float(o[0]) for o in outs), max(float(o[1]) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="model size (default 256 MiB)")
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--max-procs", type=int, default=max(2, min(8, os.cpu_count() or 2)))
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    per = args.mib * (1 << 20) // args.layers // 4
    rng = np.random.default_rng(0)
    model = {f"layer{i:04d}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(args.layers)}
    expect = {n: float(a.sum(dtype=np.float64)) for n, a in model.items()}
    run = f"demo{os.getpid()}"
    with shmstore.connect(session=run) as store:
        print(f"store {store.name!r} on node {store.node!r}, spill process {store.spill_pid}")
        t = time.perf_counter()
        info = store.put("model", model)
        dt = time.perf_counter() - t
        print(f"put model: {args.layers} arrays, {format_size(info.size)} in {dt * 1e3:.1f} ms "
              f"({info.size / dt / 1e9:.2f} GB/s)")
        print(f"{'procs':>5} {'wall s':>8} {'get ms':>8} {'compute s':>10} {'speedup':>8} {'memory used':>12}")
        base = None
        nprocs = 1
        while nprocs <= args.max_procs:
            wall, get_s, comp_s = run_round(root, nprocs, run)
            got = {}
            for r in range(nprocs):
                got.update(store.get(f"partial/{r}"))
                store.delete(f"partial/{r}")
            assert got.keys() == expect.keys() and all(abs(got[k] - expect[k]) < 1e-3 * (1 + abs(expect[k]))
                                                       for k in got), "wrong partial sums"
            base = base or comp_s
            used = store.get_capacity()[shmstore.Level.MEMORY].used
            print(f"{nprocs:>5} {wall:>8.2f} {get_s * 1e3:>8.2f} {comp_s:>10.3f} {base / comp_s:>7.2f}x "
                  f"{format_size(used):>12}")
            nprocs *= 2
        store.clear()
    print("every worker read the same shared copy; results checked; store removed when the last process left")


if __name__ == "__main__":
    main()
