#!/usr/bin/env python3
"""What reading a stored array through a view costs on first touch: get + sum of one large array.

Each repeat starts two fresh processes on one store: the putter puts the array
and then reads it twice (get + sum, first and second time), and once it has,
a reader in another process does the same. Views are built over a read-only
mapping of the arena, separate from the writable one that puts copy into
(README: "Views are read-only"), and a fresh process has no page-table
entries for it: its first read of each page costs a minor fault (the kernel
maps 16 pages a fault), its second none. Before, views were built over the
writable mapping, whose pages the putter had faulted in by writing them and
every other process's prefault thread faults in ahead of use (``--settle``:
each process reads once that thread is done; without it, at once after
connecting, beside it). Medians over repeats of the wall time, the CPU time
(user + system: steadier on a busy machine) and the minor faults of each read.

Usage: python scripts/bench_views.py [--mib 1024] [--repeats 5] [--settle]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmstore  # noqa: E402

MiB = 1 << 20


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _read_twice(store: shmstore.Store, key: str) -> dict:
    """Seconds (wall and CPU: user + system, steadier on a busy machine) and minor faults of get + sum, first
    and second time; the object must be in memory throughout (a spilled one is read from its file)."""
    out = {}
    for when in ("first", "second"):
        (c0, f0), t0 = _usage(), time.perf_counter()
        total = float(store.get(key).sum())
        out[when] = time.perf_counter() - t0
        c1, f1 = _usage()
        out[when + "_cpu"], out[when + "_faults"] = c1 - c0, f1 - f0
        assert store.get_info(key).level == shmstore.Level.MEMORY, "spilled: the figures would be the disk's"
    out["sum"] = total
    return out


def _capacity(nbytes: int) -> int:
    return 2 * nbytes + 64 * MiB  # the object stays under the high watermark: never spilled


def _child(role: str, name: str, key: str, nbytes: int, settle: bool) -> None:
    with shmstore.connect(name, create=False, prefault=_capacity(nbytes)) as store:
        if role == "put":
            store.put(key, np.ones(nbytes // 8))
        if settle:  # a process connected a while ago: its prefault thread is done (the whole arena)
            assert store.node_store.prefault.wait(_capacity(nbytes), timeout=120)
        print(json.dumps(_read_twice(store, key)), flush=True)
        if role == "put":
            sys.stdin.readline()  # the object stays while the reader reads it


def _spawn(role: str, name: str, key: str, nbytes: int, settle: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--child", role, name, key, str(nbytes), str(int(settle))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _repeat(store: shmstore.Store, key: str, nbytes: int, settle: bool) -> tuple[dict, dict]:
    putter = _spawn("put", store.name, key, nbytes, settle)
    try:
        put = json.loads(putter.stdout.readline())
        reader = _spawn("get", store.name, key, nbytes, settle)
        got = json.loads(reader.stdout.readline())
        reader.wait(120)
        putter.stdin.write("\n")
        putter.stdin.flush()
        putter.wait(120)
    finally:
        putter.kill()
        putter.wait(120)
    store.delete(key)
    assert put["sum"] == got["sum"] == nbytes // 8
    return put, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--settle", action="store_true",
                    help="each process reads once its prefault thread is done (a process connected a while ago), "
                         "not at once after connecting")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        role, name, key, nbytes, settle = args.child
        _child(role, name, key, int(nbytes), settle == "1")
        return
    nbytes = args.mib * MiB
    runs: dict[str, list[dict]] = {"putter": [], "reader": []}
    capacity = _capacity(nbytes)
    with shmstore.connect("bench-views-" + uuid.uuid4().hex[:8], capacity=capacity, prefault=capacity) as store:
        for r in range(args.repeats):
            put, got = _repeat(store, f"a{r}", nbytes, args.settle)
            runs["putter"].append(put)
            runs["reader"].append(got)
    when = "once its prefault thread is done" if args.settle else "at once after connecting"
    print(f"get + sum of a {args.mib} MiB float64 array, medians of {args.repeats} (fresh processes each repeat, "
          f"each reading {when}):")
    for who, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "sum"}
        print(f"  {who:6s}: first {med['first'] * 1e3:6.1f} ms, CPU {med['first_cpu'] * 1e3:6.1f} ms "
              f"({med['first_faults']:.0f} minor faults) | second {med['second'] * 1e3:6.1f} ms, CPU "
              f"{med['second_cpu'] * 1e3:6.1f} ms ({med['second_faults']:.0f} faults) | each first's CPU: "
              f"{' '.join(format(r['first_cpu'] * 1e3, '.0f') for r in rs)} ms")


if __name__ == "__main__":
    main()
