#!/usr/bin/env python3
"""Spill benchmark: streaming more data than memory through a store, against raw file I/O.

In one run, on the same spill directory:

- raw baseline: write, then read back, N GiB of 64 MiB files with plain
  Python file I/O (each read checked against what was written);
- shmstore with a MEMORY capacity of 1/4 of the data: ``put`` N GiB of
  64 MiB arrays with ``levels=[MEMORY, DISK]`` (the spill process moves the
  oldest to disk as memory fills), then ``get`` them all back, checking the
  content the same way;
- small-get latency of another process (64-byte objects), idle and while
  the spill runs.

Usage: python scripts/bench_spill.py [--gib 4] [--dir PATH] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmstore  # noqa: E402
from shmstore import Level  # noqa: E402

MiB = 1 << 20
BLOCK = 64 * MiB

_PROBE = r"""
import select, statistics, sys, time, numpy as np
sys.path.insert(0, sys.argv[1])
import shmstore
with shmstore.connect(sys.argv[2], create=False) as s:
    for i in range(200):
        s.put(f"probe{i}", np.full(8, i, np.float64), levels=[shmstore.Level.MEMORY])
        s.pin(f"probe{i}")  # keep the probes in memory: we time gets, not restores
    print("ready", flush=True)
    i = 0
    while sys.stdin.readline().strip() == "measure":  # measure until the next line ("stop")
        lat = []
        while not select.select([sys.stdin], [], [], 0)[0]:
            t = time.perf_counter()
            s.get(f"probe{i % 200}")
            lat.append(time.perf_counter() - t)
            i += 1
            time.sleep(0.0005)
        sys.stdin.readline()
        print(statistics.median(lat) * 1e6 if lat else 0.0, len(lat), flush=True)
    for i in range(200):
        s.unpin(f"probe{i}")
"""


def _probe_phase(probe, action) -> tuple[float, int]:
    """Median small-get latency (us) of the probe process while ``action()`` runs."""
    probe.stdin.write("measure\n")
    probe.stdin.flush()
    action()
    probe.stdin.write("stop\n")
    probe.stdin.flush()
    med, count = probe.stdout.readline().split()
    return float(med), int(count)


def raw_files(directory: str, n: int, block: np.ndarray) -> tuple[float, float]:
    """(write GB/s, read+check GB/s) for ``n`` files of one block each."""
    paths = [os.path.join(directory, f"raw-{uuid.uuid4().hex[:8]}-{i}") for i in range(n)]
    t = time.perf_counter()
    for i, p in enumerate(paths):
        block[0] = i
        with open(p, "wb") as f:
            f.write(memoryview(block))
    write = time.perf_counter() - t
    buf = np.empty_like(block)
    t = time.perf_counter()
    for i, p in enumerate(paths):
        with open(p, "rb", buffering=0) as f:
            f.readinto(memoryview(buf))
        assert buf[0] == i and np.array_equal(buf[1:], block[1:])
    read = time.perf_counter() - t
    for p in paths:
        os.unlink(p)
    total = n * block.nbytes
    return total / write / 1e9, total / read / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="data streamed through the store (default 4 GiB)")
    ap.add_argument("--dir", default=None, help="spill directory (default: $SHMSTORE_SPILL_DIR or the temp dir)")
    ap.add_argument("--json")
    args = ap.parse_args()
    spill_dir = args.dir or os.environ.get("SHMSTORE_SPILL_DIR") or tempfile.gettempdir()
    n = max(4, int(args.gib * (1 << 30) // BLOCK))
    total = n * BLOCK
    block = np.random.default_rng(0).integers(0, 255, BLOCK, dtype=np.uint8)
    print(f"bench_spill: {n} x 64 MiB = {total / (1 << 30):.1f} GiB through {spill_dir}", flush=True)

    raw_w, raw_r = raw_files(spill_dir, n, block)
    print(f"raw Python file I/O: write {raw_w:.2f} GB/s, read+check {raw_r:.2f} GB/s", flush=True)

    name = "bspill" + uuid.uuid4().hex[:6]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with shmstore.connect(name, capacity=total // 4 + 64 * MiB, spill_dir=spill_dir, prefault=total // 4) as s:
        s.wait_prefaulted(total // 4, timeout=120)
        probe = subprocess.Popen([sys.executable, "-c", _PROBE, root, name], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert probe.stdout.readline().strip() == "ready"
        idle_us, _ = _probe_phase(probe, lambda: time.sleep(1.0))
        times = []

        def stream():
            t = time.perf_counter()
            for i in range(n):
                block[0] = i
                s.put(f"b{i}", block, levels=[Level.MEMORY, Level.DISK])
            times.append(time.perf_counter() - t)

        busy_us, _ = _probe_phase(probe, stream)
        put_s = times[0]
        probe.stdin.close()
        probe.wait(60)
        on_disk = sum(1 for i in range(n) if s.get_info(f"b{i}").level == Level.DISK)

        t = time.perf_counter()
        for i in range(n):
            got = s.get(f"b{i}")
            assert got[0] == i and np.array_equal(got[1:], block[1:])
            del got
        get_s = time.perf_counter() - t
        cap = s.get_capacity()
        s.clear()
    put_gbps, get_gbps = total / put_s / 1e9, total / get_s / 1e9
    print(f"shmstore, memory = 1/4 of the data: put {put_gbps:.2f} GB/s ({put_gbps / raw_w:.2f}x raw write), "
          f"get+check {get_gbps:.2f} GB/s ({get_gbps / raw_r:.2f}x raw read); {on_disk}/{n} objects ended on disk, "
          f"{cap[Level.MEMORY].spilled / (1 << 30):.2f} GiB spilled", flush=True)
    print(f"small-get latency of another process: idle {idle_us:.1f} us, during the spill {busy_us:.1f} us "
          f"({busy_us / idle_us:.2f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw_write_gbps": raw_w, "raw_read_gbps": raw_r, "put_gbps": put_gbps, "get_gbps": get_gbps,
                       "put_vs_raw_write": put_gbps / raw_w, "get_vs_raw_read": get_gbps / raw_r,
                       "small_get_idle_us": idle_us, "small_get_during_spill_us": busy_us,
                       "objects_on_disk": on_disk, "objects": n}, f, indent=2)


if __name__ == "__main__":
    main()
