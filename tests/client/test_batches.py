"""Batches on a node's Store: put_many / get_many / delete_many, their error rules and their locks."""
from __future__ import annotations

import gc
import sys
import threading

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.meta.lock import ShmLock


def _values(n: int) -> dict[str, object]:
    return {f"k{i}": (np.arange(i, dtype=np.int64) if i % 3 == 0 else b"x" * i if i % 3 == 1 else {"i": i})
            for i in range(n)}


def _same(a, b) -> bool:
    if isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    return bytes(a) == b if isinstance(b, bytes) else a == b


def test_put_many_then_get_many_round_trips_in_order(store):
    items = _values(200)
    infos = store.put_many(items)
    assert [i.key for i in infos] == list(items) and all(i.sealed and i.level is Level.MEMORY for i in infos)
    assert infos[3].kind == "ndarray" and infos[4].kind == "bytes"
    keys = list(reversed(items)) + ["k3", "k3"]  # any order, repeats allowed
    got = store.get_many(keys)
    assert len(got) == len(keys) and all(_same(g, items[k]) for g, k in zip(got, keys))
    assert not got[-1].flags.writeable and np.shares_memory(got[-1], got[-2])  # zero-copy views, as get's
    assert store.keys() and len(store.keys()) == 200 and not store.check()


def test_put_many_takes_pairs_and_the_last_value_of_a_key_wins(store):
    infos = store.put_many([("a", 1), ("b", 2), ("a", 3)])
    assert [i.key for i in infos] == ["a", "b"] and store.get_many(["a", "b"]) == [3, 2]
    assert store.put_many({}) == [] and store.get_many([]) == [] and store.delete_many([]) == 0


def test_put_many_of_a_present_key_stores_none_and_names_it(store):
    store.put("k5", b"old")
    with pytest.raises(shmstore.ObjectExistsError, match=r"put_many of 10 keys stopped, none done: 'k5'") as ei:
        store.put_many(_values(10))
    assert ei.value.done == [] and ei.value.object_id == "k5"
    assert store.keys() == ["k5"] and bytes(store.get("k5")) == b"old"  # nothing else became visible
    assert not store.check() and store.get_capacity()[Level.MEMORY].objects == 1


def test_put_many_overwrite_replaces_atomically_and_old_views_stay_valid(store):
    store.put_many({"a": np.full(1000, 1.0), "b": b"one"})
    old = store.get("a")
    store.put_many({"a": np.full(1000, 2.0), "b": b"two", "c": 3}, overwrite=True)
    assert store.get_many(["a", "b", "c"])[1:] == [b"two", 3] and store.get("a")[0] == 2.0
    assert old[0] == 1.0 and old.sum() == 1000.0  # the replaced object lives on under its view
    del old
    gc.collect()
    assert not store.check()


def test_bad_key_or_value_in_a_batch_stores_nothing(store):
    with pytest.raises(shmstore.InvalidKeyError):
        store.put_many({"good": 1, "": 2})
    with pytest.raises(shmstore.SerializationError, match="'bad'"):
        store.put_many({"good": 1, "bad": threading.Lock()})  # nor pickle nor cloudpickle takes it
    assert "good" not in store and not store.check()


def test_put_many_larger_than_memory_spills_key_by_key(name, tmp_path):
    with shmstore.connect(name, capacity="8MiB", spill_dir=str(tmp_path), prefault=0) as s:
        items = {f"a{i}": np.full(1 << 18, i, dtype=np.float64) for i in range(8)}  # 16 MiB: twice MEMORY
        infos = s.put_many(items)
        assert [i.key for i in infos] == list(items)  # placed one by one, the spill process making room
        assert {i.level for i in s.list()} == {Level.MEMORY, Level.DISK}
        got = s.get_many(list(items))
        assert [float(g[0]) for g in got] == [float(i) for i in range(8)]
        del got
        gc.collect()
        assert s.put_many({"d": b"x"}, levels=[Level.DISK])[0].level is Level.DISK
        assert not s.check()


def test_get_many_of_a_missing_key_names_the_first_and_leaves_nothing_pinned(store):
    store.put_many({"a": np.arange(10), "b": b"b"})
    with pytest.raises(KeyError, match=r"no object 'x' .*get_many of 4 keys: 2 missing") as ei:
        store.get_many(["a", "x", "b", "y"])
    assert isinstance(ei.value, shmstore.ObjectNotFoundError) and ei.value.object_id == "x"
    assert store.get_capacity()[Level.MEMORY].pinned == 0  # the pins taken for 'a' and 'b' were given back
    store.delete_many(["a", "b"])
    assert store.node_store.nobjects() == 0


def test_get_many_with_levels_brings_spilled_objects_back(name, tmp_path):
    with shmstore.connect(name, capacity="8MiB", spill_dir=str(tmp_path), prefault=0) as s:
        s.put_many({"a": np.arange(100)}, levels=[Level.DISK])
        [a] = s.get_many(["a"], levels=[Level.MEMORY])
        assert s.get_info("a").level is Level.MEMORY and a[99] == 99


def test_delete_many_stops_at_a_missing_key_naming_what_was_deleted(store):
    store.put_many(_values(20))
    assert store.delete_many(["k1", "k2", "k1"]) == 2  # a repeated key counts once
    with pytest.raises(shmstore.ObjectNotFoundError, match=r"delete_many of 2 keys stopped.*'k1'") as ei:
        store.delete_many(["k3", "k1"])
    assert "k1" not in ei.value.done and set(ei.value.done) <= {"k3"}
    assert store.delete_many(["k4", "nope"], missing_ok=True) == 1
    left = len(store.keys())
    assert store.delete_many(store.keys()) == left and store.keys() == [] and not store.check()


def test_a_batch_takes_each_stripe_lock_once_per_step_not_once_per_key(store):
    """Counted on the stripe locks themselves (a profile hook on their ``__enter__``): 1,000 keys over the
    64 stripes take each stripe's lock once to reserve and once to seal (put_many), once to look up
    (get_many), once to delete (delete_many)."""
    stripes = {id(lock): s for s, lock in enumerate(store.node_store.stripes)}
    enter = ShmLock.__enter__.__code__
    taken: list[int] = []

    def count(frame, event, arg):
        if event == "call" and frame.f_code is enter and id(frame.f_locals["self"]) in stripes:
            taken.append(stripes[id(frame.f_locals["self"])])

    keys = [f"key-{i}" for i in range(1000)]
    used = {store.kernel.begin(k).stripe for k in keys}
    for verb, times in ((lambda: store.put_many({k: b"v" * 64 for k in keys}), 2),
                        (lambda: store.get_many(keys), 1), (lambda: store.delete_many(keys), 1)):
        taken.clear()
        sys.setprofile(count)
        try:
            verb()
        finally:
            sys.setprofile(None)
        assert sorted(taken) == sorted(list(used) * times)
    assert len(used) > 32 and not store.check()
