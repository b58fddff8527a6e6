#!/usr/bin/env python3
"""ProxyStore through shmstore, side by side with ProxyStore's LocalConnector and FileConnector.

Measured in one run, medians over repeats, for objects of 1 KiB, 1 MiB and
100 MiB:

- connector: ``put(bytes)`` then ``get(key)`` then ``evict(key)`` of raw
  bytes, one byte per page read after the get (so that a lazy view pays
  for its reads); small sizes time batches of operations;
  the three targets' samples interleaved (one of each in turn, after one
  round of warm-up), from after the store's spill process has started;
- Store: ``store.put(array)`` then ``store.get(key)`` of a numpy array
  through ``proxystore.store.Store`` (cache off), read the same way:
  shmstore with its zero-copy serializer pair, the others with ProxyStore's
  default serializers (``np.save`` / ``np.load`` through ``io.BytesIO``).

FileConnector writes to a directory on /dev/shm (tmpfs: no disk in the way).
LocalConnector keeps objects in this process's dict: it cannot share them
with another process, so it is the upper bound of what a put+get can cost,
not a peer. Ratios are ``other time / shmstore time``: above 1, shmstore is
faster.

``--put-only``: just a 100 MiB array through a ProxyStore Store put with
the serializer pair against a raw connector put of its bytes.

Usage: python scripts/bench_proxystore.py [--repeats 7] [--json out.json] [--put-only]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmstore  # noqa: E402

try:
    from proxystore.connectors.file import FileConnector
    from proxystore.connectors.local import LocalConnector
    from proxystore.store import Store
except ImportError:
    sys.exit("bench_proxystore needs ProxyStore: pip install 'shmstore[proxystore]'")

from shmstore.contrib import proxystore as ps  # noqa: E402
from shmstore.contrib.proxystore import ShmStoreConnector, deserialize, serialize  # noqa: E402

SIZES = {"1 KiB": 1 << 10, "1 MiB": 1 << 20, "100 MiB": 100 << 20}


def _touch(value) -> int:
    """Read one byte per page (a lazy view pays for its reads; a copy has paid already)."""
    if isinstance(value, np.ndarray):
        value = value.view(np.uint8).reshape(-1)
    return int(np.frombuffer(memoryview(value).cast("B"), np.uint8)[::4096].sum())


def _inner(n: int) -> int:
    """Operations per timed sample: enough that a sample of small objects lasts milliseconds."""
    return max(1, min(1000, (4 << 20) // max(n, 1)))


def time_round_trip(target, value, nbytes: int, repeats: int) -> float:
    """Median seconds of one put + get + read + evict through ``target`` (a connector or a Store: same verbs)."""
    times, inner = [], _inner(nbytes)
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            key = target.put(value)
            got = target.get(key)
            _touch(got)
            del got
            target.evict(key)
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def time_put(put, evict, value, repeats: int) -> float:
    """Median seconds of one ``put(value)`` (its evict untimed)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        key = put(value)
        times.append(time.perf_counter() - t)
        evict(key)
    return statistics.median(times)


def put_only(repeats: int) -> int:
    """``--put-only``: a 100 MiB array through a ProxyStore Store put with shmstore's serializer pair, against
    a raw connector put of its bytes (what the pair's put would cost without serializing)."""
    name = "bps" + uuid.uuid4().hex[:8]
    conn = ShmStoreConnector(name, capacity="1GiB")
    store = Store(name, conn, serializer=serialize, deserializer=deserialize, cache_size=0, populate_target=False)
    try:
        arr = np.random.default_rng(0).integers(0, 256, 100 << 20, dtype=np.uint8).view(np.float64)
        data = arr.tobytes()
        staged_from = ps._STAGE_MIN

        def store_put(stage: bool) -> float:
            ps._STAGE_MIN = staged_from if stage else 1 << 62  # off: a buffer of its own, copied by the put
            try:
                return time_put(store.put, store.evict, arr, 1)
            finally:
                ps._STAGE_MIN = staged_from
        runs: dict[str, list[float]] = {"staged": [], "unstaged": [], "raw": []}
        for i in range(repeats + 2):  # interleaved, so that the machine's load falls on all three alike
            for label, t in (("staged", store_put(True)), ("unstaged", store_put(False)),
                             ("raw", time_put(conn.put, conn.evict, data, 1))):
                if i >= 2:  # the first two warm up the arena's pages and the code paths
                    runs[label].append(t)
        m = {k: statistics.median(v) * 1e3 for k, v in runs.items()}
        print(f"100 MiB put, median of {repeats}: Store with the pair {m['staged']:.1f} ms (serialized into the "
              f"store), {m['unstaged']:.1f} ms (into a buffer of its own, then copied: before issue 21), raw "
              f"connector {m['raw']:.1f} ms", flush=True)
    finally:
        store.close()
        shmstore.destroy(name, force=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    ap.add_argument("--put-only", action="store_true", help="only: a 100 MiB Store put against a raw connector put")
    args = ap.parse_args(argv)
    if args.put_only:
        return put_only(args.repeats)
    name = "bps" + uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="shmstore-bench-ps-", dir="/dev/shm")
    ours = ShmStoreConnector(name, capacity="1GiB")
    others = {"local": LocalConnector(), "file": FileConnector(os.path.join(tmp, "file"))}
    stores = {"shmstore": Store(name, ours, serializer=serialize, deserializer=deserialize, cache_size=0,
                                populate_target=False)}
    stores.update({k: Store(f"{k}-{name}", c, cache_size=0, populate_target=False) for k, c in others.items()})
    results = []
    ours.store.wait_spill_ready()  # its start-up (a few hundred ms of a core) would fall on the first samples
    try:
        print(f"{'size':>8} {'layer':>9} {'shmstore':>11} {'local':>11} {'file':>11}  local/shm  file/shm",
              flush=True)
        for label, n in SIZES.items():
            reps = args.repeats if n < (64 << 20) else max(3, args.repeats // 2)
            data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes()
            arr = np.frombuffer(data, np.uint8).view(np.float64) if n >= 8 else np.frombuffer(data, np.uint8)
            for layer in ("connector", "store"):
                targets = {who: ((ours if who == "shmstore" else others[who]) if layer == "connector" else stores[who],
                                 data if layer == "connector" else arr) for who in ("shmstore", "local", "file")}
                samples: dict[str, list[float]] = {who: [] for who in targets}
                for rep in range(reps + 1):  # interleaved, so that the machine's load falls on all three alike
                    for who, (target, value) in targets.items():
                        t = time_round_trip(target, value, n, 1)
                        if rep:  # the first round warms up
                            samples[who].append(t)
                row = {who: statistics.median(ts) for who, ts in samples.items()}
                r = {"size": label, "bytes": n, "layer": layer, **{k + "_s": v for k, v in row.items()},
                     "local_over_shmstore": row["local"] / row["shmstore"],
                     "file_over_shmstore": row["file"] / row["shmstore"]}
                results.append(r)
                print(f"{label:>8} {layer:>9} " + " ".join(f"{row[k] * 1e6:9.1f}us" for k in ("shmstore", "local",
                                                                                             "file"))
                      + f"  {r['local_over_shmstore']:8.2f}x {r['file_over_shmstore']:8.2f}x", flush=True)
    finally:
        for s in stores.values():
            s.close()
        ours.close()
        shutil.rmtree(tmp, ignore_errors=True)
        shmstore.destroy(name, force=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
