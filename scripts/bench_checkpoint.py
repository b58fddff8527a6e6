#!/usr/bin/env python3
"""Checkpoint benchmark (issue 34): one process, a state dict of many arrays, side by side in one run.

- blocked: ``store.checkpoint`` (the put into the node's store) against ``np.copyto`` of the same bytes into
  warm memory (the floor of any in-memory snapshot) and against ``pickle.dump`` of the state dict into the
  same folder with ``fsync`` (what ``torch.save`` does; ``torch.save`` itself where torch is installed);
- flush: the spill process's background write (bytes / time to complete) against a plain sequential write
  + ``fsync`` of the same bytes into the same folder (one before and one after each checkpoint: this
  disk's speed drifts); and a step of single-threaded numpy compute while a flush runs, against alone;
- restore: per object from the node's store (views), and from the folder after the store is gone (each
  object's bytes touched, checksums checked) against a plain read of the same bytes, ``pickle.load`` and
  ``torch.load`` (where torch is installed).

Medians over ``--repeats``. Usage: python scripts/bench_checkpoint.py [--mib 256] [--arrays 1000]
[--dir PATH] [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmstore  # noqa: E402

MiB = 1 << 20


def _drop_caches() -> None:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        pass


def _plain_write(path: str, sd: dict) -> float:
    t = time.perf_counter()
    with open(path, "wb") as f:
        for a in sd.values():
            f.write(memoryview(a).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


_X = np.random.default_rng(0).standard_normal(1 << 18)  # 2 MiB
_Y = np.empty_like(_X)


def _compute_steps(n: int, until: Any = None) -> list[float]:
    """Seconds of each of ``n`` steps of single-threaded numpy compute (a ufunc over 2 MiB, ~2 ms), stopping
    early once ``until()`` is true."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        for _ in range(4):
            np.sin(_X, out=_Y)
        out.append(time.perf_counter() - t)
        if until is not None and until():
            break
    return out


def _plain_read(path: str) -> float:
    t = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass
    return time.perf_counter() - t


