"""Chaos on the MPI path: ranks fetch, migrate, overwrite and delete self-checking objects while the test stops
(SIGSTOP, then SIGCONT) and kills (SIGKILL) ranks at random.

    mpiexec -disable-auto-cleanup -launcher fork -hosts n0:2,n1:2 -n 4 python -m mpi4py chaos_ranks.py \
        NAME SEED OPS PIDDIR

Every value says what it is: ``value(key, version, size)`` is a uint64 array whose words are derived from the
key and a version number it carries, so any copy on any node can be checked without knowing which put made
it (``problem``). Each rank runs OPS random operations (bounded by count; every call may raise
``TransferError`` while a peer is stopped or dead: caught, counted, and the next operation goes on) and
checks every value it reads, printing ``CORRUPT ...`` for a wrong one. The stores are persistent, so the
test reads and checks every object of both nodes after the job, whatever happened to it. Each rank writes
its pid to PIDDIR/<rank> (the test's chaos needs them), and ``DONE <rank> <ops> <errors>`` at the end; it
then serves the others until they are done (60 s at most: one may be dead) and leaves without closing.
"""
from __future__ import annotations

import faulthandler
import os
import random
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

from shmstore.errors import ObjectExistsError, ObjectLockedError, ObjectNotFoundError, ShmStoreError
from shmstore.mpi import Cluster

KEYS = 48
SIZES = (64, 1 << 10, 16 << 10, 200 << 10, 1 << 20, 6 << 20)  # inline, one frame, several frames


def value(key: str, version: int, nbytes: int) -> np.ndarray:
    words = max(3, nbytes // 8)
    seed = zlib.crc32(key.encode()) & 0xFFFFFFFF
    out = np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFF)
    out += np.uint64(seed) + np.uint64(version) * np.uint64(1 << 32)
    out[0], out[1], out[2] = seed, version, words
    return out


def problem(key: str, got: object) -> str | None:
    """Why ``got`` is not a whole value of ``key`` (None: it is one)."""
    a = np.asarray(got)
    if a.dtype != np.uint64 or a.ndim != 1 or len(a) < 3:
        return f"not a value: {a.dtype} {a.shape}"
    seed, version, words = int(a[0]), int(a[1]), int(a[2])
    if seed != zlib.crc32(key.encode()) & 0xFFFFFFFF:
        return f"the value of another key (seed {seed})"
    if words != len(a):
        return f"{len(a)} words, the value says {words}"
    want = value(key, version, words * 8)
    bad = np.flatnonzero(a != want)
    return f"{len(bad)} of {len(a)} words wrong (first {bad[0]})" if len(bad) else None


def main(name: str, seed: int, ops: int, piddir: str) -> None:
    faulthandler.dump_traceback_later(150, exit=False)  # where a hang is, in the test's output
    rng = random.Random(seed * 100 + MPI.COMM_WORLD.rank)
    with open(os.path.join(piddir, str(MPI.COMM_WORLD.rank)), "w") as f:
        f.write(str(os.getpid()))
    with Cluster(name=name, capacity="512MiB", persist=True, prefault=0) as c:
        c.barrier()
        errors = in_a_row = 0
        gave_up, deadline = False, time.monotonic() + 60
        for i in range(ops):
            if in_a_row >= 8 or time.monotonic() > deadline:  # a node is gone (its leader was killed, or its
                print(f"GAVE UP {c.rank} after {i} ops", flush=True)  # launcher killed it): each call now
                gave_up = True                                       # costs a deadline
                break
            key = f"c{rng.randrange(KEYS)}"
            op = rng.choice(("get", "get", "get", "put", "overwrite", "overwrite", "fetch", "migrate", "delete",
                             "get_many"))
            try:
                if op == "get":
                    got = c.get(key, None)
                    if got is not None and problem(key, got):
                        print(f"CORRUPT rank {c.rank} get {key}: {problem(key, got)}", flush=True)
                    del got
                elif op == "get_many":
                    keys = [f"c{rng.randrange(KEYS)}" for _ in range(6)]
                    for k, got in zip(keys, c.get_many(keys)):  # ObjectNotFoundError where one is missing
                        if problem(k, got):
                            print(f"CORRUPT rank {c.rank} get_many {k}: {problem(k, got)}", flush=True)
                elif op in ("put", "overwrite"):
                    c.put(key, value(key, rng.randrange(1 << 20), rng.choice(SIZES)), overwrite=op == "overwrite")
                elif op == "fetch":
                    c.fetch(key)
                elif op == "migrate":
                    c.migrate(key, rng.randrange(len(c.nodes)))
                elif op == "delete":
                    c.delete(key)
                in_a_row = 0
            except (ObjectNotFoundError, ObjectExistsError, ObjectLockedError):
                in_a_row = 0
            except ShmStoreError as exc:  # a peer stopped past peer_timeout, or dead
                errors += 1
                in_a_row += 1
                if errors <= 3:
                    print(f"rank {c.rank} op {i} {op} {key}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            if rng.random() < 0.05:
                time.sleep(rng.random() * 0.05)
        print(f"DONE {c.rank} {ops} {errors}", flush=True)
        # serve the others until they are done too (a node's service is its leader's), 60 s at most: a rank
        # may be dead; then no collective close (the stores are persistent: the test checks them)
        deadline, req = time.monotonic() + (5 if gave_up else 60), c.comm.Ibarrier()
        try:
            while not req.Test() and time.monotonic() < deadline:
                time.sleep(0.01)
        except MPI.Exception:
            pass
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
