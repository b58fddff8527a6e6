#!/usr/bin/env python3
"""What reading a stored array through a view costs on first touch: get + sum of one large array.

Each repeat starts two fresh processes on one store: the putter puts the array
and then reads it twice (get + sum, first and second time), and once it has,
a reader in another process does the same. A fresh process has no page-table
entries for the arena yet, so its first read pays the minor faults of every
page it touches (the kernel maps up to 16 pages a fault on a shared file
mapping), its second read none. Views are built over a read-only mapping of
the arena, separate from the writable one puts copy into (README: "Views are
read-only"), so the putter's first read faults its pages in a second time;
the reader maps them once either way. Medians over repeats; the minor faults
of each read (``getrusage``) beside the times.

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


def _read_twice(store: shmstore.Store, key: str) -> dict:
    """Seconds and minor faults of get + sum, first and second time."""
    out = {}
    for when in ("first", "second"):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        total = float(store.get(key).sum())
        out[when] = time.perf_counter() - t0
        out[when + "_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    out["sum"] = total
    return out


def _child(role: str, name: str, key: str, nbytes: int, settle: bool) -> None:
    with shmstore.connect(name, create=False) as store:
        if role == "put":
            store.put(key, np.ones(nbytes // 8))
        if settle:  # a process connected a while ago: its prefault thread (README: Prefaulting) is done
            store.node_store.prefault.wait(store.node_store.capacity, timeout=120)
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
    with shmstore.connect("bench-views-" + uuid.uuid4().hex[:8], capacity=nbytes + 64 * MiB,
                          prefault=nbytes + 64 * MiB) as store:
        for r in range(args.repeats):
            put, got = _repeat(store, f"a{r}", nbytes, args.settle)
            runs["putter"].append(put)
            runs["reader"].append(got)
    when = "once its prefault thread is done" if args.settle else "at once after connecting"
    print(f"get + sum of a {args.mib} MiB float64 array, medians of {args.repeats} (fresh processes each repeat, "
          f"each reading {when}):")
    for who, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("first", "second", "first_faults", "second_faults")}
        print(f"  {who:6s}: first {med['first'] * 1e3:7.1f} ms ({med['first_faults']:.0f} minor faults) | "
              f"second {med['second'] * 1e3:7.1f} ms ({med['second_faults']:.0f} faults) | "
              f"each first: {' '.join(format(r['first'] * 1e3, '.0f') for r in rs)} ms")


if __name__ == "__main__":
    main()
