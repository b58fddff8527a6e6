"""shmstore.contrib.proxystore: ProxyStore's connector behaviour tests, the Store on top, other processes.

The first block mirrors ProxyStore's own generic connector tests
(tests/connectors/connector_test.py of proxystore/proxystore) and the
basics of its Store tests, run against our connector; the rest is what
ProxyStore's tests cannot know: zero-copy resolution, proxies resolved in
other processes, overwrite through ``set``, lifetimes and use after close.
"""
from __future__ import annotations

import base64
import os
import pickle

import numpy as np
import pytest

import shmstore

from helpers import Child, view_arena, wait_for

pytest.importorskip("proxystore", reason="proxystore is not installed (pip install 'shmstore[proxystore]')")
from proxystore.connectors.protocols import Connector, DeferrableConnector  # noqa: E402
from proxystore.store import Store, unregister_store  # noqa: E402
from proxystore.store.ref import into_owned, update  # noqa: E402

from shmstore.contrib.proxystore import ShmStoreConnector, ShmStoreKey, deserialize, serialize  # noqa: E402


@pytest.fixture
def connector(name):
    with ShmStoreConnector(name, capacity="64MiB") as c:
        yield c


@pytest.fixture
def pstore(connector):
    store = Store(connector.name, connector, serializer=serialize, deserializer=deserialize, register=True,
                  populate_target=False, cache_size=0)
    try:
        yield store
    finally:
        unregister_store(store)
        store.close()


# ---- ProxyStore's generic connector tests ---------------------------------------------------

def test_implements_both_protocols(connector):
    assert isinstance(connector, Connector) and isinstance(connector, DeferrableConnector)
    assert isinstance(repr(connector), str)


def test_connector_basic_ops(connector):
    value = b"test_value"
    key = connector.put(value)
    assert connector.get(key) == value
    assert connector.exists(key)
    connector.evict(key)
    assert not connector.exists(key)
    assert connector.get(key) is None
    connector.evict(key)  # evicting a missing key is no error


def test_connector_batch_ops(connector):
    values = [b"value1", b"value2", b"value3"]
    keys = connector.put_batch(values)
    assert connector.get_batch(keys) == values
    assert all(connector.exists(k) for k in keys)
    for k in keys:
        connector.evict(k)
    assert not any(connector.exists(k) for k in keys)
    assert connector.get_batch(keys) == [None, None, None]


def test_connector_config(connector):
    again = type(connector).from_config(connector.config())
    try:
        assert isinstance(again, Connector) and type(again) is type(connector)
        key = connector.put(b"shared")
        assert again.get(key) == b"shared"  # the same store
    finally:
        again.close()


def test_deferrable_connector_ops(connector):
    obj = b"test_value"
    key = connector.new_key(obj)
    assert not connector.exists(key)
    connector.set(key, obj)
    connector.set(key, obj)  # set twice: an overwrite
    assert connector.get(key) == obj
    connector.set(key, b"other")
    assert connector.get(key) == b"other"


def test_close_is_idempotent_and_use_after_close_is_a_clear_error(name):
    c = ShmStoreConnector(name, capacity="16MiB")
    key = c.put(b"x")
    c.close()
    c.close()
    for call in (lambda: c.get(key), lambda: c.put(b"y"), lambda: c.evict(key),
                 lambda: c.set(key, b"z"), lambda: c.new_key()):
        with pytest.raises(shmstore.StoreClosedError):
            call()


def test_exists_still_answers_after_close(name):
    """Regression: ``exists`` raised StoreClosedError after close, where ProxyStore's Local and File connectors
    answer. It looks at the store: True while the store holds the object (here another process keeps the store),
    False for an evicted key, and False once the store itself went with its last client."""
    watcher = shmstore.connect(name, capacity="16MiB", session="proxystore")
    c = ShmStoreConnector(name)
    kept, evicted = c.put(b"kept"), c.put(b"evicted")
    c.evict(evicted)
    c.close()
    try:
        assert c.exists(kept) and not c.exists(evicted)
        watcher.delete(kept.shm_key)
        assert not c.exists(kept)
        watcher.put(kept.shm_key, b"again")
        assert c.exists(kept)
    finally:
        watcher.close()
    # the spill process removes the store once its last client is gone
    assert wait_for(lambda: not [s for s in os.listdir("/dev/shm") if f"-{name}-" in s], timeout=30)
    assert not c.exists(kept)


