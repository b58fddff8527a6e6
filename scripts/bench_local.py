#!/usr/bin/env python3
"""Single-node benchmark of shmstore, side by side with its baselines.

Measured in one run, medians over repeats:

- small objects (20,000 numpy arrays of 64 bytes): put and get ops/s in one
  process and in two processes at once (and of the workers' whole
  put/get/delete pass, beside the same two workers each on a store of its
  own: what the machine allows this code), and a sweep of 1, 2, 4, 8 processes
  at once (where it flattens: at the core count); baseline: one
  ``multiprocessing.shared_memory`` segment per object plus a
  ``multiprocessing.Manager().dict()`` registry;
- a 1 GiB array: put bandwidth against a single-thread ``np.copyto`` of the
  same bytes (cold: fresh shared-memory pages; warm: faulted in ahead), and
  get latency (zero copy); the copy and the put alternate in each repeat and
  the ratio is the median of the per-repeat ratios;
- an uncontended store lock: acquire+release in microseconds;
- a 1,000-array state dict of 256 MiB: put time against one ``np.copyto`` of
  256 MiB (alternating, as above), and get latency.

Usage: python scripts/bench_local.py [--repeats 5] [--small 20000] [--big-mib 1024] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmstore  # noqa: E402
from shmstore.meta.lock import ShmLock, init_lock  # noqa: E402
from shmstore.primitives.segment import Segment  # noqa: E402

MiB = 1 << 20


def median(xs):
    return statistics.median(xs)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ---- small objects -------------------------------------------------------------

def small_ops(store, keys, arrays) -> tuple[float, float]:
    """(put ops/s, get ops/s) for one pass over ``keys``."""
    put = store.put
    get = store.get

    def put_all():
        for k, a in zip(keys, arrays):
            put(k, a)

    def get_all():
        for k in keys:
            get(k)

    t_put = timed(put_all)
    t_get = timed(get_all)
    check = get(keys[-1])
    assert np.array_equal(check, arrays[-1])
    del check
    store.clear()
    return len(keys) / t_put, len(keys) / t_get


def bench_small(n: int, repeats: int, name: str) -> dict:
    """Small-object rates: one worker process alone, then two at once, interleaved per repeat.

    The same worker script does both, so the ratio compares like with like;
    the figures of this (benchmark) process are reported too.
    """
    arrays = [np.full(8, i, np.float64) for i in range(n)]  # 64 bytes each
    puts, gets, solo_puts, solo_gets, two_puts, two_gets, solo_mix, two_mix = [], [], [], [], [], [], [], []
    own_solo, own_two = [], []  # the same two workers, each on a store of its own: what this machine allows
    with contextlib.ExitStack() as stack:
        store, *own = [stack.enter_context(shmstore.connect(s, capacity="256MiB", prefault="64MiB"))
                       for s in (name, name + "o0", name + "o1")]
        for s in (store, *own):
            s.wait_prefaulted(64 * MiB)
        small_ops(store, [f"warm{i}" for i in range(2000)], arrays[:2000])
        workers, apart = Workers(name, n), Workers([s.name for s in own], n)
        try:
            workers.run(2)  # warm-up pass: fresh processes fault their mappings in
            apart.run(2)
            for r in range(repeats):  # interleaved, so that machine noise hits all alike
                p, g = small_ops(store, [f"k{r}-{i}" for i in range(n)], arrays)
                puts.append(p)
                gets.append(g)
                p, g, m = workers.run(1)
                solo_puts.append(p)
                solo_gets.append(g)
                solo_mix.append(m)
                p, g, m = workers.run(2)
                two_puts.append(p)
                two_gets.append(g)
                two_mix.append(m)
                own_solo.append(apart.run(1)[2])
                own_two.append(apart.run(2)[2])
        finally:
            workers.close()
            apart.close()
    base = bench_small_baseline(min(n, 5000), arrays)
    return {"n": n, "put_ops": median(solo_puts), "get_ops": median(solo_gets),
            "inprocess_put_ops": median(puts), "inprocess_get_ops": median(gets),
            "two_proc_put_ops": median(two_puts), "two_proc_get_ops": median(two_gets),
            "two_proc_put_ratio": median([t / o for t, o in zip(two_puts, solo_puts)]),
            "two_proc_get_ratio": median([t / o for t, o in zip(two_gets, solo_gets)]),
            "mix_ops": median(solo_mix), "two_proc_mix_ratio": median([t / o for t, o in zip(two_mix, solo_mix)]),
            "two_stores_mix_ratio": median([t / o for t, o in zip(own_two, own_solo)]),
            "baseline_put_ops": base[0], "baseline_get_ops": base[1]}


_WORKER = r"""
import sys, time, numpy as np
sys.path.insert(0, sys.argv[1])
import shmstore
name, tag, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
arrays = [np.full(8, i, np.float64) for i in range(n)]
with shmstore.connect(name, prefault=0) as store:
    r = 0
    print("ready", flush=True)
    while True:
        line = sys.stdin.readline().split()
        if not line or line[0] != "go":
            break
        keys = [f"{tag}{r}-{i}" for i in range(n)]
        r += 1
        while time.monotonic() < float(line[1]):  # every worker starts at the same moment (no skew from stdin)
            pass
        t0 = time.perf_counter()
        for k, a in zip(keys, arrays):
            store.put(k, a)
        t1 = time.perf_counter()
        for k in keys:
            store.get(k)
        t2 = time.perf_counter()
        for k in keys:
            store.delete(k)
        print(t1 - t0, t2 - t1, time.perf_counter() - t2, flush=True)
        print("ready", flush=True)