def _pickle_save(path: str, sd: dict) -> float:
    t = time.perf_counter()
    with open(path, "wb") as f:
        pickle.dump(sd, f, protocol=5)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def _torch_save(path: str, sd: dict) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    tsd = {k: torch.from_numpy(v) for k, v in sd.items()}
    t = time.perf_counter()
    torch.save(tsd, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--arrays", type=int, default=1000)
    ap.add_argument("--dir", default=None, help="the persistent folder's parent (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-ck-", dir=args.dir)
    n = args.mib * MiB // args.arrays // 4
    sd = {f"layer{i}.weight": np.random.default_rng(i).standard_normal(n).astype(np.float32)
          for i in range(args.arrays)}
    nbytes = sum(a.nbytes for a in sd.values())
    warm = {k: np.empty_like(v) for k, v in sd.items()}
    rows: dict[str, list[float]] = {}
    name = "bck" + uuid.uuid4().hex[:8]
    try:
        for rep in range(args.repeats):
            pdir = os.path.join(base, f"persist{rep}")
            for k in sd:  # the copy floor, into warm pages
                np.copyto(warm[k], sd[k])
            t = time.perf_counter()
            for k in sd:
                np.copyto(warm[k], sd[k])
            rows.setdefault("copyto_s", []).append(time.perf_counter() - t)
            rows.setdefault("pickle_save_s", []).append(_pickle_save(os.path.join(base, "sd.pkl"), sd))
            ts = _torch_save(os.path.join(base, "sd.pt"), sd)
            if ts is not None:
                rows.setdefault("torch_save_s", []).append(ts)
            os.sync()
            rows.setdefault("plain_write_s", []).append(_plain_write(os.path.join(base, "plain.bin"), sd))
            with shmstore.connect(name, capacity=f"{args.mib * 3}MiB", prefault=f"{args.mib * 2}MiB",
                                  persist_dir=pdir) as s:
                s.wait_prefaulted(args.mib * 2 * MiB, 120)
                s.checkpoint("warmup", {"x": np.zeros(1)}).wait(60)  # spill process up, folder made
                t = time.perf_counter()
                ck = s.checkpoint("bench", sd)
                rows.setdefault("blocked_s", []).append(time.perf_counter() - t)
                assert ck.wait(600)
                rows.setdefault("complete_s", []).append(time.perf_counter() - t)
                got = s.restore("bench")
                t = time.perf_counter()
                for k in got:
                    got[k]
                rows.setdefault("restore_store_per_object_s", []).append((time.perf_counter() - t) / len(got))
                del got
                os.sync()
                rows.setdefault("plain_write_s", []).append(_plain_write(os.path.join(base, "plain2.bin"), sd))
                # the application's compute beside a flush: one step alone, then steps while the flush runs
                alone = _compute_steps(60)
                os.sync()
                ck = s.checkpoint("beside", sd)
                t = time.perf_counter()
                beside = _compute_steps(10_000, until=ck.done)
                assert ck.wait(600)
                rows.setdefault("compute_step_alone_s", []).append(statistics.median(alone))
                rows.setdefault("compute_step_beside_flush_s", []).append(statistics.median(beside))
                rows.setdefault("complete_beside_compute_s", []).append(time.perf_counter() - t)
            shmstore.destroy(name, force=True)
            _drop_caches()
            rows.setdefault("plain_read_s", []).append(_plain_read(os.path.join(base, "plain.bin")))
            _drop_caches()
            with shmstore.connect(name, capacity="64MiB", prefault="0", persist_dir=pdir) as s:
                t = time.perf_counter()
                got = s.restore("bench")
                total = 0.0
                for k in got:
                    total += float(got[k][-1])
                rows.setdefault("restore_folder_s", []).append(time.perf_counter() - t)
                del got
            shmstore.destroy(name, force=True)
            _drop_caches()
            t = time.perf_counter()
            with open(os.path.join(base, "sd.pkl"), "rb") as f:
                pickle.load(f)
            rows.setdefault("pickle_load_s", []).append(time.perf_counter() - t)
            if os.path.exists(os.path.join(base, "sd.pt")):
                import torch
                _drop_caches()
                t = time.perf_counter()
                torch.load(os.path.join(base, "sd.pt"))
                rows.setdefault("torch_load_s", []).append(time.perf_counter() - t)
            shutil.rmtree(pdir, ignore_errors=True)
    finally:
        shmstore.destroy(name, force=True)
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    gb = nbytes / 1e9
    out = {"bytes": nbytes, "arrays": args.arrays, "repeats": args.repeats, "median": med,
           "blocked_vs_copyto": med["blocked_s"] / med["copyto_s"],
           "pickle_save_vs_blocked": med["pickle_save_s"] / med["blocked_s"],
           "torch_save_vs_blocked": med["torch_save_s"] / med["blocked_s"] if "torch_save_s" in med else None,
           "flush_GBps": gb / (med["complete_s"] - med["blocked_s"]),
           "plain_write_GBps": gb / med["plain_write_s"],
           "flush_vs_plain_write": med["plain_write_s"] / (med["complete_s"] - med["blocked_s"]),
           "compute_slowdown_beside_flush": med["compute_step_beside_flush_s"] / med["compute_step_alone_s"],
           "flush_beside_compute_GBps": gb / med["complete_beside_compute_s"],
           "restore_store_us_per_object": med["restore_store_per_object_s"] * 1e6,
           "restore_folder_vs_plain_read": med["plain_read_s"] / med["restore_folder_s"],
           "restore_folder_vs_pickle_load": med["pickle_load_s"] / med["restore_folder_s"],
           "restore_folder_vs_torch_load": med["torch_load_s"] / med["restore_folder_s"]
           if "torch_load_s" in med else None}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
