"""An MPI job, run with automatic cleanup disabled, whose rank 2 (node n1's only rank: its service answers for
that node) is SIGKILLed while the other ranks run one operation over and over on objects that need node n1.

    mpiexec -disable-auto-cleanup -launcher fork -hosts n0:2,n1:1 -n 3 python -m mpi4py \
        survive_dead_rank.py NAME OP [KILL|STOP]

With four ranks (``-hosts n0:2,n1:2 -n 4``) rank 3 is a survivor on the dead rank's own node: it works on
objects node n0 holds whose home (their directory entry) is node n1, kept by the dead rank.

OP is one of get, get_many, fetch, migrate, delete, overwrite. Ranks 0 and 1 (node n0) work on objects that
only node n1 holds: rank 0 on keys whose home (their entry in the location directory) is node n0, rank 1 on
keys whose home is node n1. (Ranks on the dead rank's own node are no survivors: its launcher proxy kills
them, automatic cleanup or not.) Each survivor repeats OP (dropping what it fetched, so that the next call
fetches again) until a call raises: the kill lands during a call, mid-transfer where OP moves large objects
(rank 2 dies while its service sends). With STOP rank 2 hangs instead (SIGSTOP) until the survivors
are done.
Then it calls OP once more, on a key it has not used, now that rank 2 is known dead. It prints one line per
phase: ``RESULT rank op during|after raised SECONDS TYPE MESSAGE`` (the seconds that call took) or
``RESULT rank op during|after returned N``. A delete that returned must leave the key put-able on this node
(``EXISTS`` otherwise). Set SHMSTORE_PEER_TIMEOUT short: the test checks every survivor raised within it.
"""
from __future__ import annotations

import faulthandler
import os
import random
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from shmstore.errors import ObjectExistsError, ShmStoreError
from shmstore.mpi import Cluster
from shmstore.mpi.directory import home_of

VICTIM = 2
POOL = 100           # keys per survivor (migrate, delete and overwrite take a fresh one each call)
BIG = 1 << 20        # every other object: sent as frames (and by each holder to one node at a time)
SMALL = 1 << 10      # the others: inside a reply
PACE = 0.005        # seconds between calls: the pool outlasts the moment of the kill
GIVE_UP = 30.0       # seconds of repeating the operation before saying it never raised


def keys_for(rank: int) -> list[str]:
    """Rank ``rank``'s keys: their home is node n0 for rank 0, node n1 for ranks 1 and 3."""
    out, i = [], 0
    while len(out) < POOL:
        k = f"s{rank}-{i}"
        i += 1
        if home_of(k, 2) == rank % 2:
            out.append(k)
    return out


