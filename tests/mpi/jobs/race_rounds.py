"""Rounds of the rank suite's two racing tests in one job: ``python -m mpi4py race_rounds.py NAME ROUNDS``.

tests/mpi/test_jobs.py runs two such jobs at once on the 2 cores, as "the suite run twice at once" does: the
contention under which both tests once failed (a migration dropped the only copy of a key's last write;
Cluster.delete left a copy a crossed registration misnamed) and single runs almost never did. Each round uses
fresh keys; the job prints ``ROUNDS OK`` on every rank when all passed (an assertion aborts the job).
"""
import os
import sys
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

from shmstore.mpi import Cluster  # noqa: E402
from tests.mpi.ranks import test_cluster as T  # noqa: E402

exact = T.test_directory_stays_exact_under_concurrent_put_fetch_migrate_delete
racing = T.test_racing_overwrites_deletes_fetches_and_migrations_keep_the_last_write

name, rounds = sys.argv[1], int(sys.argv[2])
with Cluster(name=name, capacity="256MiB", prefault="64MiB") as c:
    comm = c.comm
    for _ in range(rounds):
        for test in (racing, exact):
            key = comm.bcast("k" + uuid.uuid4().hex[:10] if comm.rank == 0 else None)
            test(c, comm, key)
            comm.Barrier()
    print(f"rank {c.rank}: ROUNDS OK", flush=True)
