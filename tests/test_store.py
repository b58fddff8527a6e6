"""The Store API on one process: values, views, deletes, pins, sessions, errors."""
from __future__ import annotations

import gc
import os
import pickle
import signal
import threading

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.spill.supervisor import spill_booted

from helpers import Child, shm_segments, spill_popen, wait_for


def test_array_roundtrip_is_readonly_zero_copy_view(store):
    a = np.arange(1000, dtype=np.float64).reshape(10, 100)
    info = store.put("a", a)
    assert info.size == a.nbytes and info.kind == "ndarray" and info.level is Level.MEMORY
    got = store.get("a")
    np.testing.assert_array_equal(got, a)
    assert got.dtype == a.dtype and got.shape == a.shape
    assert not got.flags.writeable and not got.flags.owndata
    with pytest.raises(ValueError):
        got[0, 0] = 1
    again = store.get("a")
    assert np.shares_memory(got, again)  # both views of the same shared bytes


def test_arrays_come_back_as_shared_arrays_that_behave_like_ndarrays(store):
    a = np.arange(12.0).reshape(3, 4)
    store.put("a", a)
    got = store.get("a")
    assert isinstance(got, shmstore.SharedArray) and isinstance(got, np.ndarray)
    assert type(got + 1) is np.ndarray and type(np.sqrt(got)) is np.ndarray
    assert isinstance(got.sum(), np.floating) and type(np.asarray(got)) is np.ndarray
    assert type(pickle.loads(pickle.dumps(got))) is np.ndarray
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(got)), a)
    store.put("again", got[1:])  # stored as an array again, not as a pickle
    assert store.get_info("again").kind == "ndarray"
    np.testing.assert_array_equal(store.get("again"), a[1:])


@pytest.mark.parametrize("make", [
    lambda: np.asfortranarray(np.arange(60, dtype=np.int32).reshape(3, 4, 5)),
    lambda: np.arange(100, dtype=np.int64)[::3],
    lambda: np.arange(24).reshape(4, 6).T,
    lambda: np.zeros((0, 5), np.float32),
    lambda: np.array(3.5),
    lambda: np.array(["a", "bcd"], dtype="<U3"),
    lambda: np.arange(10, dtype=">i4"),
    lambda: np.zeros(4, dtype=[("x", "<f8"), ("y", "<i2")]),
    lambda: np.array([1, "x", None], dtype=object),
    lambda: np.arange(8, dtype=np.complex128).reshape(2, 2, 2),
])
def test_arrays_of_every_layout_roundtrip(store, make):
    a = make()
    store.put("k", a)
    got = store.get("k")
    assert got.dtype == a.dtype and got.shape == a.shape
    np.testing.assert_array_equal(got, a)
    if a.flags.f_contiguous and not a.flags.c_contiguous:
        assert got.flags.f_contiguous


def test_state_dict_of_many_arrays_returns_views(store):
    sd = {f"layer{i}.weight": np.full((i % 7 + 1, 3), i, np.float32) for i in range(1000)}
    sd["empty"] = np.zeros(0)
    sd["meta"] = {"step": 7, "names": ["a", "b"]}
    info = store.put("sd", sd)
    assert info.kind == "pickle" and info.nblobs >= 1000
    got = store.get("sd")
    assert got.keys() == sd.keys()
    for k in sd:
        if k == "meta":
            assert got[k] == sd[k]
        else:
            np.testing.assert_array_equal(got[k], sd[k])
    w = got["layer5.weight"]
    assert not w.flags.writeable and not w.flags.owndata


BYTES_LIKE = {
    "empty": b"", "bytes": b"hello", "bytearray": bytearray(b"\x00\x01" * 1000),
    "slice": memoryview(b"abcdef")[1:4],
    # not C-contiguous (issue 30 item 11: a Fortran-ordered view raised a raw TypeError, "casts are restricted
    # to C-contiguous views"): stored as bytes(value) has them, in C order
    "fortran": memoryview(np.asfortranarray(np.arange(12.0).reshape(3, 4))),
    "fortran records": memoryview(np.asfortranarray(np.arange(6, dtype="<i4").view([("a", "<i4")]).reshape(2, 3))),
    "strided": memoryview(np.arange(10)[::2]),
    "0-d": memoryview(np.array(2.5)),
}