def test_clear_on_close_evicts_what_this_connector_put(name):
    with shmstore.connect(name, capacity="16MiB", session="proxystore") as watcher:
        c = ShmStoreConnector(name, clear=True)
        kept, gone = ShmStoreKey("kept"), c.put(b"mine")
        watcher.put("kept", b"not the connector's")
        c.close()
        assert gone.shm_key not in watcher and kept.shm_key in watcher


def test_non_bytes_values_are_refused(connector):
    with pytest.raises(shmstore.InvalidArgumentError, match="serialize it first"):
        connector.put([1, 2, 3])


# ---- ProxyStore's Store on top -----------------------------------------------------------------

@pytest.mark.parametrize("value", [b"value", "value", ["value1", "value2"], {"a": np.arange(5)}])
def test_store_basic_operations(pstore, value):
    key = pstore.put(value)
    assert pstore.exists(key)
    got = pstore.get(key)
    if isinstance(value, dict):
        np.testing.assert_array_equal(got["a"], value["a"])
    else:
        assert got == value
    pstore.evict(key)
    assert not pstore.exists(key)
    assert pstore.get(key) is None and pstore.get(key, default="alt") == "alt"


def test_store_with_proxystores_own_serializers(connector):
    store = Store("plain-" + connector.name, connector, register=True, populate_target=False, cache_size=0)
    try:
        key = store.put({"x": [1, 2]})
        assert store.get(key) == {"x": [1, 2]}
        p = store.proxy(np.arange(4))
        assert int(p.sum()) == 6
    finally:
        unregister_store(store)
        store.close()


def test_mutable_borrow_update_writes_back_through_set(pstore):
    from proxystore.proxy import get_factory
    owned = into_owned(pstore.proxy([1, 2, 3]))
    key = get_factory(owned).key
    owned.append(4)  # resolves it, then changes the local copy
    update(owned)
    assert pstore.get(key) == [1, 2, 3, 4]


def test_arrays_resolve_as_read_only_views_of_the_store(pstore, connector):
    arr = np.arange(1 << 20, dtype=np.float64)
    proxy = pstore.proxy({"w": arr, "n": 3})
    resolved = proxy["w"]
    assert not resolved.flags.writeable
    np.testing.assert_array_equal(resolved, arr)
    base, size = view_arena(connector.store)
    addr = resolved.__array_interface__["data"][0]
    assert base <= addr < base + size  # in shared memory: no copy
    assert addr % 64 == 0


def test_serializer_pair_round_trips_and_rejects_damage():
    obj = {"a": np.arange(10), "b": [np.ones((3, 3), order="F"), "text"], "c": b"raw"}
    data = serialize(obj)
    back = deserialize(memoryview(bytes(data)))
    np.testing.assert_array_equal(back["a"], obj["a"])
    assert back["b"][0].flags.f_contiguous and back["b"][1] == "text" and back["c"] == b"raw"
    assert not back["a"].flags.writeable
    with pytest.raises(shmstore.SerializationError):
        deserialize(bytes(data[:200]))


def test_damaged_data_of_every_kind_is_a_serialization_error():
    """Regression (issue 19): damaged data raised raw ValueError / struct.error (documented: SerializationError).
    Every truncation, bytes flipped at random (seeded), the header's counts made huge, and foreign garbage:
    each either decodes or raises SerializationError, never anything else."""
    import random
    import struct
    data = bytes(serialize({"a": np.arange(100), "b": [np.ones((3, 3)), "text"]}))
    rnd = random.Random(19)
    cases = [data[:n] for n in range(len(data))] + [b"", b"\0", b"garbage" * 9, bytearray(300)]
    for _ in range(2000):
        damaged = bytearray(data)
        for _ in range(rnd.randint(1, 6)):
            damaged[rnd.randrange(len(damaged))] = rnd.randrange(256)
        cases.append(bytes(damaged))
    for at in range(64, 64 + 40, 4):  # the object header's fields, each set to huge
        cases.append(data[:at] + struct.pack("<I", 0xFFFFFFFF) + data[at + 4:])
    raised = 0
    for case in cases:
        try:
            deserialize(case)
        except shmstore.SerializationError:
            raised += 1
    assert raised > len(data)  # every truncation at least
    with pytest.raises(shmstore.SerializationError):
        deserialize(12345)  # not even bytes-like


