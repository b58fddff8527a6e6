"""An MPI job whose VICTIM rank SIGKILLs itself while every rank updates a small shared key set.

    python -m mpi4py kill_mid_update.py NAME SEED VICTIM

Run by tests/mpi/test_jobs.py on two emulated nodes. First every rank puts an
anchor object (``anchor<rank>``) and fetches everyone's, so that each node
holds all of them, committed before anything dies; the updates never touch
them. Then every rank loops over random overwriting puts, gets, fetches,
get_many, migrations and deletes of 12 shared keys. Their races may raise
ObjectNotFoundError, ObjectExistsError, and ObjectLockedError from a put
meeting a transfer of its key into its node; anything else escapes, and the
job aborts before the kill (the test fails). Every value carries a header
naming its key, version, size and the crc32 of its payload, and is checked
wherever it is read: a torn or wrong value prints ``CORRUPT`` and exits 3.
The victim kills itself from a thread 0.2-1.5 s into the loop and the
launcher takes the job down. The stores are persistent so the test can
check them (with :func:`problem`) after the job died.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
import zlib

import numpy as np

KEYS = [f"upd{i}" for i in range(12)]
MAGIC = 0x5348_4D55_5044_0001  # "SHMUPD" + 1
HEADER = 5  # int64 words: magic, crc32 of the key, version, payload size, crc32 of the payload
RUN_FOR = 10.0  # seconds of updates: far beyond the kill, so the job always dies mid-update


def value(key: str, version: int, size: int) -> np.ndarray:
    """``size`` bytes (a multiple of 8, at least 48) every one of which follows from (key, version)."""
    payload = np.frombuffer(random.Random(f"{key}/{version}").randbytes(min(size, 4096)), np.uint8)
    payload = np.resize(payload, size - 8 * HEADER)
    payload[:8] = np.frombuffer(np.int64(version).tobytes(), np.uint8)  # no two versions alike
    head = np.array([MAGIC, zlib.crc32(key.encode()), version, payload.size, zlib.crc32(payload)], np.int64)
    return np.concatenate([head.view(np.uint8), payload])


def problem(got: object, key: str) -> str | None:
    """What is wrong with ``got`` as a value of ``key`` (of any version); None if it is whole and untorn."""
    if not isinstance(got, np.ndarray) or got.dtype != np.uint8 or got.ndim != 1 or got.size < 8 * (HEADER + 1):
        return f"not a value: {type(got).__name__} {getattr(got, 'dtype', '')} {getattr(got, 'shape', '')}"
    magic, kid, version, size, crc = (int(x) for x in got[: 8 * HEADER].view(np.int64))
    if magic != MAGIC or kid != zlib.crc32(key.encode()):
        return f"header magic {magic:#x}, key id {kid:#x} (expected {zlib.crc32(key.encode()):#x})"
    payload = got[8 * HEADER:]
    if payload.size != size:
        return f"version {version:#x}: {payload.size} bytes of payload, the header says {size}"
    if zlib.crc32(payload) != crc:
        return f"version {version:#x}: crc32 {zlib.crc32(payload):#x}, the header says {crc:#x}"
    if not np.array_equal(got, value(key, version, got.size)):
        return f"version {version:#x}: bytes differ from what was put"
    return None


def random_size(rng: random.Random) -> int:
    if rng.random() < 0.5:
        return 8 * rng.randrange(HEADER + 1, 8 << 10)  # under 64 KiB
    return 8 * rng.randrange(1 << 17, 1 << 20)  # 1-8 MiB


def main(name: str, seed: int, victim: int) -> None:
    from shmstore.errors import ObjectExistsError, ObjectLockedError, ObjectNotFoundError
    from shmstore.mpi import Cluster

    with Cluster(name=name, capacity="256MiB", persist=True, prefault=0) as c:
        ranks = c.comm.allgather((c.node_index, c.rank))
        leaders = {min(r for n, r in ranks if n == node) for node, _ in ranks}  # the lowest rank of each node
        rng = random.Random(seed * 1000 + c.rank)

        def verify(got: object, key: str, where: str) -> None:
            wrong = problem(got, key)
            if wrong:
                print(f"CORRUPT rank {c.rank} {where} {key}: {wrong}", flush=True)
                os._exit(3)

        anchors = [f"anchor{r}" for r in range(c.size)]
        c.put(anchors[c.rank], value(anchors[c.rank], c.rank, 8 * (1 << 17) + 8 * 999 * c.rank))
        c.barrier()
        for key, got in zip(anchors, c.get_many(anchors)):
            verify(got, key, "anchor")
        del got
        c.barrier()
        ops: dict[str, int] = {}
        if c.rank == victim:
            delay = random.Random(seed).uniform(0.2, 1.5)

            def kill() -> None:
                time.sleep(delay)
                role = "leader" if c.rank in leaders else "non-leader"
                print(f"killing rank {c.rank} ({role} of node {c.node}) after {delay:.2f} s, "
                      f"{sum(ops.values())} operations", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Thread(target=kill, daemon=True).start()
        version = c.rank << 40
        end = time.monotonic() + RUN_FOR
        while time.monotonic() < end:
            key, op = rng.choice(KEYS), rng.random()
            try:
                if op < 0.35:
                    version += 1
                    try:
                        c.put(key, value(key, version, random_size(rng)), overwrite=True)
                        kind = "put"
                    except ObjectLockedError:  # a transfer of the key into this node is being written
                        kind = "put locked"
                elif op < 0.6:
                    got = c.get(key)
                    verify(got, key, "get")
                    del got
                    kind = "get"
                elif op < 0.7:
                    c.fetch(key)
                    got = c.store.get(key)
                    verify(got, key, "fetch")
                    del got
                    kind = "fetch"
                elif op < 0.75:
                    keys = rng.sample(KEYS, 3)
                    for k, got in zip(keys, c.get_many(keys)):
                        verify(got, k, "get_many")
                    del got
                    kind = "get_many"
                elif op < 0.9:
                    c.migrate(key, rng.choice(c.nodes), keep_source=rng.random() < 0.5)
                    kind = "migrate"
                else:
                    c.delete(key)
                    kind = "delete"
            except (ObjectNotFoundError, ObjectExistsError):  # deleted, moved or overwritten meanwhile
                kind = "raced"
            ops[kind] = ops.get(kind, 0) + 1
        print(f"rank {c.rank} lived through the loop: {sorted(ops.items())}", flush=True)
        c.barrier()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