@pytest.mark.parametrize("value", list(BYTES_LIKE.values()), ids=list(BYTES_LIKE))
def test_bytes_like_values_are_stored_raw(store, value):
    store.put("b", value)
    got = store.get("b")
    assert isinstance(got, memoryview) and got.readonly
    assert bytes(got) == bytes(value)
    with store.open_reader("b") as r:
        assert r.read() == bytes(value)
    store.put_many({"c": value})
    assert bytes(store.get("c")) == bytes(value)


def test_a_bytes_like_value_that_cannot_be_read_is_a_serialization_error(store):
    released = memoryview(b"abc")
    released.release()
    with pytest.raises(shmstore.SerializationError, match="released memoryview"):
        store.put("b", released)
    assert "b" not in store and store.list() == [] and store.check() == []


def test_out_of_band_buffers_besides_arrays(store):
    value = {"ba": bytearray(b"xyz" * 100), "a": np.arange(5), "pb": [bytearray(b""), np.zeros((2, 0))]}
    store.put("v", value)
    got = store.get("v")
    assert bytes(got["ba"]) == bytes(value["ba"]) and bytes(got["pb"][0]) == b""
    np.testing.assert_array_equal(got["a"], value["a"])
    assert got["pb"][1].shape == (2, 0)


@pytest.mark.parametrize("value", [None, 0, "text", [1, 2, (3, 4)], {"a": {"b": None}}, 1.5, {1, 2}])
def test_plain_python_values_roundtrip(store, value):
    store.put("v", value)
    assert store.get("v") == value


def test_conditions_slice_without_copy(store):
    a = np.arange(10000).reshape(100, 100)
    store.put("a", a)
    part = store.get("a", conditions=(slice(10, 20), slice(0, 5)))
    np.testing.assert_array_equal(part, a[10:20, :5])
    assert not part.flags.owndata
    with pytest.raises(shmstore.InvalidArgumentError):
        store.get("a", conditions=(slice(0, 1),) * 5)
    store.put("d", {"x": 1})
    with pytest.raises(shmstore.InvalidArgumentError):
        store.get("d", conditions=(slice(0, 1),))


def test_put_twice_and_missing_keys(store):
    store.put("x", 1)
    with pytest.raises(shmstore.ObjectExistsError):
        store.put("x", 2)
    assert store.get("x") == 1
    with pytest.raises(shmstore.ObjectNotFoundError) as err:
        store.get("nope")
    assert isinstance(err.value, KeyError) and "'nope'" in str(err.value)
    with pytest.raises(KeyError):
        store.delete("nope")
    store.delete("nope", missing_ok=True)
    assert "x" in store and "nope" not in store


def test_delete_hides_at_once_but_views_stay_valid(store):
    a = np.arange(100_000, dtype=np.int64)
    store.put("a", a)
    view = store.get("a")
    used_before = store.get_capacity()[Level.MEMORY].used
    store.delete("a")
    assert "a" not in store
    with pytest.raises(shmstore.ObjectNotFoundError):
        store.get("a")
    # the space is not reused while the view lives
    assert store.get_capacity()[Level.MEMORY].used == used_before
    store.put("a", np.zeros_like(a))  # the key is free again, in fresh space
    np.testing.assert_array_equal(view, a)
    derived = view[10:20]
    del view
    gc.collect()
    np.testing.assert_array_equal(derived, a[10:20])
    del derived
    gc.collect()
    assert store.get_capacity()[Level.MEMORY].used < used_before + a.nbytes


def test_view_pins_until_collected_and_explicit_pins_count(store):
    store.put("a", np.ones(10))
    v = store.get("a")
    assert store.get_info("a").pinned
    del v
    gc.collect()
    assert not store.get_info("a").pinned
    store.pin("a")
    store.pin("a")
    store.unpin("a")
    assert store.get_info("a").pinned
    store.unpin("a")
    assert not store.get_info("a").pinned
    with pytest.raises(shmstore.InvalidArgumentError):
        store.unpin("a")


