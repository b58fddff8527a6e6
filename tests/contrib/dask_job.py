"""Dask computations on a distributed.LocalCluster whose workers keep their data in shmstore (run by test_dask.py).

Run in a child process of its own: distributed leaves threads behind in the process that starts a cluster (the
suite's leak check would see them). ``python dask_job.py SCENARIO NAME SPILL_DIR [STORAGE]`` prints one JSON line
of facts for the test to check; ``STORAGE`` ``old`` runs the README's old hint (``store.mapping()`` as every
worker's data, Dask's tuple keys encoded) instead of ``ShmStoreData``, to show the bug it had.
"""
from __future__ import annotations

import ast
import json
import os
import signal
import sys
import time
from collections.abc import MutableMapping

import numpy as np

import shmstore
from shmstore.store import observe

TIMEOUT = 120  # every wait: generous, the machine may be busy


class OldEncoded(MutableMapping):
    """The old approach: one shared namespace (``store.mapping()``) for every worker, tuple keys as their repr."""

    def __init__(self, name, **kwargs):
        self.m = shmstore.connect(name, **kwargs).mapping()

    def __getitem__(self, k):
        return self.m[repr(k)]

    def __setitem__(self, k, v):
        self.m[repr(k)] = v

    def __delitem__(self, k):
        del self.m[repr(k)]

    def __iter__(self):
        return (ast.literal_eval(k) for k in self.m)

    def __len__(self):
        return len(self.m)


def wait_until(predicate, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.1)


def worker_facts(dask_worker):
    """What one worker holds: keys, how many readable, its transfer counters."""
    from shmstore.contrib.dask import transfer_stats
    data, held = dask_worker.data, [k for k, ts in dask_worker.state.tasks.items() if ts.state == "memory"]
    unreadable = []
    for k in held:
        try:
            data[k]
        except Exception as exc:  # the bug: a key the scheduler counts on is gone from this worker's data
            unreadable.append(f"{k!r}: {type(exc).__name__}")
    stored = len(data.stored_keys) if hasattr(data, "stored_keys") else None
    return {"pid": os.getpid(), "held": len(held), "unreadable": unreadable, "len": len(data), "stored": stored,
            "stats": dict(transfer_stats)}


def slow_copy(block):
    time.sleep(0.3)
    return block + 0.0  # a new array: the worker stores it


def store_keys(name):
    """The keys of the workers' session in the store (an observer: it changes nothing)."""
    with observe(name, session="dask") as s:
        return [info.key for info in s.kernel.list()], s.check()


def compute(client, name):
    """The original bug: keys copied to both workers, one copy dropped, then sums and a matmul over them."""
    import dask.array as da
    import distributed
    facts = {}
    t0 = time.monotonic()
    x = da.random.RandomState(1).random((4096, 6144), chunks=(1024, 2048)).persist()  # 192 MiB, 12 chunks
    distributed.wait(x, timeout=TIMEOUT)
    futs = client.futures_of(x)
    client.replicate(futs)  # every chunk copied to the other worker
    facts["holders_replicated"] = sorted({len(v) for v in client.who_has(futs).values()})
    client.amm.run_once()  # the active memory manager drops one copy of each (ReduceReplicas)
    wait_until(lambda: all(len(v) == 1 for v in client.who_has(futs).values()), "the replicas to be dropped")
    facts["after_drop"] = client.run(worker_facts)
    facts["t_drop"] = time.monotonic() - t0
    total, colmean, whole = client.compute([x.sum(), x.mean(axis=0), x], sync=False)
    total, colmean, whole = (f.result(timeout=TIMEOUT) for f in (total, colmean, whole))
    facts["sum_ok"] = bool(np.isclose(total, whole.sum(), rtol=1e-9))
    facts["mean_ok"] = bool(np.allclose(colmean, whole.mean(axis=0)))
    facts["whole_shape"] = list(whole.shape)
    del whole
    facts["t_sum"] = time.monotonic() - t0
    a = da.random.RandomState(2).random((1536, 1536), chunks=512)  # 18 MiB each, 9 blocks
    b = da.random.RandomState(3).random((1536, 1536), chunks=512)
    fa, fb, fc = client.compute([a, b, a @ b], sync=False)
    av, bv, cv = (f.result(timeout=TIMEOUT) for f in (fa, fb, fc))
    facts["t_matmul"] = time.monotonic() - t0
    facts["matmul_ok"] = bool(np.allclose(av @ bv, cv))
    facts["t_check"] = time.monotonic() - t0
    del fa, fb, fc, av, bv, cv, x
    facts["client_stats"] = _client_stats()
    return facts


