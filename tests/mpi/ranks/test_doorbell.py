"""The idle node service's doorbell (``shmstore/mpi/doorbell.py``) across the job's ranks: requests after
silence are answered whether they ring or not (a lost ring costs only the safety net's delay), and a service
that was rung awake serves what comes next; a service whose rank computes in Python gets the GIL at a short
interval while requests come, and only then. Correctness only: the latency it buys is measured by
``scripts/bench_latency.py``."""
from __future__ import annotations

import sys
import time

import numpy as np

from shmstore.mpi.doorbell import RING_AFTER, SAFETY


def test_gets_after_silence_are_answered_rung_or_not(cluster, comm, key):
    holder = cluster.leaders[-1]
    if comm.rank == holder:
        for i in range(8):
            cluster.put(f"{key}-{i}", np.full(4, i))
    comm.Barrier()
    msg = cluster._msg
    bells = msg.bells
    rings = bells.rings if bells is not None else 0
    try:
        for i in range(8):
            if i % 2:
                msg.bells = None  # this rank rings nothing: the service's safety net must still see it
            time.sleep(max(SAFETY, RING_AFTER) * 3)  # silence: the holder's service back asleep
            assert int(cluster.get(f"{key}-{i}")[0]) == i
            msg.bells = bells
    finally:
        msg.bells = bells
    # after silence, the gets of the even turns rang: on every node but the holder's, one rank at least (the
    # other ranks of a node find the object fetched already when one of them was first, which under load may
    # be the same rank every turn)
    rung = comm.allgather((cluster.node_index, bells is not None, (bells.rings - rings) if bells is not None else 0))
    for node in range(len(cluster.nodes) - 1):
        if all(has for n, has, _ in rung if n == node):
            assert sum(r for n, _, r in rung if n == node) > 0, rung
    comm.Barrier()
    if comm.rank == holder:
        for i in range(8):
            cluster.delete(f"{key}-{i}")


def test_a_holder_computing_in_python_lends_the_gil_at_a_short_interval_while_requests_come_and_only_then(
        cluster, comm, key):
    """The holder's main thread runs pure Python (the GIL held but at the switch interval) while another rank
    gets objects from it: its node service has the interval lowered to ``URGENT_GIL`` while it handles them
    (each of its MPI calls gave the GIL away, and took the default 5 ms to get it back: gets took 8-10 ms), and
    the application's own interval is back once the service is idle.

    The getter starts once the holder computes (before, on 2 cores, all its gets could end while the holder's
    main thread had not yet left the barrier: nothing to see, CI failed), and gets 30 more objects while the
    holder has not seen the lowered interval, up to 10 times: the holder looks between two 50 us stretches of
    Python, and the service's lowered windows are the few stretches its MPI calls leave to the main thread."""
    from shmstore.mpi.poll import URGENT_GIL
    if len(cluster.nodes) < 2:
        import pytest
        pytest.skip("needs two nodes")
    holder, getter, n, turns = cluster.leaders[-1], 0, 30, 10
    computing, asking, answer = 71, 72, 73  # tags
    if comm.rank == holder:
        for i in range(n * turns):
            cluster.put(f"{key}-{i}", np.full(4, i))
    comm.Barrier()
    if comm.rank == holder:
        default, seen, lowered = sys.getswitchinterval(), set(), False
        deadline = time.monotonic() + 120
        sum(i * i for i in range(1000))
        comm.send(None, dest=getter, tag=computing)
        while True:
            sum(i * i for i in range(1000))  # pure Python: holds the GIL (~50 us: a look each)
            seen.add(sys.getswitchinterval())
            lowered = lowered or any(abs(s - URGENT_GIL) < 1e-7 for s in seen)  # (microseconds inside)
            if comm.Iprobe(source=getter, tag=asking):
                if comm.recv(source=getter, tag=asking) == "done":
                    break
                comm.send(lowered, dest=getter, tag=answer)
            assert time.monotonic() < deadline, "the gets did not end"
        assert lowered, seen
        back = False  # the service idle again (its window after the last request closes); read once a turn: an
        while not back and time.monotonic() < deadline:  # idle service's look lowers it for an instant
            back = sys.getswitchinterval() == default
            time.sleep(0.01)
        assert back, sys.getswitchinterval()
    elif comm.rank == getter:
        comm.recv(source=holder, tag=computing)
        for turn in range(turns):
            for i in range(turn * n, (turn + 1) * n):
                assert int(cluster.get(f"{key}-{i}")[0]) == i
            comm.send("seen?", dest=holder, tag=asking)
            if comm.recv(source=holder, tag=answer):
                break
        comm.send("done", dest=holder, tag=asking)
    comm.Barrier()
    if comm.rank == holder:
        for i in range(n * turns):
            cluster.delete(f"{key}-{i}")
