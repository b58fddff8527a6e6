"""Kernel.read_small: a small object in memory read in one C call under its stripe lock (what a node service
sends for a remote read), equal to what the general path reads, or None where that path must do it."""
from __future__ import annotations

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.meta import layout as L


def general(store, key):
    k = store.kernel
    idx, e, _ = k.lookup(k.begin(key), True)
    array = L.entry_array_bytes(k._buf, k._lay.entry(idx)) if e[L.E_KIND] == L.KIND_NDARRAY else None
    return e[L.E_KIND], e[L.E_NBYTES], e[L.E_NBLOBS], array, k.copy_pinned(idx, e)


def test_read_small_matches_the_general_path_and_leaves_no_pin(store):
    values = {"arr": np.arange(10, dtype=np.float32).reshape(2, 5), "fort": np.asfortranarray(np.ones((3, 4))),
              "raw": b"\x00\x01hello", "empty": b"", "obj": {"a": [1, 2], "b": np.arange(3)}, "s": "text"}
    for key, value in values.items():
        store.put(key, value)
    for key in values:
        got = store.kernel.read_small(key, 1 << 16)
        assert got is not None and got == general(store, key), key
        assert store.get_info(key).pins == 0  # nothing pinned, nothing leased
    with pytest.raises(shmstore.ObjectNotFoundError):
        store.kernel.read_small("nothing", 1 << 16)


def test_read_small_leaves_larger_and_spilled_objects_to_the_general_path(store):
    store.put("big", np.zeros(1000, np.uint8))
    assert store.kernel.read_small("big", 999) is None and store.kernel.read_small("big", 1000) is not None
    store.put("cold", np.arange(5), levels=[Level.DISK])
    assert store.kernel.read_small("cold", 1 << 16) is None
    store.delete("big")
    with pytest.raises(shmstore.ObjectNotFoundError):
        store.kernel.read_small("big", 1 << 16)