def test_capacity_accounting_returns_to_zero(store):
    cap = store.get_capacity()[Level.MEMORY]
    assert cap.used == 0 and cap.free == cap.total == 64 << 20
    for i in range(50):
        store.put(f"k{i}", np.zeros(i * 100 + 1))
    cap = store.get_capacity()[Level.MEMORY]
    assert cap.objects == 50 and cap.used == sum(i.stored for i in store.list())
    assert store.clear() == 50
    cap = store.get_capacity()[Level.MEMORY]
    assert cap.used == 0 and cap.objects == 0


def test_freed_space_is_reused(store):
    big = np.zeros(20 << 20, np.uint8)
    for _ in range(10):  # 200 MiB through a 64 MiB arena
        store.put("big", big)
        store.delete("big")
    assert store.get_capacity()[Level.MEMORY].used == 0


def test_sessions_namespace_keys(name):
    with shmstore.connect(name, capacity="16MiB", session="s1") as a, \
            shmstore.connect(name, session="s2") as b:
        a.put("k", 1)
        b.put("k", 2)
        assert a.get("k") == 1 and b.get("k") == 2
        assert [i.key for i in a.list()] == ["k"]
        b.clear()
        assert "k" not in b and a.get("k") == 1


def test_kernel_raises_full_at_once(store):
    with pytest.raises(shmstore.StorageFullError) as err:
        store.kernel.put("huge", np.zeros(65 << 20, np.uint8))
    msg = str(err.value)
    assert "'huge'" in msg and "MiB" in msg and "capacity" in msg
    assert err.value.requested >= 65 << 20
    assert "huge" not in store and store.get_capacity()[Level.MEMORY].used == 0
    store.kernel.put("fits", np.zeros(1 << 20, np.uint8))
    assert store.get("fits").nbytes == 1 << 20


def test_max_objects_is_reachable_with_several_clients(name):
    """Regression: with max_objects=64 the 34th object failed: other clients held batches of 32 entries."""
    code = """
import shmstore, os, sys
s = shmstore.connect(os.environ['N'], capacity='8MiB', max_objects=64)
for i in range(5):
    s.put(f"{os.getpid()}-{i}", i)
print('put', flush=True)
sys.stdin.readline()
s.close()
"""
    with shmstore.connect(name, capacity="8MiB", max_objects=64) as s:
        kids = [Child(code, env={"N": name}) for _ in range(3)]
        try:
            for k in kids:  # each holds a batch of entries it does not use
                assert k.readline() == "put"
            n = 15
            while n < 64:
                s.put(f"mine-{n}", n)
                n += 1
            with pytest.raises(shmstore.StorageFullError, match="max_objects"):
                s.put("one-more", 0)
            assert len(s.list()) == 64 and s.get("mine-63") == 63
            assert s.check() == []
        finally:
            for k in kids:
                k.send("bye")
                k.wait()
        s.delete("mine-20")
        s.put("one-more", 0)
        assert s.check() == []


def test_a_small_put_skips_the_entries_another_client_took_from_its_batch(name):
    """A small put (the C put_small) takes the last reserved entry of its client's batch: the entries another
    client took from that batch meanwhile (its table full, it took half of this batch, again and again) are
    dropped, never written. The table fills to max_objects; no entry is lost or written twice."""
    code = """
import shmstore, os, sys
s = shmstore.connect(os.environ['N'], capacity='8MiB', max_objects=64)
n = 0
while True:
    try:
        s.put(f"kid-{n}", bytes([n]) * 100)
    except shmstore.StorageFullError:
        break
    n += 1
print(n, flush=True)
sys.stdin.readline()
for i in range(10):
    s.delete(f"kid-{i}")
print('freed', flush=True)
sys.stdin.readline()
s.close()
"""
    with shmstore.connect(name, capacity="8MiB", max_objects=64) as s:
        s.put("mine-0", b"m" * 100)  # this client's batch: 32 entries, 31 idle
        kid = Child(code, env={"N": name})
        try:
            kid_puts = int(kid.readline())
            assert kid_puts == 63  # its own batch, then every idle entry of ours, half at a time
            with pytest.raises(shmstore.StorageFullError, match="max_objects"):
                s.put("mine-1", b"m" * 100)  # every entry of our batch was taken: each is dropped
            kid.send("go")
            assert kid.readline() == "freed"
            for i in range(1, 11):
                s.put(f"mine-{i}", bytes([i]) * 100)
            with pytest.raises(shmstore.StorageFullError, match="max_objects"):
                s.put("mine-11", b"m" * 100)
            assert s.check() == []
            assert bytes(s.get("mine-0")) == b"m" * 100
            for i in range(1, 11):
                assert bytes(s.get(f"mine-{i}")) == bytes([i]) * 100
            for i in range(10, kid_puts):
                assert bytes(s.get(f"kid-{i}")) == bytes([i]) * 100
            assert len(s.list()) == 64
        finally:
            kid.send("bye")
            kid.wait()