"""


class Workers:
    """Worker processes (two by default) that run put/get passes alone or at the same moment."""

    def __init__(self, name: str | list[str], n: int, count: int = 2) -> None:
        """``count`` workers on store ``name``, or one on each store of a list of names."""
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.n = n
        names = [name] * count if isinstance(name, str) else name
        self.procs = [subprocess.Popen([sys.executable, "-c", _WORKER, root, store, tag, str(n)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for tag, store in zip("abcdefghijklmnop", names)]
        for p in self.procs:
            assert p.stdout.readline().strip() == "ready"

    def run(self, active: int) -> tuple[float, float, float]:
        """(aggregate put ops/s, get ops/s, ops/s of the whole put/get/delete pass) of one pass of ``active``
        workers at once."""
        procs = self.procs[:active]
        start = time.monotonic() + 0.05  # CLOCK_MONOTONIC: the same clock in every process
        for p in procs:
            p.stdin.write(f"go {start}\n")
            p.stdin.flush()
        times = [tuple(map(float, p.stdout.readline().split())) for p in procs]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        return (active * self.n / max(t[0] for t in times), active * self.n / max(t[1] for t in times),
                3 * active * self.n / max(sum(t) for t in times))

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
            p.wait(60)


def bench_sweep(n: int, repeats: int, name: str, counts: list[int]) -> list[dict]:
    """Aggregate small put/get rates of 1, 2, 4, ... worker processes at once, interleaved per repeat."""
    rows: dict[int, tuple[list[float], list[float], list[float]]] = {c: ([], [], []) for c in counts}
    # every worker holds its n objects at once: the table must hold them all (8 x 10,000 > the default 65,536)
    with shmstore.connect(name, capacity="256MiB", prefault="64MiB", max_objects=2 * n * max(counts)) as store:
        store.wait_prefaulted(64 * MiB)
        workers = Workers(name, n, max(counts))
        try:
            workers.run(max(counts))  # warm-up
            for _ in range(repeats):
                for c in counts:
                    for i, x in enumerate(workers.run(c)):
                        rows[c][i].append(x)
        finally:
            workers.close()
    one = rows[counts[0]]
    return [{"procs": c, "put_ops": median(rows[c][0]), "get_ops": median(rows[c][1]), "mix_ops": median(rows[c][2]),
             "put_ratio": median(rows[c][0]) / median(one[0]), "get_ratio": median(rows[c][1]) / median(one[1]),
             "mix_ratio": median(rows[c][2]) / median(one[2])}
            for c in counts]


def bench_small_baseline(n: int, arrays) -> tuple[float, float]:
    """One SharedMemory segment per object, names in a Manager dict."""
    from multiprocessing import Manager
    from multiprocessing.shared_memory import SharedMemory
    prefix = "bl" + uuid.uuid4().hex[:8]
    with Manager() as manager:
        registry = manager.dict()
        segs = []

        def put_all():
            for i in range(n):
                a = arrays[i]
                shm = SharedMemory(f"{prefix}{i}", create=True, size=a.nbytes)
                np.ndarray(a.shape, a.dtype, shm.buf)[:] = a
                registry[f"k{i}"] = (shm.name, a.shape, a.dtype.str)
                segs.append(shm)

        def get_all():
            for i in range(n):
                sname, shape, dt = registry[f"k{i}"]
                shm = SharedMemory(sname)
                np.ndarray(shape, dt, shm.buf)
                shm.close()

        t_put = timed(put_all)
        t_get = timed(get_all)
        for shm in segs:
            shm.close()
            shm.unlink()
    return n / t_put, n / t_get


# ---- 1 GiB array -------------------------------------------------------------

def alternate(store, key: str, value, baseline, repeats: int, check) -> tuple[list, list, list]:
    """Per repeat: time ``baseline()``, then ``store.put(key, value)``, then 5 gets (each
    checked); the three lists of seconds. Alternating keeps the VM's drift out of the ratios."""
    copies, puts, gets = [], [], []
    for _ in range(repeats):
        copies.append(timed(baseline))
        puts.append(timed(lambda: store.put(key, value)))
        for _ in range(5):
            t = time.perf_counter()
            got = store.get(key)
            gets.append(time.perf_counter() - t)
            assert check(got)
            del got
        store.delete(key)
    return copies, puts, gets


