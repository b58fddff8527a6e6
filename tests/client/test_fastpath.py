"""The optional C fast path and the pure-Python kernel behave the same."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from shmstore.client import kernel
from shmstore.meta import fastpath

from helpers import ROOT


def test_the_extension_is_used_where_it_was_built():
    built = glob.glob(os.path.join(ROOT, "shmstore", "meta", "_fast*.so")) or fastpath.load() is not None
    assert (kernel._fast is not None) == bool(built)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_pure_python_kernel_passes_the_store_tests():
    env = dict(os.environ, SHMSTORE_PURE_PYTHON="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                        "tests/test_store.py", "tests/test_streams.py", "tests/scenarios/test_processes.py",
                        "-k", "not gc_removes"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert " passed" in r.stdout and " failed" not in r.stdout


def test_fast_path_is_configured_from_the_entry_declaration():
    from shmstore.meta import layout as L
    lay = L.fast_path_layout()
    for f in L.ENTRY_HEAD.fields:
        if f.name not in ("target_extent", "target"):  # 0 in a reserved entry: C leaves them
            assert lay[f"{f.name}_off"] == f.offset, f.name
    assert (lay["entry_size"], lay["array_off"], lay["key_off"]) == (L.ENTRY_SIZE, L.ENTRY_ARRAY_OFFSET,
                                                                     L.ENTRY_KEY_OFFSET)
    assert lay["stats_objects_off"] == L.STRIPE_STATS.offset["objects"]
    widths = {f.name: f.size for f in L.ENTRY_HEAD.fields}
    for name, width in widths.items():
        if f"{name}_off" in lay:
            assert lay[f"{name}_width"] == width, name
    assert lay["bucket_width"] == L.BUCKET.size and lay["array_size"] == L.ENTRY_ARRAY.size
    used = next(f for f in L.STRIPE_STATS.fields if f.name == "used")
    assert lay["stats_used_width"] * used.n == used.size and lay["stats_used_off"] == used.offset


@pytest.mark.parametrize("field", ["size_width", "state_width", "bucket_width", "stats_used_width"])
def test_configure_refuses_a_layout_with_a_field_of_another_width(field):
    """A record that widens a field the C code stores with a fixed type is refused, not written wrongly."""
    from shmstore.meta import layout as L
    fast = fastpath.load()
    if fast is None:
        pytest.skip("the C fast path is not built here (pure-Python kernel)")
    lay = L.fast_path_layout()
    lay[field] *= 2
    with pytest.raises(ValueError, match=f"the layout's {field} is {lay[field]} bytes, _fast.c stores it in "
                                         f"{lay[field] // 2}.*rebuild"):
        fast.configure(lay)
    fast.configure(L.fast_path_layout())  # the real layout is still taken


def test_the_c_tuples_are_in_the_declared_order(store):
    """get_entry's and read_small's tuples unpack as fastpath.Found and fastpath.Small say."""
    import numpy as np

    from shmstore.meta import layout as L
    k = store.kernel
    if k._fast is None:
        pytest.skip("the C fast path is not built here (pure-Python kernel)")
    store.put("arr", np.arange(6, dtype=np.int32))
    r = fastpath.Found._make(k._fast.get_entry(k._ctx, "arr"))
    e = L.entry(k._buf, r.eoff)
    try:
        assert r.eoff == k._lay.entry(r.idx)
        assert (r.gen, r.offset, r.level, r.nbytes, r.kind) == (e.gen, e.offset, e.level, e.nbytes, e.kind)
    finally:
        k._fast.release(k._ctx, r.idx)
    s = fastpath.Small._make(k._fast.read_small(k._ctx, "arr", 1 << 20, k._state.arena_addr, L.LEVEL_MEMORY,
                                                L.KIND_NDARRAY, L.ENTRY_ARRAY.size))
    assert (s.kind, s.nbytes, s.nblobs) == (L.KIND_NDARRAY, 24, 0)
    assert s.data == np.arange(6, dtype=np.int32).tobytes()
    assert s.array == L.entry_array_bytes(k._buf, r.eoff)


def test_c_insert_writes_every_field_where_python_reads_it(store):
    """The C fast path writes an entry field by field; Python reads it through the declaration."""
    import numpy as np

    from shmstore.meta import layout as L
    k = store.kernel
    if k._fast is None:
        pytest.skip("the C fast path is not built here (pure-Python kernel)")
    a = np.arange(12, dtype=np.int16).reshape(3, 4)
    store.put("arr", a)
    idx, e, array = k.lookup(k.begin("arr"), False)
    head = L.entry(k._buf, k._lay.entry(idx))
    assert (head.size, head.nbytes, head.state, head.kind, head.level) == (64, 24, L.SEALED, L.KIND_NDARRAY,
                                                                          L.LEVEL_MEMORY)
    assert (head.keylen, head.session, head.writer, head.flags) == (3, k.sid, k.slot, L.FLAG_IN_CHUNK)
    assert head.hash == __import__("zlib").crc32(b"arr", k.sid) and head.extent > 0
    assert head.target_extent == 0 and head.target == 0
    assert array == (np.dtype(np.int16), (3, 4), "C")
    assert L.entry_key(k._buf, k._lay.entry(idx), 3) == b"arr"


def test_fast_get_refreshes_the_access_time_and_releases_its_pin(store):
    import time

    import numpy as np

    from shmstore.meta import layout as L
    store.put("a", np.arange(4))
    k = store.kernel
    idx = k.lookup(k.begin("a"), False).idx
    before = L.entry_raw(k._buf, k._lay.entry(idx))[L.E_ATIME]
    time.sleep(0.1)
    view = store.get("a")
    assert k._pins.get(idx) == 1
    assert L.entry_raw(k._buf, k._lay.entry(idx))[L.E_ATIME] > before + 0.05
    del view
    assert idx not in k._pins


def _head_after_python_delete(store, key):
    """The entry head, stripe record and cache entry that the pure-Python steps of delete leave for ``key``."""
    from shmstore.client import kernel as kmod
    from shmstore.meta import layout as L
    k = store.kernel
    saved, kmod._fast = kmod._fast, None
    try:
        idx = k.lookup(k.begin(key), False).idx
        stripe = k._table.stripe_of(idx)
        k.delete(key)
    finally:
        kmod._fast = saved
    return (L.entry_raw(k._buf, k._lay.entry(idx)), bytes(L.stats_table(k._buf, k._lay)[stripe].tobytes()),
            k._supply.entries[-1])


def test_c_delete_leaves_what_the_python_steps_leave(store, name):
    """The C delete of an unpinned object cut from a chunk: entry head (every field), stripe counters and
    the entry handed back to this client's cache, byte for byte as the Python steps leave them."""
    import shmstore
    from shmstore.meta import layout as L
    k = store.kernel
    if k._fast is None:
        pytest.skip("the C fast path is not built here (pure-Python kernel)")
    for key in ("a", "b"):
        store.put(key, b"x" * 300)
    # same stripe state before each delete: delete "a" the Python way, put it back, then both ways compared
    py_head, py_stats, (py_idx, py_gen) = _head_after_python_delete(store, "a")
    store.put("a", b"x" * 300)
    idx = k.lookup(k.begin("a"), False).idx
    stripe = k._table.stripe_of(idx)
    store.delete("a")
    c_head = L.entry_raw(k._buf, k._lay.entry(idx))
    assert k._supply.entries[-1] == (idx, c_head[L.E_GEN])
    fields = [f.name for f in L.ENTRY_HEAD.fields]
    for name_, pv, cv in zip(fields, py_head, c_head):
        if name_ != "gen":
            assert pv == cv, name_
    assert c_head[L.E_STATE] == L.RESERVED and c_head[L.E_WRITER] == k.slot and c_head[L.E_EXTENT] == 0
    assert py_idx == idx and bytes(L.stats_table(k._buf, k._lay)[stripe].tobytes()) == py_stats
    assert "a" not in store and "b" in store and store.check() == []
    # pinned by another process's view: hidden and unlinked, freed by the last pin
    other = shmstore.connect(name)
    try:
        view = other.get("b")
        idx = k.lookup(k.begin("b"), False).idx
        store.delete("b")
        assert "b" not in store and "b" not in other
        assert L.entry_raw(k._buf, k._lay.entry(idx))[L.E_STATE] == L.DELETED
        assert bytes(view[:3]) == b"xxx"
        del view
        other.kernel.check_open()
        assert L.entry_raw(k._buf, k._lay.entry(idx))[L.E_STATE] != L.DELETED
    finally:
        other.close()
    with pytest.raises(shmstore.errors.ObjectNotFoundError, match="'b' to delete"):
        store.delete("b")
    store.delete("b", missing_ok=True)
    # a large object (its own extent, not in a chunk): the general way frees its space
    store.put("big", b"y" * (4 << 20))
    store.delete("big")
    assert "big" not in store and store.check() == []


