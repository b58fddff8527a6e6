"""Object references (shmstore/refs.py): ``store.share(obj) -> Ref``, resolved in other processes through the
executors users hand them to (concurrent.futures, multiprocessing, joblib, Dask), deleted explicitly or by a
with-block, and a clear error once deleted. Real processes and real shared memory throughout."""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import zlib

import numpy as np
import pytest

import shmstore
from shmstore import refs
from shmstore.refs import PREFIX, Ref

N = 1 << 20  # float64: 8 MiB


@pytest.fixture(autouse=True)
def executors_trackers():
    """Spawned executors start multiprocessing's (and loky's) resource tracker, a process that would live as
    long as this one: stop them after each test, before the leak check looks for child processes."""
    yield
    from multiprocessing import resource_tracker
    resource_tracker._resource_tracker._stop()
    try:
        from joblib.externals.loky.backend import resource_tracker as loky_tracker
    except ImportError:
        return
    loky_tracker._resource_tracker._stop()


def _data() -> np.ndarray:
    return np.random.default_rng(21).standard_normal(N)


def crc_of(ref: Ref, start: int = 0) -> tuple[int, str, bool]:
    """What a task does: read the shared value, checksum it, say what it got and whether it was a copy."""
    a = ref.get()
    return zlib.crc32(memoryview(a[start:]).cast("B")), type(a).__name__, bool(a.flags.writeable)


def crc_of_index(ref: Ref, i: int) -> int:
    return zlib.crc32(memoryview(ref.get()[i:]).cast("B"))


def deleted_message(ref: Ref) -> str:
    try:
        ref.get()
    except shmstore.ObjectNotFoundError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "resolved"


def test_share_puts_once_under_a_reserved_key_that_keys_show(store):
    ref = store.share({"w": np.arange(10)})
    assert ref.key.startswith(PREFIX) and len(ref.key) == len(PREFIX) + 32
    assert store.keys() == [ref.key]
    assert (ref.name, ref.session, ref.node, ref.cluster) == (store.name, store.session, store.node, False)
    assert ref.get()["w"].tolist() == list(range(10)) and ref.value["w"][3] == 3
    assert store.share(1).key != store.share(1).key  # every share is a new object
    assert len(store.keys()) == 3


def test_pickle_carries_only_the_handle_and_resolves_zero_copy(store):
    data = _data()
    ref = store.share(data)
    blob = pickle.dumps(ref)
    assert len(blob) < 300  # the handle, never the 8 MiB
    back = pickle.loads(blob)
    assert back == ref and hash(back) == hash(ref) and "@ref/" in repr(back)
    got = back.get()
    assert isinstance(got, shmstore.SharedArray) and not got.flags.writeable  # a view into the store
    assert zlib.crc32(memoryview(got).cast("B")) == zlib.crc32(memoryview(data).cast("B"))
    del got


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_resolves_in_process_pool_workers(store, method):
    data = _data()
    ref = store.share(data)
    ctx = mp.get_context(method)
    with cf.ProcessPoolExecutor(2, mp_context=ctx) as ex:
        out = list(ex.map(crc_of, [ref] * 4, [0, 1, 2, 3], timeout=60))
    for i, (crc, kind, writeable) in enumerate(out):
        assert crc == zlib.crc32(memoryview(data[i:]).cast("B"))
        assert (kind, writeable) == ("SharedArray", False)  # zero-copy in the worker too
    assert store.keys() == [ref.key]  # the workers only read


def test_resolves_in_a_multiprocessing_pool(store):
    data = _data()
    ref = store.share(data)
    with mp.get_context("spawn").Pool(2) as pool:
        crcs = pool.starmap(crc_of_index, [(ref, i) for i in range(4)])
        pool.close()
        pool.join()
    assert crcs == [zlib.crc32(memoryview(data[i:]).cast("B")) for i in range(4)]


def _wait_for_file(path: str) -> bool:
    """A task that holds its worker until ``path`` exists (60 s at most)."""
    import time
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_dropped_ref_keeps_its_object_for_a_queued_task(store, tmp_path):
    """The lifetime is explicit, not Ray's owner-based one (README, References): the sharer's only Ref is
    dropped and collected while a queued task holds the only other copy, pickled; the task still reads it."""
    import gc
    import time

    data = _data()
    go = str(tmp_path / "go")
    with mp.get_context("spawn").Pool(1) as pool:
        holding = pool.apply_async(_wait_for_file, (go,))  # the only worker is busy: the next task waits

        def queue_one() -> mp.pool.AsyncResult:
            return pool.apply_async(crc_of_index, (store.share(data), 0))  # no other Ref kept here

        queued = queue_one()
        time.sleep(0.5)  # the pool's task thread has sent it: the pickled handle is its only copy
        gc.collect()
        open(go, "w").close()
        assert holding.get(timeout=120)
        assert queued.get(timeout=120) == zlib.crc32(memoryview(data).cast("B"))
        pool.close()
        pool.join()
    assert [k for k in store.keys() if k.startswith(PREFIX)]  # still there until delete or the store's end


