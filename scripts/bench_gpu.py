#!/usr/bin/env python3
"""GPU level benchmark, side by side with raw CuPy and raw mpi4py in the same run (needs CuPy and a device).

    python scripts/bench_gpu.py [--mib 256] [--repeats 5]
    mpiexec -launcher fork -hosts n0:1,n1:1 -n 2 python -m mpi4py scripts/bench_gpu.py --mpi

Single process: a device put onto the GPU level against one device-to-device
``cupy`` copy of the same bytes (the put is that copy plus bookkeeping), a
get's latency (a view: no copy), and a get from a second process through
CUDA IPC. Under MPI (two ranks on two emulated nodes): a fetch of a device
object into the other node's GPU level against a raw mpi4py ``Send``/``Recv``
of the same buffer (the device buffer itself where MPI is CUDA-aware,
staged through the host otherwise: said in the output). Medians over repeats.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmstore  # noqa: E402
from shmstore import Level  # noqa: E402
from shmstore.levels.device import cupy_or_reason  # noqa: E402

MiB = 1 << 20


def _sync(cp) -> None:
    cp.cuda.get_current_stream().synchronize()


def single(args: argparse.Namespace, cp) -> None:
    n = args.mib * MiB
    src = cp.random.randint(0, 255, n, dtype=cp.uint8)
    dst = cp.empty_like(src)
    name = args.name or "bgpu" + uuid.uuid4().hex[:8]
    with shmstore.connect(name, capacity="1GiB", gpu_capacity=f"{2 * args.mib + 64}MiB") as store:
        store.put("warm", src, levels=[Level.GPU])
        store.delete("warm")
        copies, puts, gets = [], [], []
        for _ in range(args.repeats):
            _sync(cp)
            t = time.perf_counter()
            dst[...] = src
            _sync(cp)
            copies.append(time.perf_counter() - t)
            t = time.perf_counter()
            store.put("x", src, levels=[Level.GPU])
            puts.append(time.perf_counter() - t)
            t = time.perf_counter()
            view = store.get("x")
            gets.append(time.perf_counter() - t)
            assert view.data.ptr != src.data.ptr and int(view[-1]) == int(src[-1])
            del view
            store.delete("x")
        store.put("x", src, levels=[Level.GPU])
        child = subprocess.run([sys.executable, "-c", f"""
import time, shmstore
s = shmstore.connect({name!r})
s.get('x')  # opens the IPC handle once
ts = []
for _ in range(20):
    t = time.perf_counter(); v = s.get('x'); ts.append(time.perf_counter() - t); del v
ts.sort(); print(ts[len(ts) // 2]); s.close()
"""], capture_output=True, text=True, timeout=120)
        ipc = float(child.stdout.strip()) if child.returncode == 0 else float("nan")
    c, p = statistics.median(copies), statistics.median(puts)
    print(f"device put {args.mib} MiB: {p * 1e3:.2f} ms; cupy copy {c * 1e3:.2f} ms; put/copy {p / c:.2f}x "
          f"({n / p / 1e9:.1f} GB/s)")
    print(f"device get (zero-copy view): {statistics.median(gets) * 1e6:.0f} us; "
          f"from a second process (CUDA IPC): {ipc * 1e6:.0f} us")


def over_mpi(args: argparse.Namespace, cp) -> None:
    from mpi4py import MPI

    from shmstore.mpi import Cluster
    from shmstore.mpi.cuda import cuda_aware
    comm = MPI.COMM_WORLD
    n = args.mib * MiB
    buf = cp.arange(n, dtype=cp.uint8) if comm.rank == 0 else cp.empty(n, cp.uint8)
    aware = cuda_aware()
    raw = []
    for _ in range(args.repeats):
        comm.Barrier()
        t = time.perf_counter()
        if comm.rank == 0:
            comm.Send([buf, MPI.BYTE] if aware else [cp.asnumpy(buf), MPI.BYTE], dest=1)
        else:
            if aware:
                comm.Recv([buf, MPI.BYTE], source=0)
            else:
                host = cp.cuda.alloc_pinned_memory(n)
                import numpy as np
                h = np.frombuffer(host, np.uint8, n)
                comm.Recv([h, MPI.BYTE], source=0)
                buf.set(h)
            _sync(cp)
        raw.append(time.perf_counter() - t)
    with Cluster(name=args.name or "bgpum", capacity="1GiB", gpu_capacity=f"{2 * args.mib + 64}MiB") as cluster:
        if comm.rank == 0:
            cluster.put("x", buf, levels=[Level.GPU])
        cluster.barrier()
        fetches = []
        for _ in range(args.repeats):
            cluster.barrier()
            if comm.rank == 1:
                t = time.perf_counter()
                cluster.fetch("x", levels=[Level.GPU])
                fetches.append(time.perf_counter() - t)
                assert cluster.store.get_info("x").level == Level.GPU
                cluster.store.delete("x")
            cluster.barrier()
    if comm.rank == 1:
        r, f = statistics.median(raw), statistics.median(fetches)
        how = "device buffers (CUDA-aware MPI)" if aware else "staged through host memory (MPI not CUDA-aware)"
        print(f"device fetch {args.mib} MiB between nodes: {f * 1e3:.1f} ms; raw mpi4py Send/Recv {r * 1e3:.1f} ms "
              f"[{how}]; fetch/raw {f / r:.2f}x ({n / f / 1e9:.2f} GB/s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mpi", action="store_true", help="the two-node fetch (run under mpiexec, 2 ranks)")
    ap.add_argument("--name", default="", help="the store's name (default: a new one; under --mpi 'bgpum')")
    args = ap.parse_args(argv)
    cp, why = cupy_or_reason()
    if cp is None:
        print(f"bench_gpu: no GPU level here: {why}")
        return 0
    if args.mpi:
        over_mpi(args, cp)
    else:
        single(args, cp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
