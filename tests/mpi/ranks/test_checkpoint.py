"""Cluster.checkpoint / Cluster.restore on every rank (issue 34): each rank's objects, a partner node's copy,
the folder; restore by key on any rank, from the nearest whole copy."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import pytest
from mpi4py import MPI

from shmstore.checkpoint import bundle_key
from shmstore.errors import CheckpointError
from shmstore.mpi import Cluster
from shmstore.persist import folder

from helpers import job_name


@pytest.fixture(scope="module")
def ckc():
    world = MPI.COMM_WORLD
    where = world.bcast(tempfile.mkdtemp(prefix="shmstore-ck-") if world.rank == 0 else None)
    name = job_name("c")
    with Cluster(name=name, capacity="256MiB", prefault="32MiB", persist_dir=where, checkpoint_keep=2) as c:
        yield c
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(where, ignore_errors=True)


def _mine(rank: int, step: int) -> dict:
    return {f"r{rank}.w{i}": np.full(50_000 + i, rank * 1000 + step * 10 + i, np.float64) for i in range(4)} | \
        {f"r{rank}.meta": {"rank": rank, "step": step}}


def _check_all(got, size: int, step: int) -> None:
    for r in range(size):
        for i in range(4):
            v = got[f"r{r}.w{i}"]
            assert v.shape == (50_000 + i,) and v[0] == v[-1] == r * 1000 + step * 10 + i, (r, i)
        assert got[f"r{r}.meta"] == {"rank": r, "step": step}


def test_every_rank_restores_every_key_of_a_checkpoint_and_each_part_has_a_partner_copy(ckc):
    comm = ckc.comm
    t = time.perf_counter()
    ck = ckc.checkpoint("s1", _mine(comm.rank, 1))
    blocked = time.perf_counter() - t
    assert ck.wait(120) and ck.done(), blocked
    comm.Barrier()
    got = ckc.restore()
    assert got.name == "s1" and len(got) == 5 * comm.size
    _check_all(got, comm.size, 1)
    if len(ckc.nodes) > 1:  # node i's part is also in node i+1's store
        where = ckc.locate(bundle_key(ck.id, f"r{comm.rank}"))
        nxt = ckc.nodes[(ckc.node_index + 1) % len(ckc.nodes)]
        assert ckc.node in where and nxt in where, where
    del got
    comm.Barrier()


def test_a_key_given_by_two_ranks_fails_the_checkpoint_on_every_rank_and_keeps_nothing(ckc):
    comm = ckc.comm
    if comm.size < 2:
        pytest.skip("needs two ranks")
    # the node's store is shared: list it while no rank of the node is in a checkpoint (this one's puts, the
    # next test's), i.e. between barriers
    comm.Barrier()
    before = {i.key for i in ckc.store.kernel.list(hidden=True)}
    comm.Barrier()
    with pytest.raises(CheckpointError, match="'same' given by ranks 0 and 1"):
        ckc.checkpoint("dup", {"same": comm.rank} if comm.rank < 2 else {f"x{comm.rank}": 1})
    comm.Barrier()
    after = {i.key for i in ckc.store.kernel.list(hidden=True)}
    comm.Barrier()
    assert after <= before
    assert not [d for d in os.listdir(ckc.store.config.persist_dir) if d.startswith("dup@")]


def test_a_node_that_lost_its_copies_and_a_damaged_folder_restore_from_the_partner(ckc):
    comm = ckc.comm
    ck = ckc.checkpoint("s2", _mine(comm.rank, 2))
    assert ck.wait(120)
    comm.Barrier()
    m = folder.latest(ckc.store.config.persist_dir)
    assert m.id == ck.id
    if len(ckc.nodes) < 2:
        got = ckc.restore()
        _check_all(got, comm.size, 2)
        del got
        return
    # node 0 loses its own part (its store's copies deleted) and the folder's copy of it is damaged: node 0's
    # objects must come from node 1 (the partner); any other answer would be a wrong value or an error
    if ckc.node_index == 0 and ckc.leaders[0] == comm.rank:
        mine = [bundle_key(ck.id, b) for b, part in m.data["bundles"].items() if part == 0]
        assert ckc.store.delete_many(mine) == len(mine)
    if comm.rank == 0:
        with open(os.path.join(m.path, "part-00000.bin"), "r+b") as f:
            f.write(b"\xff" * 4096 * 4)
    comm.Barrier()
    got = ckc.restore("s2")
    _check_all(got, comm.size, 2)
    lost = [k for k in got if got.manifest.keys[k] == 0]
    # node 1 holds them (the partner copy); node 0 fetched them from there (a second rank of node 0 may find the
    # first one's fetched copy in its own store); never the damaged folder
    assert {got.origins[k] for k in lost} <= ({"nodes", "store"} if ckc.node_index == 0 else {"store"})
    del got
    comm.Barrier()


def test_a_cluster_closed_right_after_its_checkpoint_finishes_the_partner_copy_first():
    """The ranks go on after the put; the publish and the partner copy run in a thread. A job that closes its
    cluster at once (no ``wait``) still leaves node i's part in node i+1's store: close waits for it (the
    copy needs the other node's service, which close stops). The stores are persistent here, to look."""
    import shmstore
    from shmstore.store import observe
    world = MPI.COMM_WORLD
    where = world.bcast(tempfile.mkdtemp(prefix="shmstore-ck-") if world.rank == 0 else None)
    name = job_name("c")
    with Cluster(name=name, capacity="512MiB", prefault="16MiB", persist=True, persist_dir=where) as c:
        big = {f"r{c.comm.rank}.big{i}": np.full(8 << 20, i, np.uint8) for i in range(8)}  # 64 MiB a rank
        ck = c.checkpoint("quick", _mine(c.comm.rank, 3) | big)
        cid, nodes, me, leader = ck.id, list(c.nodes), c.node_index, c.leaders[c.node_index] == c.comm.rank
        node_of = c.comm.allgather(me)
    try:
        if leader:
            prev = (me - 1) % len(nodes)
            want = {bundle_key(cid, f"r{r}") for r, n in enumerate(node_of) if n == me or (len(nodes) > 1 and
                                                                                          n == prev)}
            with observe(name, node=nodes[me]) as s:
                held = {i.key for i in s.kernel.list(hidden=True)}
            assert want <= held, (sorted(want - held), sorted(held))
            assert wait_for_manifest(where, 120)
    finally:
        world.Barrier()
        if leader:
            shmstore.destroy(name, force=True, node=nodes[me])
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(where, ignore_errors=True)


def wait_for_manifest(where: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while folder.latest(where) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
