"""client/puts.py: one general put path, plus the optional shortcut of a level that has one (try_put)."""
from __future__ import annotations

import numpy as np
import pytest

from shmstore import Level
from shmstore.levels.memory import MemoryLevel
from shmstore.meta import fastpath
from shmstore.meta import layout as L
from shmstore.meta.keyref import Contents, Reservation, key_ref


def test_small_values_take_the_levels_shortcut_and_everything_else_the_general_way(store, monkeypatch):
    if fastpath.load() is None:
        pytest.skip("no C fast path here (not built, or SHMSTORE_PURE_PYTHON=1): no shortcut to take")
    calls: list[tuple[str, bool, bool]] = []  # (key, with bytes to copy, done by the shortcut)
    try_put = MemoryLevel.try_put

    def counted(self, at, ref, what, give_up):
        done = try_put(self, at, ref, what, give_up)
        calls.append((ref.key, what.src is not None, done is not None))
        return done

    monkeypatch.setattr(MemoryLevel, "try_put", counted)  # before the kernel's first put looks it up
    strided = np.arange(100)[::3]
    store.put("small", b"abc")
    store.put("small", b"xyz", overwrite=True)  # an overwrite needs a shadow entry: the general way
    store.put("pickled", {"a": 1})  # no one buffer to copy: reserved by it, written here
    store.put("strided", strided)  # the C call copies contiguous bytes only: reserved by it, written here
    store.put("on disk", b"d", levels=[Level.DISK])  # a level without a shortcut
    assert calls == [("small", True, True), ("pickled", False, True), ("strided", True, False),
                     ("strided", False, True)]
    assert store.get("small") == b"xyz" and store.get("pickled") == {"a": 1} and store.get("on disk") == b"d"
    assert np.array_equal(store.get("strided"), strided)
    assert store.check() == []


def test_a_key_ref_names_where_the_key_hashes():
    ref = key_ref("k", b"k", 3, 0xFF, 0x0F)
    assert ref.key == "k" and ref.kb == b"k" and ref.bucket == ref.h & 0xFF
    assert ref.stripe == (ref.bucket >> L.STRIPE_SHIFT) & 0x0F  # a stripe owns whole cache lines of heads
    assert key_ref("k", b"k", 4, 0xFF, 0x0F).h != ref.h  # seeded with the session
    assert Contents(1, 10, 10).src is None and Reservation(1, 2, 3, 4, 5.0, 6).stripe == 6


def test_reserve_seal_and_abort_through_kernel_puts(store):
    k = store.kernel
    r = k.puts.reserve(k.begin("w"), Contents(L.KIND_RAW, 5, 5), Level.MEMORY)
    assert "w" not in store  # reserved: invisible until sealed
    k.puts.seal(r.idx, r.stripe)
    assert "w" in store
    r = k.puts.reserve(k.begin("gone"), Contents(L.KIND_RAW, 5, 5), Level.DISK)
    k.puts.abort(r.idx)
    assert "gone" not in store and store.check() == []


def test_an_overwrite_swapped_in_last_is_the_latest_created_whenever_it_was_reserved(store):
    """Two overwrites of one key at once (two ranks of a node): the one reserved first but swapped in second
    is what the key holds, so its creation time is later than the object it replaced; a cluster's directory
    tells a node's objects apart by it (a stale name there once let Cluster.delete leave a copy)."""
    k = store.kernel
    store.put("k", b"first")
    early = k.puts.reserve(k.begin("k"), Contents(L.KIND_RAW, 5, 5), Level.MEMORY, shadow=True)
    late = store.put("k", b"later", overwrite=True)  # reserved after `early`, swapped in before it
    assert late.created > early.ctime
    created = k.puts.replace(k.begin("k"), early.idx, early.stripe)
    assert created > late.created and store.get_info("k").created == created
    small = store.put("s", b"x")  # the C shortcut stamps it under the stripe lock too
    assert store.get_info("s").created == small.created
    assert store.check() == []