def kill(client, name):
    """A worker SIGKILLed while a computation runs: Dask recomputes what it held; its store objects go."""
    import dask.array as da
    t0 = time.monotonic()
    n = 1536
    x = da.fromfunction(lambda i, j: ((i * n + j) % 1000) / 7.0, shape=(n, n), chunks=384, dtype=float)
    y = x.map_blocks(slow_copy)  # 16 blocks of 1.1 MiB, 0.3 s each: the kill lands while they run
    work = client.compute([y.sum(), y @ y.T], sync=False)
    pids = client.run(os.getpid)

    def blocks_done():
        return sum(f["stored"] for f in client.run(worker_facts).values()) >= 4
    wait_until(blocks_done, "a few blocks stored")
    victim = max(pids, key=lambda w: client.run(worker_facts, workers=[w])[w]["stored"])
    os.kill(pids[victim], signal.SIGKILL)
    t_kill = time.monotonic() - t0
    total, gram = (f.result(timeout=TIMEOUT) for f in work)
    t_done = time.monotonic() - t0
    host = ((np.arange(n * n).reshape(n, n) % 1000) / 7.0)
    facts = {"killed": pids[victim], "sum_ok": bool(np.isclose(total, host.sum(), rtol=1e-9)),
             "matmul_ok": bool(np.allclose(gram, host @ host.T)), "t_kill": t_kill, "t_done": t_done,
             "t_check": time.monotonic() - t0}
    del work
    wait_until(lambda: len(client.scheduler_info()["workers"]) == 2, "the nanny to restart the killed worker")
    facts["pids_after"] = sorted(client.run(os.getpid).values())
    facts["t_restarted"] = time.monotonic() - t0
    facts["killed_keys_left"] = [k for k in store_keys(name)[0] if k.startswith(f"dask/{pids[victim]}.")]
    facts["client_stats"] = _client_stats()
    return facts


def _client_stats():
    from shmstore.contrib.dask import transfer_stats
    return dict(transfer_stats)


def main():
    import distributed
    scenario, name, spill_dir = sys.argv[1:4]
    old = len(sys.argv) > 4 and sys.argv[4] == "old"
    settings = {"name": name, "capacity": "1GiB", "spill_dir": spill_dir}
    if old:
        data = (OldEncoded, settings)
    else:
        from shmstore.contrib.dask import ShmStoreData
        data = (ShmStoreData, settings)
    facts = {}
    t0 = time.monotonic()
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
                                  worker_dashboard_address=None, data=data) as cluster, \
            distributed.Client(cluster) as client:
        t_up = time.monotonic() - t0
        try:
            facts = {"compute": compute, "kill": kill}[scenario](client, name)
        except Exception as exc:
            facts["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            facts["workers"] = client.run(worker_facts)
        if "error" not in facts:  # every result released: each worker deletes its own objects
            wait_until(lambda: not any(f["len"] for f in client.run(worker_facts).values()),
                       "the workers to drop every key")
            wait_until(lambda: not store_keys(name)[0], "the store to hold no dask object")  # a dead worker's too
            facts["store_problems"] = store_keys(name)[1]
            facts["workers"] = client.run(worker_facts)
        facts["t_up"], facts["t_all"] = t_up, time.monotonic() - t0
    facts["t_closed"] = time.monotonic() - t0
    print(json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