def bench_big(nbytes: int, repeats: int, name: str) -> dict:
    """1 GiB put against ``np.copyto`` of the same bytes, interleaved per repeat (the VM's speed drifts)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0
    cap = nbytes + 64 * MiB
    with shmstore.connect(name + "cold", capacity=cap, prefault=0) as store:
        copy_cold = timed(lambda: np.copyto(dst, src))
        cold = timed(lambda: store.put("big", src))
    with shmstore.connect(name + "warm", capacity=cap, prefault=cap) as store:
        if not store.wait_prefaulted(cap, timeout=120):
            print("warning: arena not fully prefaulted", file=sys.stderr)
        copies, warm, gets = alternate(store, "big", src, lambda: np.copyto(dst, src), repeats,
                                       lambda view: view.nbytes == nbytes and view[12345] == src[12345])
    copy = median(copies)
    return {"bytes": nbytes, "copyto_s": copy, "copyto_gbps": nbytes / copy / 1e9,
            "put_cold_s": cold, "put_warm_s": median(warm), "put_warm_gbps": nbytes / median(warm) / 1e9,
            "put_warm_vs_copyto": median([c / w for c, w in zip(copies, warm)]),
            "put_cold_vs_copyto": copy_cold / cold, "get_ms": median(gets) * 1e3}


# ---- lock ----------------------------------------------------------------------

def bench_lock(repeats: int) -> dict:
    seg = Segment.create(f"/shmstore-benchlock-{uuid.uuid4().hex[:8]}", 4096)
    try:
        init_lock(seg.address)
        lock = ShmLock(seg.address, "bench")
        n = 200_000

        def loop():
            for _ in range(n):
                with lock:
                    pass
        per = median([timed(loop) for _ in range(repeats)]) / n
    finally:
        seg.close()
        seg.unlink()
    return {"acquire_release_us": per * 1e6}


# ---- state dict ------------------------------------------------------------------

def bench_state_dict(total: int, count: int, repeats: int, name: str) -> dict:
    """A state dict's put against one ``np.copyto`` of its bytes, interleaved per repeat."""
    per = total // count // 4
    sd = {f"layer{i}.weight": np.full(per, i, np.float32) for i in range(count)}
    flat = np.ones(total, np.uint8)
    dst = np.zeros_like(flat)
    cap = total + 64 * MiB
    with shmstore.connect(name, capacity=cap, prefault=cap) as store:
        store.wait_prefaulted(cap, timeout=120)
        copies, puts, gets = alternate(store, "sd", sd, lambda: np.copyto(dst, flat), repeats,
                                       lambda got: len(got) == count and got["layer7.weight"][3] == 7)
    return {"bytes": total, "arrays": count, "copyto_s": median(copies), "put_s": median(puts),
            "put_vs_copyto": median([p / c for p, c in zip(puts, copies)]), "get_ms": median(gets) * 1e3}


