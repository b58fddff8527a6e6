"""Two nodes fetching from each other while both nodes' levels are full: MEMORY here, GPU where a device is.

The deadlock storage services of this kind hit on GPUs (Xorbits #488, the
seeds' "GPU transfer deadlock" in DESIGN.md): a node's storage handler,
fetching a batch from another node under its own lock, asked itself for
room with spill on the device while the other node's handler did the same
the other way, each waiting on the other. Here every node's level is above its high
watermark, each node's object is on that level, and every node fetches its
neighbour's object onto the same level at once: each landing needs the
destination's spill process to make room while the destination's service
sends its own object away. It must finish (a deadlock would end in a
``TransferError`` after ``peer_timeout``, or in the test's timeout).

The MEMORY case runs everywhere (``mpi/run-tests.sh``, and on one rank);
the GPU case needs CuPy and a device (``scripts/gpu-check.sh`` runs it on
two emulated nodes) and skips with the reason elsewhere.
"""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from shmstore import Level
from shmstore.levels.gpu import cupy_or_reason
from shmstore.mpi import Cluster

from helpers import job_name

MiB = 1 << 20
_, NO_GPU = cupy_or_reason()
needs_device = pytest.mark.skipif(NO_GPU is not None, reason=f"GPU level unavailable: {NO_GPU}")
CAPACITY = {Level.MEMORY: 256 * MiB, Level.GPU: 64 * MiB}


@pytest.fixture(scope="module")
def full_cluster():
    """A cluster whose levels fill quickly (a GPU level of 64 MiB where a device is); a deadlock among its
    nodes ends in TransferError after 30 s instead of hanging the job."""
    name = job_name("f")
    sizes = {"gpu_capacity": "64MiB"} if NO_GPU is None else {}
    with Cluster(name=name, capacity="256MiB", prefault="64MiB", peer_timeout=30, spill_timeout=30, **sizes) as c:
        yield c


def _array(level: Level, n: int, fill: float):
    if level == Level.GPU:
        import cupy
        return cupy.full(n, fill, cupy.float32)
    return np.full(n, fill, np.float32)


@pytest.mark.parametrize("level", [pytest.param(Level.MEMORY, id="memory"),
                                   pytest.param(Level.GPU, id="gpu", marks=[pytest.mark.gpu, needs_device])])
def test_nodes_fetching_from_each_other_while_their_levels_are_full_do_not_deadlock(full_cluster, level):
    c = full_cluster
    comm = c.comm
    key = comm.bcast("k" + uuid.uuid4().hex[:8] if comm.rank == 0 else None)
    cap = CAPACITY[level]
    mine = f"{key}-{c.node}"
    leader = comm.rank == c.leaders[c.node_index]
    if leader:
        for i in range(12):  # spillable data: 12/16 of the level, then this node's object, 2/16 more
            c.put(f"{mine}-fill{i}", _array(level, cap // 16 // 4, i), levels=[level])
        c.put(mine, _array(level, cap // 8 // 4, c.node_index), levels=[level])
        assert c.store.get_info(mine).level == level
    comm.Barrier()
    other = (c.node_index + 1) % len(c.nodes)
    theirs = f"{key}-{c.nodes[other]}"
    got = c.get(theirs, levels=[level])  # room is made on this node's level while this node sends its own
    assert float(got[0]) == other and float(got[-1]) == other
    del got
    assert c.store.get_info(theirs).level == level
    comm.Barrier()
    if leader:
        for i in range(12):
            c.store.delete(f"{mine}-fill{i}")
    comm.Barrier()
    if comm.rank == 0:
        for n in c.nodes:
            c.delete(f"{key}-{n}")
    comm.Barrier()
    assert c.store.check() == []
