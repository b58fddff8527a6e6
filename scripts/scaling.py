#!/usr/bin/env python3
"""The scaling suite: sweep nodes, ranks per node and object sizes; one CSV row per measurement; PNG plots.

    python scripts/scaling.py --quick                 # emulated nodes on this machine, under 2 minutes here
    python scripts/scaling.py --nodes 1,2,4 --ranks 1,2,4 --sizes 1,16,256 --out results/
    sbatch mpi/slurm/scaling.sbatch                   # real nodes: srun inside the allocation

Each run is one MPI job (``scripts/scaling_job.py``) over NODES nodes with
RANKS ranks each: emulated nodes on this machine (the ``mpiexec`` first on
PATH: MPICH's hydra with fake host names, ``-launcher fork``; Open MPI and
Intel MPI one application context per node, each naming its node in
``SHMSTORE_NODE``: ``tests/launchers.py``), or real ones inside a Slurm
allocation (``srun --mpi=pmi2 -N NODES --ntasks-per-node RANKS``; nodes
beyond the allocation are skipped). Every row of ``scaling.csv`` carries
the raw baseline measured in the same job (``np.copyto``, MPI
``Send``/``Recv``, an 8 B round trip, ``MPI_Bcast``, a file write, or ideal
scaling) and the ratio to it. With matplotlib (``pip install
'shmstore[plots]'``) it draws ``throughput_vs_ranks.png``,
``bandwidth_vs_size.png``, ``latency_vs_nodes.png``,
``messages_vs_nodes.png`` and ``broadcast_vs_nodes.png``: a marker at every
point, baselines dashed with open markers, one series per ranks-per-node
count. Each baseline is the median of repeats taken in turns with the
measured operation (see ``scaling_job.py``). Results go to ``--out``, else
``$SCALING_OUT``, else ``~/shmstore-scaling/<date-time>``; the suite runs from
any directory.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ["workload", "nodes", "node_names", "ranks_per_node", "size", "value", "unit", "baseline",
          "baseline_value", "ratio_to_baseline", "repeats"]
MARKERS = "os^vD<>p"  # one per ranks-per-node series


def _mpi() -> Any:
    """The launcher of the MPI whose mpiexec is first on PATH (``tests/launchers.py``), or None."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from launchers import on_path
    return on_path()


def launcher(nodes: int, rpn: int, args: list[str]) -> list[str] | None:
    """The command that starts ``nodes`` x ``rpn`` ranks of the job with ``args``, or None where that many nodes
    are not at hand. (The arguments go inside: under MPMD every application context repeats them.)"""
    py = [sys.executable, "-m", "mpi4py", os.path.join(ROOT, "scripts", "scaling_job.py"), *args]
    allocated = int(os.environ.get("SLURM_NNODES", "0") or 0)
    if allocated > 1 and shutil.which("srun"):
        if nodes > allocated:
            return None
        # the launch of mpi/slurm/launch.sh (job.sbatch's), its environment (VCIs, spill directory) inherited
        return ["srun", "--mpi=pmi2", "-K", "-N", str(nodes), "-n", str(nodes * rpn), "--ntasks-per-node",
                str(rpn), "--overcommit", *py]
    mpi = _mpi()
    if mpi is None:
        raise SystemExit("scaling: no mpiexec (pip install 'shmstore[mpich]') and no Slurm allocation")
    return mpi.command(",".join(f"n{i}:{rpn}" for i in range(nodes)), py[1:])


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    combos = [(n, r) for n in args.nodes for r in args.ranks if n * r <= args.max_ranks]
    rows: list[dict[str, Any]] = []
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if _mpi() is not None and not (int(os.environ.get("SLURM_NNODES", "0") or 0) > 1 and shutil.which("srun")):
        env = _mpi().environ(env)  # (Open MPI as root needs its two variables)
    env.setdefault("MPIEXEC_TIMEOUT", str(args.timeout))
    start = time.monotonic()
    for i, (nodes, rpn) in enumerate(combos):
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as tmp:
            out = tmp.name
        cmd = launcher(nodes, rpn, ["--out", out, "--sizes", ",".join(map(str, args.sizes)), "--ops",
                                    str(args.ops), "--repeats", str(args.repeats)])
        label = f"[{i + 1}/{len(combos)}] {nodes} node(s) x {rpn} rank(s)"
        if cmd is None:
            os.unlink(out)
            print(f"scaling: {label}: skipped (the allocation has fewer nodes)", file=sys.stderr, flush=True)
            continue
        print(f"scaling: {label} ... ({time.monotonic() - start:.0f} s so far)", file=sys.stderr, flush=True)
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 30)
            if r.returncode != 0:
                raise SystemExit(f"scaling: {label} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
            with open(out) as f:
                got = [json.loads(line) for line in f if line.strip()]
        finally:
            os.unlink(out)
        rows += got
        print(f"scaling: {label}: {len(got)} measurement(s)", file=sys.stderr, flush=True)
    return rows


def write_csv(rows: list[dict[str, Any]], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in FIELDS})