def test_object_table_full_is_clear(name):
    with shmstore.connect(name, capacity="8MiB", max_objects=16) as s:
        for i in range(16):
            s.put(f"k{i}", i)
        with pytest.raises(shmstore.StorageFullError, match="max_objects"):
            s.put("one-more", 0)
        s.delete("k0")
        s.put("one-more", 0)


@pytest.mark.parametrize("key", ["", "x" * 256, "é" * 128, 5, None, b"bytes", "\udc80"])
def test_bad_keys_are_rejected_and_change_nothing(store, key):
    with pytest.raises(shmstore.InvalidKeyError):
        store.put(key, 1)
    with pytest.raises(shmstore.InvalidKeyError):
        store.get(key)
    assert store.list() == []


def test_longest_key_works(store):
    key = "k" * 255
    store.put(key, 1)
    assert store.get(key) == 1 and store.list()[0].key == key


def test_unpicklable_value_changes_nothing(store):
    with pytest.raises(shmstore.SerializationError):
        store.put("f", threading.Lock())  # neither pickle nor cloudpickle takes it
    with pytest.raises(shmstore.SerializationError):
        store.put("g", {"ok": np.ones(3), "bad": (x for x in [])})
    assert store.list() == [] and store.get_capacity()[Level.MEMORY].used == 0


VERBS_AFTER_CLOSE = {
    "put": lambda s: s.put("b", 1), "put to disk": lambda s: s.put("b", 1, levels=[Level.DISK]),
    "get": lambda s: s.get("a"), "get with levels": lambda s: s.get("a", levels=[Level.MEMORY]),
    "get with conditions": lambda s: s.get("a", conditions=(slice(0, 1),)),
    "move": lambda s: s.move("a", Level.DISK), "delete": lambda s: s.delete("a"), "contains": lambda s: "a" in s,
    "get_info": lambda s: s.get_info("a"), "list": lambda s: s.list(), "keys": lambda s: s.keys(),
    "get_capacity": lambda s: s.get_capacity(), "clear": lambda s: s.clear(), "pin": lambda s: s.pin("a"),
    "unpin": lambda s: s.unpin("p"), "open_writer": lambda s: s.open_writer("w", 10),
    "open_reader": lambda s: s.open_reader("a"), "status": lambda s: s.status(), "check": lambda s: s.check(),
    "spill_pid": lambda s: s.spill_pid, "kernel": lambda s: s.kernel,
}


@pytest.mark.parametrize("verb", sorted(VERBS_AFTER_CLOSE))
def test_every_verb_after_close_raises_store_closed(name, verb):
    """Regression: move and get(levels=...) after close() crashed with SIGSEGV in a lock."""
    s = shmstore.connect(name, capacity="8MiB")
    s.put("a", np.arange(10))
    s.put("p", 1)
    s.pin("p")
    s.close()
    s.close()
    with pytest.raises(shmstore.StoreClosedError):
        VERBS_AFTER_CLOSE[verb](s)