@pytest.mark.parametrize("value", [b"x" * 300, "array"])
def test_c_put_small_leaves_what_the_steps_leave(store, value):
    """A small put in one C call (put_small: cut, copy, entry, seal) leaves the entry (every field of its head
    and its key and array record), the stripe counters and the bytes as the steps one by one (cut in Python,
    the C insert) leave them; only the offset (the cut moved on), the times and the generation differ."""
    import numpy as np

    from shmstore.meta import layout as L
    k = store.kernel
    if k._state.ops is None or k._state.ops.ctx is None:
        pytest.skip("the C fast path is not built here (pure-Python kernel)")
    value = np.arange(40, dtype=np.float32).reshape(5, 8) if value == "array" else value
    fields = [f.name for f in L.ENTRY_HEAD.fields]
    seen = []
    ops = k._state.ops
    for ctx in (None, ops.ctx):  # the steps first, then put_small (on the entry the delete handed back)
        saved, ops.ctx = ops.ctx, ctx
        try:
            store.put("a", value)
        finally:
            ops.ctx = saved
        idx = k.lookup(k.begin("a"), False).idx
        eoff = k._lay.entry(idx)
        stripe = k._table.stripe_of(idx)
        rest = k._buf[eoff + L.ENTRY_HEAD.struct.size: k._lay.entry(idx + 1)]  # its key and array record
        seen.append((idx, L.entry_raw(k._buf, eoff), bytes(rest), bytes(L.stats_table(k._buf, k._lay)[stripe])))
        got = store.get("a")
        assert bytes(got) == value if isinstance(value, bytes) else np.array_equal(got, value)
        del got
        store.delete("a")
    (i1, steps, rest1, stats1), (i2, small, rest2, stats2) = seen
    assert i1 == i2 and rest1 == rest2 and stats1 == stats2
    for name_, a, b in zip(fields, steps, small):
        if name_ not in ("offset", "atime", "ctime", "gen"):
            assert a == b, name_
    assert small[L.E_OFFSET] == steps[L.E_OFFSET] + steps[L.E_SIZE]  # the next cut of the same chunk
    assert small[L.E_FLAGS] & L.FLAG_IN_CHUNK and small[L.E_STATE] == L.SEALED
    assert store.check() == []


def test_a_build_without_put_small_puts_small_values_the_steps_way(name, monkeypatch):
    """An extension built before put_small (it has the C insert and delete, not put_small nor put_config):
    small puts go the steps one by one, never to a missing function."""
    import types

    import numpy as np

    import shmstore
    from shmstore.client import kernel as kmod
    if kmod._fast is None:
        pytest.skip("the C fast path is not built here (pure-Python kernel)")
    older = types.SimpleNamespace(**{n: getattr(kmod._fast, n) for n in dir(kmod._fast)
                                     if not n.startswith("__") and n not in ("put_small", "put_config")})
    monkeypatch.setattr(kmod, "_fast", older)
    with shmstore.connect(name, capacity="8MiB") as s:
        assert s.kernel._state.ops.ctx is None and s.kernel._state.fast is older
        for i in range(100):
            s.put(f"k{i}", bytes([i]) * (i + 1))
            s.put(f"a{i}", np.full(i + 1, i))
        assert all(bytes(s.get(f"k{i}")) == bytes([i]) * (i + 1) for i in range(100))
        assert all((s.get(f"a{i}") == i).all() for i in range(100))
        assert s.check() == []