def test_deserializer_passes_foreign_data_to_proxystore():
    from proxystore.serialize import serialize as theirs
    assert deserialize(theirs({"k": 1})) == {"k": 1}


CONSUMER = """
import base64, os, pickle, sys
import numpy as np
proxy = pickle.loads(base64.b64decode(sys.stdin.readline()))
w = proxy['w']
print(int(w.sum()), w.flags.writeable, flush=True)
"""


def test_proxy_resolved_in_another_process(pstore):
    proxy = pstore.proxy({"w": np.arange(1000)})
    child = Child(CONSUMER)
    child.send(base64.b64encode(pickle.dumps(proxy)).decode())
    assert child.readline() == f"{sum(range(1000))} False"
    child.wait()


PRODUCER = """
import base64, os, pickle
import numpy as np
from proxystore.store import Store
from shmstore.contrib.proxystore import ShmStoreConnector, serialize, deserialize
c = ShmStoreConnector(os.environ['N'], persist=True)
store = Store('producer', c, serializer=serialize, deserializer=deserialize, populate_target=False)
proxy = store.proxy(np.full(100, 7))
print(base64.b64encode(pickle.dumps(proxy)).decode(), flush=True)
c.close()
"""


def test_a_persistent_store_outlives_its_producer(name):
    producer = Child(PRODUCER, env={"N": name})
    line = producer.readline()
    producer.wait()
    try:
        proxy = pickle.loads(base64.b64decode(line))
        assert int(proxy.sum()) == 700
    finally:
        from proxystore.store import get_store
        s = get_store("producer")
        if s is not None:
            unregister_store(s)
            s.close()
        shmstore.destroy(name, force=True)


def _functions_and_local_objects():
    """What Parsl and Globus Compute users proxy: plain pickle refuses each of these."""
    scale = np.arange(4.0)

    class Task:
        def __init__(self, n):
            self.n = n

        def run(self):
            return self.n * 3

    def nested(x):
        return x - 1
    return [lambda x: x + 1, lambda: float(scale.sum()), nested, Task(5), {"fn": lambda: "in a dict"}]


def _call(obj):
    if isinstance(obj, dict):
        return obj["fn"]()
    if hasattr(obj, "run"):
        return obj.run()
    try:
        return obj(1)
    except TypeError:
        return obj()


def test_serializer_pair_handles_what_proxystores_default_serializer_handles():
    """Issue 21 item 4: lambdas, closures, nested functions, local classes: ProxyStore's default serializer
    takes them (cloudpickle); so does the pair, and each comes back behaving the same."""
    from proxystore.serialize import deserialize as their_load
    from proxystore.serialize import serialize as their_dump
    objs = _functions_and_local_objects()
    theirs = [_call(their_load(their_dump(o))) for o in objs]
    ours = [_call(deserialize(serialize(o))) for o in objs]
    assert ours == theirs == [2, 6.0, 0, 15, "in a dict"]


def test_lambdas_and_local_objects_through_a_proxystore_store_and_another_process(pstore):
    objs = _functions_and_local_objects()
    keys = [pstore.put(o) for o in objs]
    assert [_call(pstore.get(k)) for k in keys] == [2, 6.0, 0, 15, "in a dict"]
    proxy = pstore.proxy(objs[3])  # a local class's instance, resolved in another process
    child = Child("""
import base64, pickle, sys
proxy = pickle.loads(base64.b64decode(sys.stdin.readline()))
print(proxy.run(), flush=True)
""")
    child.send(base64.b64encode(pickle.dumps(proxy)).decode())
    assert child.readline() == "15"
    child.wait()


