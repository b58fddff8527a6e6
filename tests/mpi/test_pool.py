"""shmstore.mpi.pool on one process (the pool itself runs in tests/mpi/test_jobs.py): what it hands the executor,
and the clear refusals that keep a misused pool from waiting for ever."""
from __future__ import annotations

import pytest

pytest.importorskip("mpi4py")

import shmstore  # noqa: E402
from shmstore.mpi import pool  # noqa: E402


def test_worker_setup_makes_each_worker_join_with_the_same_settings():
    assert pool.worker_setup(name="x", capacity="1GiB") == {"initializer": pool.join,
                                                           "initargs": ({"name": "x", "capacity": "1GiB"},)}


def test_open_cluster_outside_an_mpi4py_futures_job_says_how_to_launch():
    with pytest.raises(shmstore.InvalidArgumentError, match="python -m mpi4py.futures"):
        pool.open_cluster(object(), name="x")
