"""Kernel.export: an object as a node service hands it to another node (shmstore.mpi's lookups): small ones
inline, copied out with no pin left; larger ones as a lease that holds the pin until dropped; on any level."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.meta import layout as L


def test_a_small_object_comes_inline_and_leaves_no_pin(store):
    a = np.arange(100, dtype=np.float64)
    store.put("a", a)
    x = store.kernel.export("a", 64 << 10)
    assert x.kind == L.KIND_NDARRAY and x.nbytes == a.nbytes and x.array_meta is not None
    assert x.lease is None and x.inline == a.tobytes()
    assert not store.get_info("a").pinned


def test_a_larger_object_comes_as_a_lease_holding_its_pin(store):
    store.put("b", b"\x07" * 5000)
    x = store.kernel.export("b", 1024)
    assert x.inline is None and x.lease is not None and x.array_meta is None
    assert bytes(x.lease[: x.nbytes]).count(b"\x07") == 5000 and store.get_info("b").pinned
    del x
    gc.collect()
    assert not store.get_info("b").pinned


def test_a_small_object_on_disk_comes_inline_too(store):
    store.put("d", b"on disk", levels=Level.DISK)
    x = store.kernel.export("d", 1024)
    assert x.lease is None and x.inline is not None and b"on disk" in x.inline
    assert not store.get_info("d").pinned


def test_a_missing_key_raises(store):
    with pytest.raises(shmstore.ObjectNotFoundError):
        store.kernel.export("nothing", 1024)