def test_close_drops_open_writers_and_their_use_raises(name):
    s = shmstore.connect(name, capacity="8MiB")
    w = s.open_writer("w", 10)
    w.write(b"01234")
    s.close()
    with pytest.raises(shmstore.StoreClosedError, match="nothing was stored"):
        w.write(b"56789")
    with pytest.raises(shmstore.StoreClosedError):
        _ = w.buffer
    w.close()  # idempotent after the store dropped it
    with shmstore.connect(name, capacity="8MiB") as again:
        assert "w" not in again and again.check() == []


def test_close_with_live_views_keeps_them_valid(name):
    s = shmstore.connect(name, capacity="8MiB")
    s.put("a", np.arange(1000))
    view = s.get("a")
    s.close()
    np.testing.assert_array_equal(view, np.arange(1000))
    del view
    gc.collect()


def test_last_close_while_the_spill_process_starts_removes_the_store_at_once_and_stops_it(name):
    """A short script (connect, put, close) leaves nothing behind when close returns: the store's names are
    gone and its spill process, still importing (held stopped here, so it cannot finish), is terminated
    instead of left to start up only to find the store gone."""
    s = shmstore.connect(name, capacity="8MiB")
    s.put("a", b"x" * 100)
    proc = spill_popen(s.spill_pid)
    os.kill(proc.pid, signal.SIGSTOP)  # it cannot write its first heartbeat now
    try:
        assert not spill_booted(s.kernel.node)
        s.close()
        assert [x for x in shm_segments() if name in x] == []  # removed by close itself
        proc.send_signal(signal.SIGCONT)  # (a no-op where close reaped it already)
        # killed while importing, or (already past its imports, its SIGTERM handler set) it leaves at once
        assert proc.wait(10) in (-signal.SIGTERM, 0)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.wait(10)


def test_last_close_of_a_persistent_store_leaves_it_and_its_starting_spill_process(name):
    s = shmstore.connect(name, capacity="8MiB", persist=True)
    s.put("a", b"x" * 100)
    proc = spill_popen(s.spill_pid)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        s.close()
        assert [x for x in shm_segments() if name in x] and proc.poll() is None
    finally:
        proc.send_signal(signal.SIGCONT)
        with shmstore.connect(name) as again:
            assert bytes(again.get("a")) == b"x" * 100
        shmstore.destroy(name, force=True)
        assert wait_for(lambda: proc.poll() is not None, timeout=30)


def test_capacity_larger_than_dev_shm_is_refused(name):
    with pytest.raises(shmstore.StorageFullError, match="SHMSTORE_CAPACITY"):
        shmstore.connect(name, capacity="100TiB")


def test_store_pickles_as_its_settings(store):
    store.put("a", 41)
    clone = pickle.loads(pickle.dumps(store))
    try:
        assert clone.get("a") == 41 and clone.name == store.name
    finally:
        clone.close()


def test_destroy_refuses_while_attached(name):
    s = shmstore.connect(name, capacity="8MiB", persist=True)
    s.put("a", 1)
    with pytest.raises(shmstore.StoreInUseError):
        shmstore.destroy(name)
    s.close()
    with shmstore.connect(name, create=False) as again:  # persistent: outlives its clients
        assert again.get("a") == 1
    assert shmstore.destroy(name) is True
    with pytest.raises(FileNotFoundError):
        shmstore.connect(name, create=False)


@pytest.mark.parametrize("levels", [object(), 1.5, [1.5], [True], [None], "tape", ["tape"], []])
def test_bad_levels_are_clear_errors_and_change_nothing(store, levels):
    with pytest.raises(shmstore.InvalidArgumentError, match="level"):
        store.put("a", 1, levels=levels)
    with pytest.raises(shmstore.InvalidArgumentError, match="level"):
        store.open_writer("a", 1, levels=levels)
    store.put("b", 2)
    with pytest.raises(shmstore.InvalidArgumentError, match="level"):
        store.get("b", levels=levels)
    with pytest.raises(shmstore.InvalidArgumentError, match="level"):
        store.move("b", levels)
    assert store.keys() == ["b"] and store.check() == []


def test_levels_argument_is_validated(store):
    store.put("a", 1, levels=[Level.MEMORY])
    assert store.get("a", levels=Level.MEMORY) == 1


