"""References across nodes: ``cluster.share(obj)`` on one node, the pickled Ref resolved by every rank of the
job (each node's ranks cause one transfer into it, whatever their number), by a plain process of a node that
has the copy, and ``ref.delete()`` ending every copy. Passes at any world size (one node: no transfer)."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest

import shmstore

CHILD = """
import pickle, sys, zlib
ref = pickle.loads(bytes.fromhex(sys.argv[1]))
print(zlib.crc32(memoryview(ref.get()).cast("B")))
"""


def crc(a) -> int:
    return zlib.crc32(memoryview(a).cast("B"))


def test_ranks_of_a_node_resolving_one_ref_cause_one_transfer_into_it(cluster, comm):
    data = np.random.default_rng(21).integers(0, 1 << 30, 2 << 20, dtype=np.int64)  # 16 MiB
    blob = pickle.dumps(cluster.share(data)) if comm.rank == cluster.leaders[0] else None
    blob = comm.bcast(blob, root=cluster.leaders[0])
    assert len(blob) < 300  # the handle travels, not the 16 MiB
    ref = pickle.loads(blob)
    assert ref.cluster and ref.node == cluster.nodes[0] and ref.key.startswith("@ref/")
    comm.Barrier()
    before = cluster.stats()
    comm.Barrier()
    crcs: list[int] = []
    failed: list[BaseException] = []

    def task() -> None:
        try:
            crcs.append(crc(ref.get()))
        except BaseException as exc:  # said below, with its traceback
            failed.append(exc)

    threads = [threading.Thread(target=task) for _ in range(2)]  # 2 tasks a rank
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if failed:
        raise failed[0]
    assert crcs == [crc(data)] * 2
    comm.Barrier()
    after = cluster.stats()
    transfers = after["transfers"] - before["transfers"]
    received = after["bytes_received"] - before["bytes_received"]
    here = cluster.node_index != 0
    assert (transfers, received) == ((1, data.nbytes) if here else (0, 0)), (cluster.node, before, after)
    assert sorted(cluster.locate(ref.key)) == sorted(cluster.nodes)

    # a plain process of this node (no MPI, no Cluster) resolves it from the node's copy, zero transfers
    if comm.rank in cluster.leaders:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI", "HYDRA"))}
        env["SHMSTORE_NODE"] = cluster.node
        out = subprocess.run([sys.executable, "-c", CHILD, blob.hex()], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) == crc(data)
    comm.Barrier()
    assert cluster.stats()["transfers"] == after["transfers"]

    comm.Barrier()
    if comm.rank == 0:
        assert ref.delete() >= 1  # every copy, whichever rank holds the Ref
    comm.Barrier()
    assert ref.key not in cluster.store
    with pytest.raises(shmstore.ObjectNotFoundError, match="was deleted"):
        ref.get()
    comm.Barrier()


def test_a_cluster_ref_in_a_with_block_is_deleted_everywhere_at_its_end(cluster, comm):
    root = cluster.leaders[-1]
    ref = comm.bcast(cluster.share({"step": 3, "w": np.arange(1000)}) if comm.rank == root else None, root=root)
    comm.Barrier()
    assert ref.get()["w"].sum() == 499500 and ref.get()["step"] == 3
    comm.Barrier()
    if comm.rank == root:
        with ref:
            pass
    comm.Barrier()
    assert ref.key not in cluster.store and cluster.locate(ref.key) == []
    comm.Barrier()


def test_cluster_get_many_takes_refs_among_keys(cluster, comm, key):
    """A ref shared on the first node, resolved in a get_many with keys by every rank (issue 35 item 3)."""
    leader = cluster.leaders[0]
    blob = pickle.dumps(cluster.share(np.arange(1000))) if comm.rank == leader else None
    if comm.rank == leader:
        cluster.put(key, np.ones(10))
    ref = pickle.loads(comm.bcast(blob, root=leader))
    comm.Barrier()
    a, b = cluster.get_many([ref, key])
    assert int(a[999]) == 999 and float(b.sum()) == 10.0 and np.array_equal(np.asarray(ref), np.arange(1000))
    del a, b
    comm.Barrier()
    if comm.rank == leader:
        ref.delete()
        cluster.delete(key)
    comm.Barrier()


def test_ref_get_with_a_timeout_gives_up_in_time_and_a_later_get_brings_it_whole(cluster, comm):
    """``ref.get(timeout=)`` (issue 35 item 3, Ray's ``ray.get(ref, timeout=)``): on a node without the object
    a timeout too short for its transfer raises GetTimeoutError (also a TimeoutError) at once, on every rank of
    the node (the rank that waited for the other's transfer too); the transfer given up leaves nothing behind:
    the next get without a timeout brings the object whole, once per node. On the node that holds it the same
    call answers at once. A bad timeout is refused."""
    data = np.random.default_rng(35).integers(0, 1 << 30, 4 << 20, dtype=np.int64)  # 32 MiB
    want = crc(data)
    root = cluster.leaders[-1]
    ref = comm.bcast(cluster.share(data) if comm.rank == root else None, root=root)
    comm.Barrier()
    before = cluster.stats()["transfers"]
    if cluster.node_index != len(cluster.nodes) - 1:
        with pytest.raises(shmstore.GetTimeoutError, match=r"did not finish within the timeout of 0 s") as caught:
            ref.get(timeout=0)
        assert isinstance(caught.value, TimeoutError) and ref.key in str(caught.value)
    comm.Barrier()  # no rank of the node fetches the object whole before every rank's timeout=0 get gave up
    assert crc(ref.get(timeout=0 if cluster.node_index == len(cluster.nodes) - 1 else 120)) == want
    with pytest.raises(shmstore.InvalidArgumentError, match="timeout"):
        ref.get(timeout=-1)
    comm.Barrier()
    moved = comm.allgather(cluster.stats()["transfers"] - before)
    if len(cluster.nodes) > 1:
        assert sum(moved) <= len(cluster.nodes) - 1 + comm.size, moved  # at most the given-up ones and one a node
    comm.Barrier()
    if comm.rank == root:
        ref.delete()
    comm.Barrier()


def test_a_get_that_gives_up_on_a_large_object_leaves_its_holder_nothing_to_wait_for(cluster, comm):
    """``ref.get(timeout=)`` giving up after its Data request went (the holder posts every frame all the same):
    the asking rank takes the frames into the space it set aside, so the holder's sends end and the object's
    pin goes at once. Before, the holder's sender waited ``peer_timeout`` (60 s) for frames nobody took, then
    kept them and the pin for the life of the process ("still hold store space"), and its close waited for
    them; and a delete right after a get that gave up its question could wait 60 s for it (its GAVE_UP came
    after the delete took the entry). Timeouts from 0.25 ms doubling until a get succeeds, until three gave up
    with frames under way."""
    import time

    from shmstore.mpi import abandon
    if len(cluster.nodes) < 2:
        pytest.skip("needs two nodes")

    def deleting(ref) -> None:
        """The delete settles the given-up fetch at once (it waited peer_timeout, 60 s, for its GAVE_UP)."""
        start = time.monotonic()
        ref.delete()
        assert time.monotonic() - start < 30
    root, getter = cluster.leaders[-1], 0
    data = np.arange(4 << 20, dtype=np.int64)  # 32 MiB
    given_up, attempts, timeout = 0, 0, 0.00025
    while True:
        ref = comm.bcast(cluster.share(data) if comm.rank == root else None, root=root)
        comm.Barrier()
        got = None
        if comm.rank == getter:
            before = abandon.stats()["given_up"]
            try:
                got = crc(ref.get(timeout=timeout))
            except shmstore.GetTimeoutError:
                pass
            given_up += abandon.stats()["given_up"] > before  # frames were under way (receives given up)
            timeout = 0.00025 if got is not None else timeout * 2
            attempts += 1
        if comm.bcast(given_up >= 3 or attempts >= 200, root=getter):
            break
        comm.Barrier()
        if comm.rank == root:
            deleting(ref)
        comm.Barrier()
    comm.Barrier()
    if comm.rank == root:
        deleting(ref)
    if comm.bcast(given_up, root=getter) == 0:
        pytest.skip(f"no get gave up with its frames under way in {attempts} tries (this machine too fast)")
    deadline = time.monotonic() + 30  # far less than peer_timeout (60 s): the sends end as the frames land
    service = cluster._service
    while time.monotonic() < deadline and (abandon.held() or (service is not None and service.sending)):
        time.sleep(0.05)
    assert not abandon.held(), (comm.rank, abandon.stats())
    assert service is None or not service.sending, comm.rank
    comm.Barrier()


def test_a_get_that_gives_up_before_its_answer_leaves_no_pin_at_the_holder(cluster, comm):
    """``ref.get(timeout=)`` giving up its first question before the answer came: the holder pinned the large
    object for a Data request that never comes, or pushed its frame with the answer (``T.PUSH_MAX``). The
    asking rank takes that late answer, though it makes no call afterwards (a sweeper looks every 0.2 s while
    answers may come), and gives the pin back (a Release), or takes the frame and drops it (the holder's send
    ends, and its pin); before, the holder kept the pin, and the deleted object's memory with it, for
    ``HANDLE_TTL`` (120 s), or for ever (a pushed frame nobody takes: MPI cannot cancel a send), or until the
    asking rank's next call."""
    import time

    from shmstore.mpi import abandon
    from shmstore.mpi import tags as T
    if len(cluster.nodes) < 2:
        pytest.skip("needs two nodes")
    root, getter = cluster.leaders[-1], 0
    sizes = [T.PUSH_MAX, T.PUSH_MAX // 4, T.PUSH_MAX + (1 << 20)]  # pushed, pushed, pinned for a Data request
    refs = [comm.bcast(cluster.share(np.full(sizes[i % 3] // 8, i, np.int64)) if comm.rank == root else None,
                       root=root) for i in range(12)]  # a transfer each, not inline
    comm.Barrier()
    gave_up = 0
    if comm.rank == getter:
        for ref in refs:
            try:
                ref.get(timeout=0.0002)  # gives up with its question under way
            except shmstore.GetTimeoutError:
                gave_up += 1
    comm.Barrier()  # no call of the asking rank's takes the answers (a barrier is no call to a service)
    if comm.rank == root:
        for ref in refs:
            ref.delete()
    gave_up = comm.bcast(gave_up, root=getter)
    if gave_up == 0:
        pytest.skip("no get gave up (this machine too fast)")
    pins = None
    if comm.rank == root:
        service = cluster._service
        deadline = time.monotonic() + 30  # far less than HANDLE_TTL and than peer_timeout (60 s)
        while time.monotonic() < deadline and (service._leases or service._pushes or abandon.held()):
            time.sleep(0.05)
        pins = (len(service._leases), len(service._pushes), abandon.held())
    pins = comm.bcast(pins, root=root)
    assert pins == (0, 0, 0), f"the holder still pins (handles, pushed frames, given-up sends) {pins} after " \
                              f"{gave_up} give-ups"
    if comm.rank == getter:
        assert abandon.wait_released(30), abandon.stats()  # the drained frames landed
    comm.Barrier()


def test_ranks_of_a_node_getting_one_pushed_object_at_once_land_it_once_and_leave_no_pin(cluster, comm):
    """Objects up to ``T.PUSH_MAX`` come as a frame pushed with the lookup's answer. Every rank of a node
    asking for one at once: each holder pushes to each asker; one rank lands it (one transfer into the node,
    checksummed), the others drop their frames, and no pin or receive is left anywhere."""
    import time

    from shmstore.mpi import abandon
    from shmstore.mpi import tags as T
    if len(cluster.nodes) < 2:
        pytest.skip("needs two nodes")
    root = cluster.leaders[-1]
    rng = np.random.default_rng(36)
    datas = [rng.integers(0, 1 << 60, n // 8, dtype=np.int64) for n in (1 << 20, T.PUSH_MAX, 3 << 20)] * 3
    for i, data in enumerate(datas):
        ref = comm.bcast(cluster.share(data) if comm.rank == root else None, root=root)
        comm.Barrier()
        before = cluster.stats()
        comm.Barrier()
        got = ref.get()
        assert crc(got) == crc(data), (i, comm.rank)
        del got
        comm.Barrier()
        after = cluster.stats()
        here = cluster.node_index != cluster.nodes.index(ref.node)
        landed = (after["transfers"] - before["transfers"], after["bytes_received"] - before["bytes_received"])
        assert landed == ((1, data.nbytes) if here else (0, 0)), (i, cluster.node)
        comm.Barrier()
        if comm.rank == root:
            ref.delete()
        comm.Barrier()
    service = cluster._service
    deadline = time.monotonic() + 30  # far less than peer_timeout (60 s): the sends end as the frames land
    while time.monotonic() < deadline and (abandon.held() or (service is not None and service._pushes)):
        time.sleep(0.05)
    assert not abandon.held(), (comm.rank, abandon.stats())
    assert service is None or not service._pushes, comm.rank
    comm.Barrier()


def test_a_bounded_call_ends_every_wait_at_its_end(cluster, comm):
    """rpc.bounded, which ref.get(timeout=) and Cluster.get(timeout=) use: a reply that never comes, and
    frames that never come, end at the bound (0.3 s) though peer_timeout is 60 s, with GetTimeoutError."""
    import time

    from mpi4py import MPI

    from shmstore.mpi import wire as W
    from shmstore.mpi.abandon import give_up
    from shmstore.mpi.rpc import Messenger, bounded

    from helpers import drain
    silent = comm.Dup()  # no service reads it: every reply waits for ever, but for the deadline
    peer = (comm.rank + 1) % comm.size
    m = Messenger(silent, ["far"], [peer], 0.0, timeout=60.0)
    try:
        start = time.monotonic()
        with pytest.raises(shmstore.GetTimeoutError, match=r"within the timeout of 0\.3 s it was given \(a lookup "
                           r"many request to node 'far' was under way"), bounded(0.3):
            m.call(0, W.LookupMany(["k"], 0))  # a batch's request: sent without blocking (on one rank: to itself)
        assert 0.3 <= time.monotonic() - start < 5.0
        buf = np.empty(8, np.uint8)
        reqs = [silent.Irecv([buf, MPI.BYTE], source=peer, tag=77)]
        start = time.monotonic()
        with pytest.raises(shmstore.GetTimeoutError, match=r"a transfer from node 'far' was under way"), \
                bounded(0.3):
            m.wait(reqs, 0, "k")
        assert 0.3 <= time.monotonic() - start < 5.0
        assert give_up(reqs, keep=buf)
        comm.Barrier()  # every rank's requests are out: take them (MPI warns of messages never received)
        drain(silent)
    finally:
        m.stop_watching()  # its sweeper of late replies leaves before the communicator goes
        silent.Free()
