"""``store.mapping()``: a true MutableMapping with dict semantics, driven by zict as a library would."""
from __future__ import annotations

import gc
import pickle
import random
from collections.abc import MutableMapping

import numpy as np
import pytest

import shmstore
from shmstore import Level

zict = pytest.importorskip("zict", reason="zict is not installed (pip install 'shmstore[test]')")


def test_is_a_mutable_mapping_with_dict_semantics(store):
    m = store.mapping()
    assert isinstance(m, MutableMapping) and not m and len(m) == 0  # an empty one is false, like a dict
    m["a"] = np.arange(5)
    m["b"] = b"bytes"
    m["c"] = {"x": 1}
    assert m and len(m) == 3 and sorted(m) == ["a", "b", "c"] and "a" in m and "z" not in m and 5 not in m
    assert sorted(m.keys()) == ["a", "b", "c"] and m.get("z") is None and m.get("z", 7) == 7
    np.testing.assert_array_equal(m["a"], np.arange(5))
    assert not m["a"].flags.writeable  # values as get returns them: read-only zero-copy views
    m["a"] = "replaced"  # = is an overwrite
    assert dict(m.items()) == {"a": "replaced", "b": b"bytes", "c": {"x": 1}} == m
    assert sorted(str(bytes(v)) if isinstance(v, memoryview) else str(v) for v in m.values()) == \
        ["b'bytes'", "replaced", "{'x': 1}"]  # bytes-like values come back as memoryviews, as from get
    with pytest.raises(KeyError, match="'z'"):
        m["z"]
    with pytest.raises(KeyError):
        del m["z"]
    assert m.pop("c") == {"x": 1} and m.pop("c", None) is None and "c" not in m
    assert m.setdefault("d", 4) == 4 and m.setdefault("d", 5) == 4
    m.update({"e": 5}, f=6)
    key, value = m.popitem()
    assert key not in m and value is not None
    m.clear()
    assert len(m) == 0 and store.keys() == [] and not store.check()


IMPOSSIBLE = [123, ("t", 1), b"bytes", None, "", "x" * 256, "\udc80"]


@pytest.mark.parametrize("key", IMPOSSIBLE, ids=lambda k: repr(k)[:12])
def test_an_impossible_key_is_answered_as_a_missing_one(store, key):
    """A key no object can have (not a str, empty, too long, not UTF-8) is missing to every lookup, as ``123`` is
    from a dict of str: ``in`` is False, ``get`` and ``pop`` give the default, ``[]`` and ``del`` raise KeyError
    (InvalidKeyError, a KeyError and a ValueError; issue 30 item 11: it was a ValueError only, and ``in``
    raised it). Storing under it still raises InvalidKeyError."""
    m = store.mapping()
    store.put("a", 1)
    assert key not in store and key not in m
    assert m.get(key) is None and m.get(key, 7) == 7 and m.pop(key, None) is None
    with pytest.raises(KeyError):
        m[key]
    with pytest.raises(KeyError):
        del m[key]
    with pytest.raises(KeyError):
        m.pop(key)
    with pytest.raises(shmstore.InvalidKeyError) as err:
        m[key] = 1
    assert isinstance(err.value, ValueError) and isinstance(err.value, KeyError)
    assert not str(err.value).startswith(("'", '"'))  # the message, not KeyError's repr of it
    with pytest.raises(shmstore.InvalidKeyError):
        m.setdefault(key, 1)
    for verb in (lambda: store.get(key, None), lambda: store.pop(key, None), lambda: store.delete(key, True)):
        with pytest.raises(shmstore.InvalidKeyError):  # the store's own verbs: a bad key is a bug, not a miss
            verb()
    assert dict(m) == {"a": 1} and not store.check()


def test_behaves_like_a_dict_under_random_operations(store):
    m, ref, rng = store.mapping(), {}, random.Random(21)
    for step in range(600):
        key, op = f"k{rng.randrange(30)}", rng.random()
        if op < 0.5:
            m[key] = ref[key] = step
        elif op < 0.7:
            assert (key in m) == (key in ref)
            if key in ref:
                del m[key], ref[key]
        elif op < 0.8:
            assert m.pop(key, None) == ref.pop(key, None)
        else:
            assert m.get(key) == ref.get(key)
    assert dict(m) == ref and len(m) == len(ref) and set(m) == set(ref)
    assert not store.check()


def test_pickles_as_the_store_settings(store):
    store.mapping()["a"] = 1
    other = pickle.loads(pickle.dumps(store.mapping()))
    try:
        assert isinstance(other, shmstore.StoreMapping) and other["a"] == 1 and other.store is not store
    finally:
        other.store.close()


def test_zict_buffer_round_trips_through_the_store(store):
    buf = zict.Buffer(fast={}, slow=store.mapping(), n=10, weight=lambda k, v: 1)
    for i in range(50):
        buf[f"x{i}"] = np.full(100, i)
    assert len(buf.fast) == 10 and len(store) == 40  # the cold ones went to the store
    for i in range(50):
        np.testing.assert_array_equal(buf[f"x{i}"], np.full(100, i))  # and come back (slow to fast)
    del buf["x0"]
    assert "x0" not in buf and "x0" not in store.mapping() and len(buf) == 49
    buf.clear()
    assert len(store) == 0 and not store.check()


def test_zict_buffer_over_a_store_that_spills_to_disk_and_back(name, tmp_path):
    """zict keeps the 4 most recent arrays in a dict (its LRU) and evicts the rest to the store, whose MEMORY
    (8 MiB) holds a third of them: the store's spill process moves the cold ones to DISK, and all come back
    intact through zict."""
    with shmstore.connect(name, capacity="8MiB", spill_dir=str(tmp_path), prefault=0) as s:
        lru = zict.Buffer(fast={}, slow=s.mapping(), n=4, weight=lambda k, v: 1)
        want = {f"a{i}": np.full(1 << 17, i, dtype=np.float64) for i in range(24)}  # 1 MiB each, 24 MiB
        for k, v in want.items():
            lru[k] = v
        assert {i.level for i in s.list()} == {Level.MEMORY, Level.DISK}  # spilled by the store
        for k in reversed(list(want)):  # from the store, from disk too
            got = lru[k]
            assert got[0] == want[k][0] and got.sum() == want[k].sum()
            del got
        gc.collect()
        assert len(lru) == 24 and sorted(lru) == sorted(want) and not s.check()
        for k in list(want)[:12]:
            del lru[k]
        assert len(lru) == 12 and len(s) + len(lru.fast) == 12 and not s.check()
