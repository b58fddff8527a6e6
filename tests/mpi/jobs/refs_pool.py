"""Refs through mpi4py.futures (tests/mpi/test_jobs.py runs it): ``mpiexec -launcher fork -hosts n0:2,n1:2 -n 4
python -m mpi4py.futures refs_pool.py NAME``.

Rank 0 (the main process, on n0) shares a 16 MiB array through the pool's Cluster (shmstore/mpi/pool.py)
and hands its Ref to 12 tasks over the 3 workers (one on n0, two on n1); each task checksums what it gets.
Then one task per worker reports its node's counters, and after ``ref.delete()`` a task's ``get`` says the
reference was deleted. Prints one ``RESULT`` line of JSON.
"""
import json
import sys
import time
import zlib

import numpy as np
from mpi4py.futures import MPIPoolExecutor

import shmstore
from shmstore.mpi import pool


def crc_task(ref):
    time.sleep(0.05)  # every worker gets tasks
    a = ref.get()
    return pool.join({}).node, zlib.crc32(memoryview(a).cast("B")), type(a).__name__


def stats_task(_):
    time.sleep(0.2)
    cluster = pool.join({})
    return cluster.node, cluster.stats()


def deleted_task(ref):
    try:
        ref.get()
    except shmstore.ObjectNotFoundError as exc:
        return f"ObjectNotFoundError: {exc}"
    return "resolved"


if __name__ == "__main__":
    kw = {"name": sys.argv[1], "capacity": "128MiB"}
    with MPIPoolExecutor(**pool.worker_setup(**kw)) as ex:
        cluster = pool.open_cluster(ex, **kw)
        data = np.random.default_rng(21).integers(0, 1 << 30, 2 << 20, dtype=np.int64)
        ref = cluster.share(data)
        tasks = list(ex.map(crc_task, [ref] * 12))
        stats = dict(ex.map(stats_task, range(6)))
        ref.delete()
        gone = ex.submit(deleted_task, ref).result()
        print("RESULT " + json.dumps({"want": zlib.crc32(memoryview(data).cast("B")), "nbytes": data.nbytes,
                                      "nodes": cluster.nodes, "tasks": tasks, "stats": stats, "gone": gone,
                                      "key": ref.key}), flush=True)