def python_speed() -> float:
    """Nanoseconds per ``sum(range(50))``: this shared VM's Python speed varies ~2x over a day."""
    import timeit
    return min(timeit.repeat("sum(range(50))", number=100_000, repeat=5)) / 100_000 * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", type=int, default=20000)
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--sd-mib", type=int, default=256)
    ap.add_argument("--sweep", default="1,2,4,8",
                    help="worker process counts for the small-object scaling sweep ('' to skip)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    name = "bench" + uuid.uuid4().hex[:6]
    out = {}
    print(f"shmstore {shmstore.__version__} bench_local: {os.cpu_count()} cpus, repeats={args.repeats}", flush=True)
    out["python_ns_before"] = python_speed()
    print(f"machine: sum(range(50)) takes {out['python_ns_before']:.0f} ns (a reference for the absolute rates)",
          flush=True)
    out["lock"] = r = bench_lock(args.repeats)
    print(f"lock: uncontended acquire+release {r['acquire_release_us']:.2f} us", flush=True)
    out["small"] = r = bench_small(args.small, args.repeats, name + "s")
    print(f"small ({r['n']} x 64 B), one process: put {r['put_ops']:,.0f}/s, get {r['get_ops']:,.0f}/s "
          f"(this process: {r['inprocess_put_ops']:,.0f}/s, {r['inprocess_get_ops']:,.0f}/s) | "
          f"two processes: put {r['two_proc_put_ops']:,.0f}/s ({r['two_proc_put_ratio']:.2f}x), "
          f"get {r['two_proc_get_ops']:,.0f}/s ({r['two_proc_get_ratio']:.2f}x), put/get/delete pass "
          f"{r['two_proc_mix_ratio']:.2f}x (each on a store of its own: {r['two_stores_mix_ratio']:.2f}x) | "
          f"baseline shared_memory+Manager: put {r['baseline_put_ops']:,.0f}/s, get {r['baseline_get_ops']:,.0f}/s "
          f"(shmstore {r['put_ops'] / r['baseline_put_ops']:.0f}x / {r['get_ops'] / r['baseline_get_ops']:.0f}x)",
          flush=True)
    if args.sweep:
        counts = sorted({int(c) for c in args.sweep.split(",")})
        out["sweep"] = rows = bench_sweep(max(1000, args.small // 2), args.repeats, name + "w", counts)
        print("small ops, several processes at once (aggregate, ratio to one): " + " | ".join(
            f"{r['procs']}: put {r['put_ops']:,.0f}/s ({r['put_ratio']:.2f}x), get {r['get_ops']:,.0f}/s "
            f"({r['get_ratio']:.2f}x), put/get/delete {r['mix_ops']:,.0f}/s ({r['mix_ratio']:.2f}x)"
            for r in rows) + f" [{os.cpu_count()} cpus]", flush=True)
    out["big"] = r = bench_big(args.big_mib * MiB, args.repeats, name + "b")
    print(f"{args.big_mib} MiB array: np.copyto {r['copyto_gbps']:.1f} GB/s | put warm {r['put_warm_gbps']:.1f} GB/s "
          f"({r['put_warm_vs_copyto']:.2f}x copyto), cold {r['put_cold_s']:.2f} s ({r['put_cold_vs_copyto']:.2f}x) | "
          f"get {r['get_ms']:.3f} ms", flush=True)
    out["state_dict"] = r = bench_state_dict(args.sd_mib * MiB, 1000, args.repeats, name + "d")
    print(f"state dict ({r['arrays']} arrays, {args.sd_mib} MiB): put {r['put_s'] * 1e3:.1f} ms = "
          f"{r['put_vs_copyto']:.2f}x one np.copyto ({r['copyto_s'] * 1e3:.1f} ms) | get {r['get_ms']:.2f} ms",
          flush=True)
    out["python_ns_after"] = python_speed()
    print(f"machine: sum(range(50)) takes {out['python_ns_after']:.0f} ns at the end", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
