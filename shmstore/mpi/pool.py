"""One Cluster over an ``mpi4py.futures`` pool: its main process and its workers, for Refs across nodes.

Under ``mpiexec -n N python -m mpi4py.futures script.py`` rank 0 runs the
script and ranks 1..N-1 serve its ``MPIPoolExecutor`` tasks; no rank but 0
runs the script, so no code of the script can open the collective
``Cluster`` on the workers. This module opens one over ``MPI.COMM_WORLD``
at the pool's start instead: the workers in the executor's initializer,
the main process beside them::

    from mpi4py.futures import MPIPoolExecutor
    from shmstore.mpi import pool

    with MPIPoolExecutor(**pool.worker_setup(name="run42")) as ex:
        cluster = pool.open_cluster(ex, name="run42")
        ref = cluster.share(big_array)
        results = list(ex.map(task, [ref] * 64))   # task: ref.get(); one transfer per node

A task's ``ref.get()`` finds the worker's Cluster (``Cluster.opened``): a
local hit, or one deduplicated transfer into its node. The Cluster lives
until the processes exit and closes then, collectively, on every rank (the
workers leave their task loop only when the main script has ended, so no
earlier close could meet theirs). Only the shared pool of ``python -m
mpi4py.futures`` (every rank in ``MPI.COMM_WORLD``) is supported; a pool of
spawned workers is another world.
"""
from __future__ import annotations

import atexit
from typing import Any

from mpi4py import MPI

from .. import errors
from .cluster import Cluster

__all__ = ["worker_setup", "open_cluster", "join"]

_cluster: Cluster | None = None


def join(connect_kwargs: dict[str, Any]) -> Cluster:
    """Open (once per process) the Cluster over ``MPI.COMM_WORLD`` with ``connect_kwargs``; collective over
    every rank, closed collectively at exit. The workers' initializer (see :func:`worker_setup`)."""
    global _cluster
    if _cluster is None:
        _cluster = Cluster(MPI.COMM_WORLD, **connect_kwargs)
        atexit.register(_close)
    return _cluster


def worker_setup(**connect_kwargs: Any) -> dict[str, Any]:
    """The ``MPIPoolExecutor`` keywords that make each worker join the pool's Cluster at its start."""
    return {"initializer": join, "initargs": (connect_kwargs,)}


def open_cluster(executor: Any, **connect_kwargs: Any) -> Cluster:
    """On the main process: start ``executor``'s workers (made with :func:`worker_setup` and the same
    ``connect_kwargs``) and open the Cluster with them.

    Raises:
        InvalidArgumentError: the job has a single process or this is not its rank 0 (run the script under
            ``mpiexec -n N python -m mpi4py.futures``), or the executor was not made with :func:`worker_setup`.
    """
    world = MPI.COMM_WORLD
    if world.size < 2 or world.rank != 0:
        raise errors.InvalidArgumentError(f"a pool Cluster needs the main process at rank 0 of a world of at "
                                          f"least 2 ranks (this is rank {world.rank} of {world.size}): run "
                                          f"the script as mpiexec -n N python -m mpi4py.futures script.py")
    options = getattr(executor, "_options", None)  # mpi4py's record of the executor's keywords
    if isinstance(options, dict) and options.get("initializer") is not join:
        raise errors.InvalidArgumentError("the executor's workers would never join the Cluster (this call would "
                                          "wait for ever): make it MPIPoolExecutor(**pool.worker_setup(...)) with "
                                          "the same settings")
    # the workers run the initializer, which meets this rank in the collective
    executor.bootup(wait=False)
    return join(connect_kwargs)


def _close() -> None:
    """At exit, on every rank: the workers' task loops have ended, so every rank gets here."""
    global _cluster
    cluster, _cluster = _cluster, None
    if cluster is not None:
        cluster.close()
