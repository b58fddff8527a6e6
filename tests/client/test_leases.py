"""Kernel.lease: the view of a pinned object that gives the pin back with its last reference; a view that cannot
be made gives it back at once, whatever the error (issue 23: only OSError did, and a device object's reader
raised TypeError with its pin kept)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.meta import layout as L

MiB = 1 << 20
SHORT = r"cannot read '(k|raw)' \(1\.0 MiB, entry \d+\) on disk: its file is shorter .* truncated"


def _entry(store, key: str) -> tuple[int, int]:
    """(index, entry offset) of ``key``'s entry."""
    found = store.kernel.lookup(store.kernel.begin(key), False)
    return found.idx, store.node_store.layout.entry(found.idx)


def _spill_file(store, key: str) -> str:
    found = store.kernel.lookup(store.kernel.begin(key), False)
    files = store.node_store.levels[Level.DISK].files
    return os.path.join(files.path, f"{files.tag}.{found.idx}.{found.entry.gen}")


def test_a_truncated_spill_file_is_a_clear_error_and_leaves_no_pin(store):
    """A DISK object whose file lost its tail (mmap: "length is greater than file size", a ValueError): every
    way of reading it says so as a SpillError, and none leaves the object pinned (a pin would make its delete
    wait forever)."""
    store.put("k", np.arange(MiB // 8), levels=Level.DISK)
    store.put("raw", b"\x05" * MiB, levels=Level.DISK)
    for key in ("k", "raw"):
        os.truncate(_spill_file(store, key), 4096)
    for read in (lambda: store.get("k"), lambda: store.get_many(["k"]), lambda: store.get("raw"),
                 lambda: store.open_reader("raw")):
        with pytest.raises(shmstore.SpillError, match=SHORT):
            read()
        assert not store.get_info("k").pinned and not store.get_info("raw").pinned
    store.delete_many(["k", "raw"])  # nothing holds them: gone at once
    assert "k" not in store and "raw" not in store and store.check() == []


def test_a_damaged_array_record_fails_the_get_and_leaves_no_pin(store, name):
    """An array record naming more bytes than the object has (numpy: "buffer is too small", a TypeError): the
    get fails, through the C fast path and through a lease alike, and the pin goes with the error."""
    value = np.arange(1000, dtype=np.float64)
    store.put("a", value)
    idx, eoff = _entry(store, "a")
    buf = store.node_store.buf
    good = L.entry_array_bytes(buf, eoff)
    L.set_entry_array(buf, eoff, L.array_meta("<f8", (1 << 40,), "C"))
    try:
        with shmstore.connect(name) as other:  # a client that has not read it yet (none of its record cached)
            for read in (lambda: other.get("a"), lambda: other.get_many(["a"])):
                with pytest.raises((TypeError, ValueError)):
                    read()
                assert not other.get_info("a").pinned
    finally:
        L.set_entry_array(buf, eoff, good)
    assert np.array_equal(store.get("a"), value)  # whole again, with its record
    assert not store.get_info("a").pinned
    store.delete("a")
    assert store.check() == []