def value(i: int) -> np.ndarray:
    return np.full((BIG if i % 2 else SMALL) // 8, i, np.int64)


def step(c: Cluster, op: str, keys: list[str], i: int) -> None:
    """One call of ``op`` that needs node n1 (while it lives), and the local clean-up that lets the next call
    need it again."""
    k = keys[i % len(keys)]
    if op == "get":
        c.get(k)
        c.store.delete(k)
    elif op == "get_many":
        # a batch of small objects, or of large ones; the next of its kind (i + 2) takes the next 8: the call
        # after the kill gets keys the one it hit had not (that one may have landed its objects here before it
        # raised, at the registration with the dead home)
        kind = keys[(i % 2)::2]
        start = 8 * (i // 2) % (len(kind) - 7)
        batch = kind[start:start + 8]
        c.get_many(batch)
        for b in batch:
            c.store.delete(b)
    elif op == "fetch":
        c.fetch(k)
        c.store.delete(k)
    elif op == "migrate":
        c.migrate(k, c.node, keep_source=True)  # a fresh key each call: pulled from the other node
    elif op == "delete":
        c.delete(k)
        try:
            c.store.put(k, b"again")  # the delete returned: the key is free on this node
            c.store.delete(k)
        except ObjectExistsError as exc:
            print(f"EXISTS rank {c.rank} {k!r} after its delete returned: {exc}", flush=True)
    elif op == "overwrite":
        c.put(k, value(i), overwrite=True)  # the old copy on the other node goes
    else:
        raise SystemExit(f"unknown operation {op!r}")


def run(c: Cluster, op: str, keys: list[str], first: int, calls: int) -> tuple[str, int]:
    """Call ``op`` on keys from ``first`` on, ``calls`` times at most: the result line's tail and the next key."""
    i, end = first, time.monotonic() + GIVE_UP
    while i < first + calls and i < len(keys) and time.monotonic() < end:
        start = time.monotonic()
        try:
            step(c, op, keys, i)
        except ShmStoreError as exc:
            return f"raised {time.monotonic() - start:.2f} {type(exc).__name__} {exc}", i + 1
        i += 1
        time.sleep(PACE)
    return f"returned {i - first}", i


def kill_self(c: Cluster, op: str, how: signal.Signals) -> None:
    """Die (SIGKILL: nothing cleaned) or hang (SIGSTOP) mid-transfer where this node's service sends one, else
    after a moment."""
    service = c.service
    deadline = time.monotonic() + random.Random(c.store.name).uniform(0.05, 0.3)
    while time.monotonic() < deadline:
        if op in ("get", "fetch", "migrate") and service is not None and service.sending:
            break
        time.sleep(0.0005)
    print(f"{'killing' if how == signal.SIGKILL else 'stopping'} rank {c.rank} (leader of {c.node}) during {op}",
          flush=True)
    os.kill(os.getpid(), how)


def wait_for_each_other(survivors: MPI.Comm, limit: float = 10.0) -> None:
    """A barrier of the survivors, ``limit`` seconds at most (MPI itself may have aborted one of them)."""
    deadline, req = time.monotonic() + limit, survivors.Ibarrier()
    try:
        while not req.Test() and time.monotonic() < deadline:
            time.sleep(0.01)
    except MPI.Exception:
        pass


def main(name: str, op: str, how: signal.Signals) -> None:
    faulthandler.dump_traceback_later(GIVE_UP + 5, exit=False)  # where a hang is, in the test's output
    with Cluster(name=name, capacity="256MiB", prefault=0) as c:
        assert c.size in (3, 4) and c.nodes == ["n0", "n1"], (c.size, c.nodes)
        survivors = c.comm.Split(MPI.UNDEFINED if c.rank == VICTIM else 0, c.rank)
        victim = c.comm.bcast(os.getpid(), root=VICTIM)  # (one host: emulated nodes)
        if c.rank == VICTIM:  # every object ranks 0 and 1 use: only node n1 holds it
            for r in (0, 1):
                for i, k in enumerate(keys_for(r)):
                    c.put(k, value(i))
        if c.rank == 0 and c.size > 3:  # rank 3's (on the victim's node): only node n0 holds them
            for i, k in enumerate(keys_for(3)):
                c.put(k, value(i))
        c.barrier()
        if c.rank == VICTIM:
            threading.Thread(target=kill_self, args=(c, op, how), daemon=True).start()
            time.sleep(GIVE_UP)
        keys = keys_for(c.rank)
        during, nxt = run(c, op, keys, 0, len(keys))
        print(f"RESULT {c.rank} {op} during {during}", flush=True)
        after, _ = run(c, op, keys, nxt + 1, 1)  # a key not touched yet (the next one may be half done)
        print(f"RESULT {c.rank} {op} after {after}", flush=True)
        wait_for_each_other(survivors)  # rank 0 serves node n0: it stays until rank 1 is done too
        if c.rank == 0 and how == signal.SIGSTOP:
            os.kill(victim, signal.SIGKILL)  # the hung rank: the job ends with the survivors
        os._exit(0)  # no collective close: rank 2 is gone (the spill processes reclaim what this rank held)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], signal.Signals[f"SIG{sys.argv[3] if len(sys.argv) > 3 else 'KILL'}"])
