"""MPI tests: run on one rank by plain pytest, on 4 ranks / 2 nodes by mpi/run-tests.sh.

Every rank runs every test in the same order, so collectives line up. The
shared-memory leak check of tests/conftest.py is replaced here (other ranks
create and remove segments concurrently); the launcher test checks that an
MPI job leaves nothing behind.
"""
from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
import uuid

import pytest

mpi4py = pytest.importorskip("mpi4py")
from mpi4py import MPI  # noqa: E402

from shmstore.mpi import Cluster  # noqa: E402

from helpers import job_name  # noqa: E402

# every thread's Python stack on SIGUSR1: a rank whose lock wait timed out asks the holder for its stack
faulthandler.register(signal.SIGUSR1, all_threads=True)


@pytest.fixture(autouse=True)
def no_leaks():
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure on one rank would leave the others waiting in a collective: abort the job."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and MPI.COMM_WORLD.size > 1:
        import sys
        print(f"\nrank {MPI.COMM_WORLD.rank}: {item.nodeid} failed:\n{report.longreprtext}", file=sys.stderr,
              flush=True)
        held = re.search(r"LockTimeoutError: .* of pid (\d+) \(python -m mpi4py", report.longreprtext)
        if held and int(held.group(1)) != os.getpid():  # another rank of this node: where is it?
            print(f"rank {MPI.COMM_WORLD.rank}: the holder's stacks (pid {held.group(1)}) follow", file=sys.stderr,
                  flush=True)
            try:
                os.kill(int(held.group(1)), signal.SIGUSR1)
                time.sleep(2)
            except OSError:
                pass
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture(scope="module")
def cluster():
    name = job_name("m")
    with Cluster(name=name, capacity="256MiB", prefault="64MiB") as c:
        yield c


@pytest.fixture
def comm(cluster):
    """The cluster's private communicator (for test-side barriers)."""
    return cluster.comm


def pytest_collection_modifyitems(config, items):
    """Every test is an MPI test; its time limit grows with the ranks per core (a 64-rank job on a 2-core
    machine runs each rank a 32nd of the time: the racing test took over 120 s there)."""
    import math
    import os
    scale = max(1, math.ceil(MPI.COMM_WORLD.size / (4 * (os.cpu_count() or 1))))
    base = config.getini("timeout") or 120
    for item in items:
        item.add_marker(pytest.mark.mpi)
        marker = item.get_closest_marker("timeout")
        if scale > 1:
            item.add_marker(pytest.mark.timeout(float(marker.args[0] if marker and marker.args else base) * scale))


@pytest.fixture
def key(cluster, comm):
    """A fresh key, the same on every rank; every copy of it is deleted after the test.

    The teardown every test would otherwise repeat: all ranks done with it,
    rank 0 deletes it everywhere, all ranks see it gone.
    """
    k = comm.bcast("k" + uuid.uuid4().hex[:10] if comm.rank == 0 else None)
    yield k
    comm.Barrier()
    if comm.rank == 0:
        cluster.delete(k)
    comm.Barrier()
