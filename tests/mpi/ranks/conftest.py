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
import stat
import tempfile
import time
import uuid

import pytest

mpi4py = pytest.importorskip("mpi4py")
from mpi4py import MPI  # noqa: E402

from shmstore.mpi import Cluster  # noqa: E402

from helpers import job_name  # noqa: E402

# every thread's Python stack on SIGUSR1: a rank whose lock wait timed out asks the holder for its stack. Into a
# file of this process, which the asking rank reads through /proc and prints: pytest captures this rank's stderr
# (fd 2) per test, and an aborted job never shows what it captured (a CI run printed the header and no stack).
# The file is unlinked at once, so an aborted job leaves nothing in /tmp.
_STACKS = tempfile.TemporaryFile("w+")  # noqa: SIM115 (open for the life of the rank)


def _stacks_of(pid: int) -> str:
    """What rank ``pid``'s faulthandler wrote into its unlinked stacks file (the first such file it holds)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not (os.readlink(path).endswith("(deleted)") and stat.S_ISREG(os.stat(path).st_mode)):
                continue  # never open a pipe or socket of another process: its read could wait forever
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if "Thread 0x" in text or "Current thread 0x" in text:
            return text
    return "(it wrote none)"


faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)


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
                print(_stacks_of(int(held.group(1))), file=sys.stderr, flush=True)
            except OSError as exc:
                print(f"(its stacks could not be had: {exc})", file=sys.stderr, flush=True)
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