PRODUCER = """
import os, shmstore, numpy as np
store = shmstore.connect(os.environ['N'], capacity='16MiB', persist=os.environ['P'] == '1')
store.put('result', np.arange(1000))
store.close()
print('done', flush=True)
"""


@pytest.mark.parametrize("persist", [False, True])
def test_consumer_after_its_producer_exited(name, persist):
    """A workflow's producer puts, closes and exits before the consumer connects."""
    producer = Child(PRODUCER, env={"N": name, "P": "1" if persist else "0"})
    assert producer.readline() == "done"
    producer.wait()
    if not persist:  # the store went with its last client: a clear error, not an empty store
        assert wait_for(lambda: not [n for n in shm_segments() if name in n], timeout=10)
        with pytest.raises(shmstore.StoreNotFoundError, match="persist=True") as exc:
            shmstore.connect(name, create=False)
        assert isinstance(exc.value, FileNotFoundError)
        return
    with shmstore.connect(name, create=False) as consumer:
        assert consumer.get("result").sum() == sum(range(1000))
    assert shmstore.destroy(name)


def test_lambdas_closures_and_local_classes_round_trip_across_processes(store):
    """Plain pickle refuses them (issue 21 item 4): put falls back to cloudpickle, and a process that never
    imported cloudpickle gets them with plain pickle (the stored stream imports what it needs)."""
    offset = np.arange(3)

    class Point:
        def __init__(self, x):
            self.x = x

        def norm(self):
            return abs(self.x)
    store.put("lambda", lambda v: v + 1)
    store.put("closure", lambda: int(offset.sum()) + 100)
    store.put("local", Point(-5))
    assert store.get("lambda")(1) == 2 and store.get("closure")() == 103 and store.get("local").norm() == 5
    code = """
import os, sys
import shmstore
s = shmstore.connect(os.environ['N'])
before = 'cloudpickle' in sys.modules
print(before, s.get('lambda')(41), s.get('closure')(), s.get('local').norm(), flush=True)
s.close()
"""
    child = Child(code, env={"N": store.name})
    assert child.readline() == "False 42 103 5"
    child.wait()


# ---- get: default=, keyword-only conditions and levels (issue 21 item 1) ----------------------------------
def test_get_second_positional_argument_is_a_default_as_with_a_dict(store):
    store.put("arr", np.arange(10))
    np.testing.assert_array_equal(store.get("arr", 5), np.arange(10))  # the value, never arr[5]
    assert store.get("missing", None) is None and store.get("missing", 5) == 5
    assert store.get("missing", default=[1]) == [1]
    assert store.kernel.get("missing", None) is None
    with pytest.raises(shmstore.ObjectNotFoundError, match="'missing'"):
        store.get("missing")  # without a default a miss still raises


def test_get_conditions_and_levels_are_keyword_only(store):
    store.put("arr", np.arange(10))
    spelling = "conditions= and levels= are keyword-only; for a default use default="
    for call in (lambda: store.get("arr", None, (slice(0, 2),)),
                 lambda: store.get("arr", (slice(0, 2),)),  # conditions by position, as before: refused
                 lambda: store.get("arr", slice(0, 2)),
                 lambda: store.get("arr", None, None, [Level.MEMORY]),
                 lambda: store.kernel.get("arr", (slice(0, 2), ...)),
                 lambda: store.kernel.get("arr", None, (slice(0, 2),))):
        with pytest.raises(shmstore.InvalidArgumentError, match=spelling) as err:
            call()
        assert "'arr'" in str(err.value)
    np.testing.assert_array_equal(store.get("arr", conditions=(slice(2, 4),)), [2, 3])
    np.testing.assert_array_equal(store.get("arr", levels=[Level.MEMORY], conditions=(slice(0, 1),)), [0])
    np.testing.assert_array_equal(store.kernel.get("arr", conditions=(slice(9, None),)), [9])
    assert store.get("nope", (0, 1)) == (0, 1)  # a tuple of plain values is a default like any other
    assert store.get("nope", None, levels=[Level.MEMORY]) is None  # a default also where levels= would move it