# ---- serialize() writes into the store, put adopts (issue 21 item 5) ------------------------------------

def _arena_holds(connector, data):
    base, size = view_arena(connector.store)
    addr = np.frombuffer(data, np.uint8).__array_interface__["data"][0]
    return base <= addr < base + size


def _keys(connector):
    return sorted(i.key for i in connector.store.list())


def test_serialize_writes_into_the_store_and_put_adopts_it_without_a_copy(connector):
    big = {"w": np.arange(1 << 19, dtype=np.float64), "step": 3}  # 4 MiB
    data = serialize(big)
    assert isinstance(data, memoryview) and data.readonly and _arena_holds(connector, data)
    key = connector.put(data)
    assert _keys(connector) == [key.shm_key]  # the staged object is the stored one: nothing else
    got = connector.get(key)
    assert np.frombuffer(got, np.uint8).ctypes.data == np.frombuffer(data, np.uint8).ctypes.data  # same bytes
    back = deserialize(got)
    np.testing.assert_array_equal(back["w"], big["w"])
    assert back["step"] == 3 and not back["w"].flags.writeable
    again = connector.put(data)  # put twice: the second is a copy under a key of its own
    assert again != key and sorted(_keys(connector)) == sorted([key.shm_key, again.shm_key])
    np.testing.assert_array_equal(deserialize(connector.get(again))["w"], big["w"])


def test_a_proxystore_store_put_leaves_one_object(pstore, connector):
    arr = np.arange(1 << 20, dtype=np.float32)
    key = pstore.put(arr)
    assert _keys(connector) == [key.shm_key]
    np.testing.assert_array_equal(pstore.get(key), arr)
    pstore.evict(key)
    assert _keys(connector) == []


def test_staged_bytes_are_whole_anywhere_and_go_when_dropped_unput(connector):
    arr = np.arange(1 << 19, dtype=np.float64)
    data = serialize(arr)
    np.testing.assert_array_equal(deserialize(bytes(data)), arr)  # as another connector would store them
    staged = _keys(connector)
    assert len(staged) == 1
    del data
    kept = connector.put(b"small")  # the next verb deletes what was dropped unput
    assert _keys(connector) == [kept.shm_key]


def test_set_copies_staged_bytes_under_its_key_and_drops_the_staged_object(connector):
    arr = np.arange(1 << 19, dtype=np.int64)
    key = connector.new_key()
    data = serialize(arr)
    connector.set(key, data)
    del data
    connector.put(b"x")
    assert key.shm_key in _keys(connector) and len(_keys(connector)) == 2
    np.testing.assert_array_equal(deserialize(connector.get(key)), arr)


def test_staged_bytes_stay_valid_after_their_connector_closes(name):
    arr = np.arange(1 << 19, dtype=np.float64)
    with shmstore.connect(name, capacity="64MiB", session="proxystore") as watcher:
        c = ShmStoreConnector(name)
        data = serialize(arr)
        c.close()  # staged, never put: hidden now, its bytes still ours until dropped
        assert watcher.list() == []
        np.testing.assert_array_equal(deserialize(data), arr)
        del data


def test_small_objects_and_another_stores_connector_use_bytes_of_their_own(connector, name):
    small = serialize(np.arange(100))
    assert not _arena_holds(connector, small) and _keys(connector) == []
    with ShmStoreConnector(name + "-other", capacity="16MiB") as other:
        with ShmStoreConnector(name, capacity="64MiB") as mine:  # serialize stages into the newest connector
            data = serialize(np.arange(1 << 19, dtype=np.float64))
            assert _arena_holds(mine, data)
            key = other.put(data)  # another store: copied
            np.testing.assert_array_equal(deserialize(other.get(key)), np.arange(1 << 19, dtype=np.float64))
            del data
            mine.put(b"x")
            assert len(_keys(mine)) == 1  # the staged object went