def plot(rows: list[dict[str, Any]], outdir: str) -> list[str]:
    """Draw the plots (matplotlib, optional); returns the files written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("scaling: no matplotlib: CSV only (pip install 'shmstore[plots]' for the plots)", file=sys.stderr)
        return []
    written = []

    def pick(workload: str, **fixed: Any) -> list[dict[str, Any]]:
        return [r for r in rows if r["workload"] == workload and all(r[k] == v for k, v in fixed.items())]

    def figure(name: str, title: str, xlabel: str, ylabel: str, series: list[tuple[str, str, list, str, str]],
               logx: bool = False, logy: bool = False) -> None:
        """One PNG: every series with markers at its points (a series of one point is still seen), the
        baselines dashed; x ticks at the measured values only."""
        if not any(pts for _, _, pts, _, _ in series):
            return
        fig, ax = plt.subplots(figsize=(10, 4.8))
        xs_all: set[float] = set()
        for label, style, pts, color, marker in series:
            if pts:
                xs, ys = zip(*sorted(pts))
                xs_all.update(xs)
                ax.plot(xs, ys, style, label=label, color=color, marker=marker, markersize=6,
                        markerfacecolor="none" if style != "-" else color)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_xticks(sorted(xs_all))
        ax.set_xticklabels([f"{x:g}" for x in sorted(xs_all)])
        if len(xs_all) == 1:  # one measured x (2 nodes): a margin either side, not 1.900...2.100
            x = next(iter(xs_all))
            ax.set_xlim(x / 2, x * 2) if logx else ax.set_xlim(x - 1, x + 1)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot: hides no point
        fig.tight_layout()
        path = os.path.join(outdir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    rpns = sorted({r["ranks_per_node"] for r in rows})

    def per_rpn(label: str, workload: str, x: str, y: str, style: str, color: str, **fixed: Any) -> list:
        """One series per ranks-per-node count (a marker each)."""
        out = []
        for i, rpn in enumerate(rpns):
            pts = [(r[x] / 2**20 if x == "size" else r[x], r[y]) for r in pick(workload, ranks_per_node=rpn, **fixed)]
            if pts:
                out.append((f"{label} ({rpn}/node)" if len(rpns) > 1 else label, style, pts, color,
                            MARKERS[i % len(MARKERS)]))
        return out

    series = []
    for verb, color in (("put", "tab:blue"), ("get", "tab:orange")):
        pts = pick(f"local_{verb}_ops", nodes=1)
        series.append((f"{verb}s (64 B) on one node", "-", [(r["ranks_per_node"], r["value"]) for r in pts], color,
                       "o"))
        series.append((f"{verb}s: one rank x ranks (ideal)", "--",
                       [(r["ranks_per_node"], r["baseline_value"]) for r in pts], color, "s"))
    figure("throughput_vs_ranks.png", "Small-object throughput against ranks per node", "ranks per node",
           "operations per second (node)", series)

    two = min((r["nodes"] for r in rows if r["workload"] == "fetch_bw"), default=2)  # node 0 to node 1
    series = (per_rpn("local put", "local_put_bw", "size", "value", "-", "tab:blue", nodes=1)
              + per_rpn("np.copyto (baseline)", "local_put_bw", "size", "baseline_value", "--", "tab:blue", nodes=1)
              + per_rpn("local get + one pass over it", "local_get_bw", "size", "value", "-", "tab:purple", nodes=1)
              + per_rpn("pass over a private array (baseline)", "local_get_bw", "size", "baseline_value", "--",
                        "tab:purple", nodes=1)
              + per_rpn("fetch from another node", "fetch_bw", "size", "value", "-", "tab:orange", nodes=two)
              + per_rpn("many-blob migration", "migrate_blobs_bw", "size", "value", "-", "tab:green", nodes=two)
              + per_rpn("MPI Send/Recv (baseline)", "fetch_bw", "size", "baseline_value", "--", "tab:orange",
                        nodes=two)
              + per_rpn("spill to disk", "spill_bw", "size", "value", "-", "tab:red", nodes=1)
              + per_rpn("file write (baseline)", "spill_bw", "size", "baseline_value", "--", "tab:red", nodes=1))
    figure("bandwidth_vs_size.png", f"Bandwidth against object size (fetches: {two} nodes)", "object size (MiB)",
           "GiB/s", series, logx=True)

    series = (per_rpn("remote 64 B get", "remote_get_lat", "nodes", "value", "-", "tab:blue")
              + per_rpn("locate", "locate_lat", "nodes", "value", "-", "tab:green")
              + per_rpn("MPI 8 B round trip (baseline)", "remote_get_lat", "nodes", "baseline_value", "--", "black"))
    figure("latency_vs_nodes.png", "Lookup latency against node count", "nodes", "microseconds (log)", series,
           logy=True)

    series = (per_rpn("remote 64 B get", "remote_get_msgs", "nodes", "value", "-", "tab:blue")
              + per_rpn("get: bound for any node count", "remote_get_msgs", "nodes", "baseline_value", "--",
                        "tab:blue")
              + per_rpn("locate", "locate_msgs", "nodes", "value", "-", "tab:green")
              + per_rpn("locate: bound for any node count", "locate_msgs", "nodes", "baseline_value", "--",
                        "tab:green"))
    figure("messages_vs_nodes.png", "Messages per lookup against node count", "nodes",
           "messages (requests and replies)", series)

    size = max((r["size"] for r in rows if r["workload"] == "broadcast"), default=0)
    series = (per_rpn("every node gets one object", "broadcast", "nodes", "value", "-", "tab:blue", size=size)
              + per_rpn("MPI_Bcast (baseline)", "broadcast", "nodes", "baseline_value", "--", "black", size=size))
    figure("broadcast_vs_nodes.png", f"One {size / 2**20:g} MiB object to every node", "nodes", "seconds (log)",
           series, logy=True)
    return written


def _default_out() -> str:
    return os.path.join(os.path.expanduser("~"), "shmstore-scaling", time.strftime("%Y%m%d-%H%M%S"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small sweep (under two minutes on a laptop)")
    ap.add_argument("--nodes", help="node counts (default 1,2,4)")
    ap.add_argument("--ranks", help="ranks per node (default 1,2,4; --quick 1,2)")
    ap.add_argument("--sizes", help="object sizes in MiB (default 1,16,128; --quick 1,8,32)")
    ap.add_argument("--ops", type=int, help="small objects per rank (default 5000; --quick 3000)")
    ap.add_argument("--repeats", type=int, help="repeats of each measurement (median; default 3)")
    ap.add_argument("--max-ranks", type=int, default=16, help="skip runs with more ranks in all")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--out", default=os.environ.get("SCALING_OUT") or _default_out(),
                    help="directory for scaling.csv and the plots (default $SCALING_OUT, else "
                         "~/shmstore-scaling/<date-time>: never inside the checkout)")
    args = ap.parse_args(argv)
    defaults = {"nodes": "1,2,4", "ranks": "1,2" if args.quick else "1,2,4",
                "sizes": "1,8,32" if args.quick else "1,16,128", "ops": 3000 if args.quick else 5000, "repeats": 3}
    for key, value in defaults.items():  # what is given explicitly wins, also with --quick
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.max_ranks = min(args.max_ranks, 4)
    args.nodes = [int(x) for x in str(args.nodes).split(",")]
    args.ranks = [int(x) for x in str(args.ranks).split(",")]
    args.sizes = [float(x) for x in str(args.sizes).split(",")]
    os.makedirs(args.out, exist_ok=True)
    rows = run_all(args)
    path = os.path.join(args.out, "scaling.csv")
    write_csv(rows, path)
    plots = plot(rows, args.out)
    print(f"scaling: {len(rows)} rows in {path}" + (f"; plots: {', '.join(plots)}" if plots else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
