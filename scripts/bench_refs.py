#!/usr/bin/env python3
"""One large array handed to many tasks: by value (each executor's default) against a shmstore Ref.

Measured in one run, side by side: a 256 MiB float64 array handed to 64 tasks (each sums its 1/64th) through

- ``concurrent.futures.ProcessPoolExecutor`` and ``multiprocessing.Pool`` (pickled into every task);
- joblib (loky; by value its default memory-maps arrays over 1 MB into a temp folder, once per call);
- Dask's local ``processes`` scheduler (the array inside every task's arguments);
- Ray's tasks on a local Ray, where Ray is installed (by value Ray puts the array into its object store at
  every ``.remote`` call), and beside our Ref, Ray's own ``ray.put`` ObjectRef (the peer system's refs);
- ``mpi4py.futures.MPIPoolExecutor`` on one node and on two emulated nodes (the script starts
  ``python -m mpi4py.futures`` on itself for each, 4 ranks, 3 workers, with the ``mpiexec`` first on PATH:
  MPICH's fake hosts, or one application context per node under Open MPI and Intel MPI, see
  ``tests/launchers.py``), where mpiexec is available; by reference through the pool's Cluster
  (``shmstore.mpi.pool``), which moves the array into the other node once (the counters are printed).

By reference: ``store.share(array)`` (one put), the Ref to every task (``ref.get()``: a zero-copy view),
``ref.delete()``, all inside the timed span. Pools are started and warmed before timing; each figure is
the median of ``--repeats``. Ratios are by-value time / by-reference time: above 1, the Ref is faster.
Executors that are not installed are skipped with a note.

Usage: python scripts/bench_refs.py [--quick] [--mib 256] [--tasks 64] [--workers N] [--repeats 3]
       [--no-mpi | --no-local] [--json out.json]
``--quick``: a smoke run (16 MiB, 16 tasks, 1 repeat).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import shmstore  # noqa: E402
from shmstore.refs import Ref  # noqa: E402


def part_sum(x: Any, i: int, n: int) -> float:
    """A task: the sum of its share of the array (handed by value, or as a Ref)."""
    a = x.get() if isinstance(x, Ref) else x
    chunk = len(a) // n
    return float(a[i * chunk:(i + 1) * chunk].sum())


def _median(fn: Callable[[], list[float]], repeats: int, want: list[float]) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        got = fn()
        times.append(time.perf_counter() - t)
        if not np.allclose(got, want):
            raise SystemExit(f"wrong results: {got[:3]} ... against {want[:3]} ...")
    return statistics.median(times)


def _by_ref(store: Any, data: np.ndarray, run: Callable[[Any], list[float]]) -> Callable[[], list[float]]:
    def go() -> list[float]:
        ref = store.share(data)
        try:
            return run(ref)
        finally:
            ref.delete()
    return go


def bench_local(args: argparse.Namespace, data: np.ndarray, want: list[float]) -> list[dict[str, Any]]:
    n, w, rows = args.tasks, args.workers, []
    with shmstore.connect("bench-refs-" + uuid.uuid4().hex[:8], capacity=max(64 << 20, 2 * data.nbytes + (64 << 20)),
                          prefault=0) as store:
        def row(executor: str, run: Callable[[Any], list[float]]) -> None:
            run(np.zeros(n))  # warm: workers started, modules imported
            warm = store.share(np.zeros(n))
            run(warm)
            warm.delete()
            value = _median(lambda: run(data), args.repeats, want)
            ref = _median(_by_ref(store, data, run), args.repeats, want)
            rows.append({"executor": executor, "nodes": 1, "by_value_s": value, "by_ref_s": ref})
            print(f"  {executor:<30} done: by value {value:.3f}s, by Ref {ref:.3f}s ({value / ref:.1f}x)",
                  file=sys.stderr, flush=True)

        with cf.ProcessPoolExecutor(w) as ex:
            row("ProcessPoolExecutor", lambda x: list(ex.map(part_sum, [x] * n, range(n), [n] * n)))
        with mp.get_context("fork").Pool(w) as pool:
            row("multiprocessing.Pool", lambda x: pool.starmap(part_sum, [(x, i, n) for i in range(n)]))
        _joblib(row, n, w, rows)
        _dask(row, n, w, rows)
        _ray(row, n, w, rows, data, args, want)
    return rows


def _joblib(row: Callable[..., None], n: int, w: int, rows: list[dict[str, Any]]) -> None:
    try:
        import joblib
        from joblib.externals.loky import get_reusable_executor
    except ImportError:
        rows.append({"executor": "joblib", "skipped": "not installed (pip install joblib)"})
        return
    parallel = joblib.Parallel(n_jobs=w, backend="loky")
    row("joblib (loky)", lambda x: parallel(joblib.delayed(part_sum)(x, i, n) for i in range(n)))
    get_reusable_executor().shutdown(wait=True)


def _dask(row: Callable[..., None], n: int, w: int, rows: list[dict[str, Any]]) -> None:
    try:
        import dask
    except ImportError:
        rows.append({"executor": "dask", "skipped": "not installed (pip install dask)"})
        return
    with cf.ProcessPoolExecutor(w, mp_context=mp.get_context("spawn")) as pool:
        row("dask (processes)", lambda x: list(dask.compute(*[dask.delayed(part_sum)(x, i, n) for i in range(n)],
                                                            scheduler="processes", pool=pool)))


def _ray(row: Callable[..., None], n: int, w: int, rows: list[dict[str, Any]], data: np.ndarray,
         args: argparse.Namespace, want: list[float]) -> None:
    """Ray's tasks (a local Ray of ``w`` CPUs): by value (Ray puts the array into its object store at every
    ``.remote`` call), by our Ref, and by Ray's own ``ray.put`` ObjectRef (the peer system's answer, its
    object freed when the ref is dropped; Ray hands the task a zero-copy read-only view of its store)."""
    try:
        import ray
    except ImportError:
        rows.append({"executor": "Ray tasks", "skipped": "not installed (pip install ray)"})
        return
    ray.init(num_cpus=w, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        remote = ray.remote(part_sum)

        def run(x: Any) -> list[float]:
            return list(ray.get([remote.remote(x, i, n) for i in range(n)]))

        row("Ray tasks", run)

        def by_ray_ref() -> list[float]:
            ref = ray.put(data)
            try:
                return run(ref)
            finally:
                del ref
        by_ray_ref()  # warm, as row() warms its runs
        rows[-1]["by_ray_ref_s"] = _median(by_ray_ref, args.repeats, want)
        print(f"  {'Ray tasks':<30} done: by Ray's own ObjectRef {rows[-1]['by_ray_ref_s']:.3f}s",
              file=sys.stderr, flush=True)
    finally:
        ray.shutdown()


# ---- MPIPoolExecutor: run by mpiexec on this script -------------------------------------------------------
def bench_mpi_child(args: argparse.Namespace, data: np.ndarray, want: list[float]) -> None:
    """Rank 0 under ``python -m mpi4py.futures``: time the pool by value and by Ref; print one JSON line."""
    from mpi4py.futures import MPIPoolExecutor

    from shmstore.mpi import pool as mpipool

    n = args.tasks
    kw = {"name": "bench-refs-" + uuid.uuid4().hex[:8], "capacity": max(64 << 20, 2 * data.nbytes + (64 << 20)),
          "prefault": 0}
    with MPIPoolExecutor(**mpipool.worker_setup(**kw)) as ex:
        cluster = mpipool.open_cluster(ex, **kw)

        def run(x: Any) -> list[float]:
            return list(ex.map(part_sum, [x] * n, range(n), [n] * n))
        run(np.zeros(n))
        warm = cluster.share(np.zeros(n))
        run(warm)
        warm.delete()
        value = _median(lambda: run(data), args.repeats, want)
        before = dict(ex.map(_node_stats, range(8)))
        ref = _median(_by_ref(cluster, data, run), args.repeats, want)
        after = dict(ex.map(_node_stats, range(8)))
        stats = {node: {k: after[node][k] - before[node][k] for k in after[node]} for node in after if node in before}
        print("MPIRESULT " + json.dumps({"executor": "MPIPoolExecutor", "nodes": len(cluster.nodes),
                                         "by_value_s": value, "by_ref_s": ref, "stats": stats}), flush=True)


def _node_stats(_: int) -> tuple[str, dict[str, int]]:
    from shmstore.mpi import pool as mpipool
    time.sleep(0.1)
    cluster = mpipool.join({})
    return cluster.node, cluster.stats()


def bench_mpi(args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from launchers import on_path  # the launch line of whichever MPI is on PATH
    mpi = on_path()
    if mpi is None or args.no_mpi:
        return [{"executor": "MPIPoolExecutor", "skipped": "no mpiexec (pip install 'shmstore[mpich]')"
                 if mpi is None else "--no-mpi"}]
    rows = []
    for hosts in ("n0:4", "n0:2,n1:2"):
        cmd = mpi.command(hosts, ["-m", "mpi4py.futures", os.path.abspath(__file__), "--mpi-child", "--mib",
                                  str(args.mib), "--tasks", str(args.tasks), "--repeats", str(args.repeats)])
        env = mpi.environ(dict(os.environ, MPIEXEC_TIMEOUT=os.environ.get("MPIEXEC_TIMEOUT", "900")))
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("MPIRESULT ")]
        if r.returncode != 0 or not lines:
            rows.append({"executor": "MPIPoolExecutor", "skipped": f"job on {hosts} failed: "
                         f"{(r.stdout + r.stderr)[-400:]}"})
            continue
        row = json.loads(lines[0][len("MPIRESULT "):])
        rows.append(row)
        print(f"  MPIPoolExecutor on {hosts:<17} done: {row}", file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{args.mib} MiB float64 array to {args.tasks} tasks, {args.workers} local workers (3 MPI workers), "
          f"median of {args.repeats}{' (quick: smoke figures)' if args.quick else ''}")
    print(f"{'executor':<22} {'nodes':>5} {'by value':>10} {'by Ref':>10} {'value/Ref':>10}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['executor']:<22} skipped: {r['skipped']}")
            continue
        print(f"{r['executor']:<22} {r['nodes']:>5} {r['by_value_s']:>9.3f}s {r['by_ref_s']:>9.3f}s "
              f"{r['by_value_s'] / r['by_ref_s']:>9.1f}x")
        if r.get("by_ray_ref_s"):
            print(f"{'':<22} (by Ray's own ray.put ObjectRef: {r['by_ray_ref_s']:.3f}s, "
                  f"{r['by_ray_ref_s'] / r['by_ref_s']:.1f}x the time by our Ref)")
        if r.get("stats"):
            moved = ", ".join(f"{node}: {s['transfers']}" for node, s in sorted(r["stats"].items()))
            print(f"{'':<22} (transfers into each node over the {args.repeats} Ref round(s): {moved})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 MiB, 16 tasks, 1 repeat")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-mpi", action="store_true", help="skip the MPIPoolExecutor runs")
    ap.add_argument("--no-local", action="store_true", help="skip the local executors (run only MPIPoolExecutor)")
    ap.add_argument("--mpi-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.tasks, args.repeats = 16, 16, 1
    data = np.random.default_rng(3).standard_normal((args.mib << 20) // 8)
    chunk = len(data) // args.tasks
    want = [float(data[i * chunk:(i + 1) * chunk].sum()) for i in range(args.tasks)]
    if args.mpi_child:
        bench_mpi_child(args, data, want)
        return
    rows = ([] if args.no_local else bench_local(args, data, want)) + bench_mpi(args)
    report(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