def test_get_default_on_a_spilled_object_and_a_deleted_one(store):
    store.put("d", np.arange(4))
    store.move("d", Level.DISK)
    np.testing.assert_array_equal(store.get("d", None), np.arange(4))  # found on DISK: the value
    store.delete("d")
    assert store.get("d", "gone") == "gone"


# ---- sessions are visible (issue 21 item 8) ---------------------------------------------------------------
def test_a_miss_names_the_sessions_that_hold_the_key(name):
    with shmstore.connect(name, capacity="16MiB") as plain, \
            shmstore.connect(name, session="proxystore") as proxied, \
            shmstore.connect(name, session="other") as other:
        proxied.put("x", 1)
        other.put("x", 2)
        proxied.put("only-here", 3)
        with pytest.raises(shmstore.ObjectNotFoundError) as err:
            plain.get("x")
        msg = str(err.value)
        assert "no object 'x'" in msg and "'proxystore'" in msg and "'other'" in msg and "session=" in msg
        with pytest.raises(shmstore.ObjectNotFoundError, match="session 'proxystore' holds it"):
            other.get_info("only-here")
        with pytest.raises(shmstore.ObjectNotFoundError, match="session 'proxystore' holds it"):
            plain.delete("only-here")
        with pytest.raises(shmstore.ObjectNotFoundError) as err:
            proxied.get("nowhere")
        assert "holds" not in str(err.value) and "hold it" not in str(err.value)
        assert plain.get("x", None) is None  # a default: no error, nothing looked up elsewhere


def test_dict_operators(store):
    store["a"] = np.arange(4)
    store["a"] = b"new"  # = overwrites, atomically (put(..., overwrite=True))
    store["b"] = {"x": 1}
    assert bytes(store["a"]) == b"new" and store["b"] == {"x": 1} and len(store) == 2
    assert sorted(store) == ["a", "b"] == sorted(store.keys()) and "a" in store
    assert sorted(k for k, _ in store.items()) == ["a", "b"] and {"x": 1} in store.values()
    with pytest.raises(KeyError, match="'missing'") as ei:
        store["missing"]
    assert isinstance(ei.value, shmstore.ObjectNotFoundError) and ei.value.object_id == "missing"
    with pytest.raises(KeyError):
        del store["missing"]
    del store["b"]
    assert "b" not in store and len(store) == 1
    view = store.pop("a")
    assert bytes(view) == b"new" and "a" not in store  # a popped value's view stays valid
    assert store.pop("a", None) is None
    with pytest.raises(KeyError):
        store.pop("a")
    store.update({"u": 1}, v=2)
    store.update([("w", 3)])
    assert [store[k] for k in ("u", "v", "w")] == [1, 2, 3]
    store.clear()
    assert len(store) == 0 and store and list(store) == []  # a connection is true even when empty
    del view
    gc.collect()
    assert not store.check()


def test_items_and_values_are_those_of_the_keys_left(store):
    for i in range(20):
        store[f"k{i}"] = i
    keys = store.keys()
    store.delete_many(keys[::2])
    left = sorted(int(k[1:]) for k in keys[1::2])
    assert sorted(v for _, v in store.items()) == sorted(store.values()) == left
    assert all(store[k] == v for k, v in store.items())


def test_a_strided_view_of_a_stored_array_is_put_like_any_array(store):
    """Regression: a non-contiguous view of a stored array (a SharedArray, a subclass of ndarray) failed the
    small put's contiguity check, which asked ``type(src) is np.ndarray``: ValueError from the C copy."""
    store.put("a", np.arange(100.0))
    store.put("big", np.arange(1 << 20, dtype=np.float64))
    store.put("b", store.get("a")[::2])  # small: the C shortcut declines it, the steps copy it
    store.put("c", store.get("big")[::4])
    store.put("d", store.get("a").reshape(10, 10).T)  # F-contiguous: copied as it is
    np.testing.assert_array_equal(store.get("b"), np.arange(0.0, 100.0, 2))
    np.testing.assert_array_equal(store.get("c"), np.arange(1 << 20, dtype=np.float64)[::4])
    np.testing.assert_array_equal(store.get("d"), np.arange(100.0).reshape(10, 10).T)
    assert store.check() == []