def test_resolves_in_joblib_workers(store):
    joblib = pytest.importorskip("joblib")
    from joblib.externals.loky import get_reusable_executor

    data = _data()
    ref = store.share(data)
    try:
        crcs = joblib.Parallel(n_jobs=2, backend="loky", timeout=60)(
            joblib.delayed(crc_of_index)(ref, i) for i in range(4))
    finally:
        get_reusable_executor().shutdown(wait=True)  # loky keeps its workers for the next call otherwise
    assert crcs == [zlib.crc32(memoryview(data[i:]).cast("B")) for i in range(4)]


def test_resolves_in_dask_process_workers(store):
    dask = pytest.importorskip("dask")
    data = _data()
    ref = store.share(data)
    tasks = [dask.delayed(crc_of_index)(ref, i) for i in range(4)]
    crcs = dask.compute(*tasks, scheduler="processes", num_workers=2)
    assert list(crcs) == [zlib.crc32(memoryview(data[i:]).cast("B")) for i in range(4)]


def test_delete_and_with_block_end_the_object(store):
    ref = store.share(b"x" * 100)
    assert ref.delete() is True and ref.delete() is False  # idempotent
    assert ref.key not in store
    with store.share(np.ones(1000)) as scoped:
        assert scoped.get().sum() == 1000
        key = scoped.key
    assert key not in store and store.keys() == []
    with pytest.raises(RuntimeError), store.share(1) as failing:  # deleted on an exception too
        raise RuntimeError
    assert failing.key not in store


def test_a_deleted_ref_says_so_naming_the_key_here_and_in_a_worker(store):
    ref = store.share(np.arange(5))
    ref.delete()
    with pytest.raises(shmstore.ObjectNotFoundError, match="was deleted") as info:
        ref.get()
    assert ref.key in str(info.value) and info.value.object_id == ref.key
    assert isinstance(info.value, KeyError)
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as ex:
        message = ex.submit(deleted_message, ref).result(timeout=60)
    assert message.startswith("ObjectNotFoundError") and ref.key in message and "was deleted" in message


def test_a_ref_of_another_node_without_a_cluster_says_what_to_open(store):
    ref = store.share(1)  # a copy on this node would serve: this key has none here
    elsewhere = Ref(store.name, store.session, store.node + "-elsewhere", PREFIX + "0" * 32, cluster=True)
    with pytest.raises(shmstore.TransferError, match="no shmstore.mpi.Cluster open"):
        elsewhere.get()
    with pytest.raises(shmstore.TransferError, match="no shmstore.mpi.Cluster open"):
        elsewhere.delete()
    node_local = Ref(store.name, store.session, store.node + "-elsewhere", PREFIX + "0" * 32)
    with pytest.raises(shmstore.TransferError, match="resolves on that node only.*cluster.share"):
        node_local.get()
    assert ref.get() == 1


def test_an_unpickled_ref_in_a_process_without_the_store_opens_it_once(store):
    data = np.arange(100)
    ref = pickle.loads(pickle.dumps(store.share(data)))
    ref._owner = None  # as in another process: no sharer at hand (the sharing store is still found first)
    refs._sharers.clear()
    try:
        assert ref.get().tolist() == data.tolist()
        assert refs.release() == 1  # opened one connection for it, kept until released
        assert refs.release() == 0
    finally:
        refs.release()


DISTRIBUTED = """
import pickle, sys, zlib
import distributed
from test_refs import crc_of_index
ref = pickle.loads(bytes.fromhex(sys.argv[1]))
if __name__ == "__main__":
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  worker_dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        print(client.gather(client.map(crc_of_index, [ref] * 4, range(4), pure=False)))
"""


def test_resolves_on_dask_distributed_workers(store, tmp_path):
    """A distributed LocalCluster of worker processes (run from a child: distributed keeps a thread of its own
    for the rest of the process that starts it)."""
    pytest.importorskip("distributed")
    data = _data()
    ref = store.share(data)
    script = tmp_path / "dist.py"
    script.write_text(DISTRIBUTED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script), pickle.dumps(ref).hex()], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == str([zlib.crc32(memoryview(data[i:]).cast("B")) for i in range(4)])


def test_get_many_takes_refs_among_keys_and_asarray_resolves_a_ref(store):
    """What Ray users reach for (issue 35 item 3): refs in get_many, in their order among keys; np.asarray(ref)
    gives the shared array (a read-only view), not an object array holding the ref."""
    data = _data()
    ref = store.share(data)
    other = store.share({"step": 3})
    store.put("k", np.arange(5))
    got = store.get_many([ref, "k", other, ref])
    assert got[0] is not data and np.array_equal(got[0], data) and np.shares_memory(got[0], got[3])
    assert np.array_equal(got[1], np.arange(5)) and got[2] == {"step": 3}
    arr = np.asarray(ref)
    assert arr.dtype == data.dtype and np.array_equal(arr, data) and not arr.flags.writeable
    assert np.asarray(ref, dtype=np.float32).dtype == np.float32
    copy = np.array(ref)  # numpy's default for np.array: a copy, writable
    assert copy.flags.writeable and np.array_equal(copy, data)
    ref.delete()
    with pytest.raises(shmstore.ObjectNotFoundError, match="was deleted"):
        store.get_many(["k", ref])
    other.delete()
