"""Views of stored objects are read-only for real (issue 30 item 4).

``v = store.get("a"); v.setflags(write=True); v[:] = 42`` used to succeed and
change the object under every process (numpy allowed it: the view's last
base was the writable mapping of the arena). Every view is now built over a
read-only (``PROT_READ``) mapping of the arena, or of the spill file: numpy
refuses ``setflags(write=True)`` on it and on every view derived from it, and
a write that ignores the flags (ctypes, a torch tensor) kills the writing
process with SIGSEGV instead of changing the object. Checked here for every
way a view is handed out, in the process that put the objects and in others,
each of which then reads the objects unchanged (checksummed); writers
(``open_writer``, ``put(..., overwrite=True)``) keep working.
"""
from __future__ import annotations

import signal

import numpy as np
import pytest

from shmstore import Level

from helpers import Child, wait_for

MiB = 1 << 20

# the values every test stores: small arrays (the C fast path), large ones, Fortran order, containers (pickled,
# arrays as blobs), raw bytes, and each kind on DISK (mapped from its spill file)
SETUP = """
import hashlib
import numpy as np
from shmstore import Level

def values():
    return {
        "arr": np.arange(1000, dtype=np.int64),
        "big": np.arange(MiB, dtype=np.float64),
        "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        "dict": {"w": np.arange(100.0), "nested": [np.ones(10), (np.full(3, 7),)], "n": 3},
        "list": [np.arange(10), np.arange(5.0)],
        "raw": b"\\x07" * 4096,
        "disk": np.arange(1000),
        "disk_dict": {"w": np.arange(50.0)},
        "disk_raw": b"\\x09" * 4096,
    }

def put_all(store):
    for key, value in values().items():
        store.put(key, value, levels=[Level.DISK] if key.startswith("disk") else None)

def arrays(value):
    '''Every ndarray a stored value hands out (raw bytes: the arrays a user makes of them).'''
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, memoryview):
        return [np.frombuffer(value, np.uint8), np.asarray(value), value.obj]
    if isinstance(value, dict):
        return [a for v in value.values() for a in arrays(v)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in arrays(v)]
    return []

def derived(a):
    '''``a``, views derived from it, every ndarray of its base chain, and an array over its last base.'''
    flat = a.ravel(order="K")  # a view: stored arrays are contiguous in C or Fortran order
    out = [v for v in (a, a[1:], a.T, np.asarray(a), flat, flat.view(np.uint8)) if np.may_share_memory(v, a)]
    base = a.base
    while isinstance(base, np.ndarray):
        out.append(base)
        base = base.base
    if base is not None:
        out.append(np.frombuffer(base, np.uint8))
    return out

def try_writes(store, value):
    '''Make each array writable and write into it; how many writes went through.'''
    done = 0
    for a in arrays(value):
        for v in derived(a):
            try:
                v.setflags(write=True)
                v[(0,) * v.ndim] = 42
                done += 1
            except ValueError:  # "cannot set WRITEABLE flag to True of this array"
                pass
    return done

def checksum(value):
    h = hashlib.sha256()
    for a in arrays(value)[:1] if isinstance(value, memoryview) else arrays(value):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
""".replace("MiB", str(MiB))

ns: dict = {}
exec(SETUP, ns)  # the same helpers here and in the children
values, put_all, arrays, derived, try_writes, checksum = (ns[n] for n in ("values", "put_all", "arrays", "derived",
                                                                          "try_writes", "checksum"))

# every way a get hands out a value
GETS = {
    "get": lambda s, k: s.get(k),
    "get_many": lambda s, k: s.get_many([k])[0],
    "store[key]": lambda s, k: s[k],
    "mapping": lambda s, k: s.mapping()[k],
    "mapping.get": lambda s, k: s.mapping().get(k),
    "levels=MEMORY": lambda s, k: s.get(k, levels=[Level.MEMORY]) if not k.startswith("disk") else s.get(k),
}

READER = SETUP + """
import os, sys, shmstore
with shmstore.connect(os.environ["N"]) as s:
    print(" ".join(f"{k}={checksum(s.get(k))}" for k in values()), flush=True)
"""


def _checksums() -> dict[str, str]:
    return {k: checksum(v if not isinstance(v, bytes) else memoryview(v)) for k, v in values().items()}


def _read_in_another_process(name: str) -> dict[str, str]:
    child = Child(READER, env={"N": name})
    line = child.readline(timeout=60)
    child.wait()
    return dict(item.split("=") for item in line.split())


@pytest.mark.parametrize("how", sorted(GETS))
def test_no_view_of_a_stored_value_can_be_made_writable(store, how):
    put_all(store)
    for key in values():
        value = GETS[how](store, key)
        assert try_writes(store, value) == 0, f"{key} through {how}: a view was made writable"
    assert {k: checksum(store.get(k)) for k in values()} == _checksums()


def test_views_through_conditions_and_refs_refuse_too(store):
    store.put("big", np.arange(MiB, dtype=np.float64))
    assert try_writes(store, store.get("big", conditions=(slice(10, 20),))) == 0
    with store.share({"w": np.arange(100)}) as ref:
        assert try_writes(store, ref.get()) == 0
        assert try_writes(store, ref.value) == 0
    assert float(store.get("big").sum()) == float(np.arange(MiB, dtype=np.float64).sum())


def test_pandas_frames_from_the_store_refuse_writes(store):
    pd = pytest.importorskip("pandas", reason="pandas is not installed (pip install -e '.[test]' installs it)")
    frame = pd.DataFrame({"a": np.arange(5.0), "b": np.arange(5.0)})
    series = pd.Series(np.arange(7), name="s")
    store.put("df", frame)
    store.put("both", {"df": frame, "s": series})
    for got in (store.get("df"), store.get("both")["df"]):
        assert try_writes(store, [got.values, got["a"].values, got["b"].to_numpy()]) == 0
        with pytest.raises(ValueError, match="read-only"):
            got.iloc[0, 0] = 99.0
    got = store.get("both")["s"]
    assert try_writes(store, [got.values, got.to_numpy()]) == 0
    with pytest.raises(ValueError, match="read-only"):
        got.iloc[0] = 99
    assert store.get("df").equals(frame) and store.get("both")["s"].equals(series)


def test_a_process_that_tries_to_write_changes_nothing_another_reads(store):
    """The putting process and a second one try every way; a third reads every object unchanged."""
    put_all(store)
    writer = Child(SETUP + """
import os, shmstore
with shmstore.connect(os.environ["N"]) as s:
    print(sum(try_writes(s, get(s, k)) for k in values() for get in (
        lambda s, k: s.get(k), lambda s, k: s.get_many([k])[0], lambda s, k: s.mapping()[k])), flush=True)
""", env={"N": store.name})
    assert writer.readline(timeout=60) == "0"
    writer.wait()
    assert sum(try_writes(store, store.get(k)) for k in values()) == 0
    assert _read_in_another_process(store.name) == _checksums()


@pytest.mark.parametrize("key", ["arr", "big", "dict", "raw", "disk"])
def test_a_write_that_ignores_the_flags_kills_the_writer_not_the_object(store, key):
    """ctypes writes through the view's address: the read-only mapping faults (SIGSEGV) in the writing process;
    its pins are released by the janitor and the object is unchanged for everyone."""
    put_all(store)
    child = Child(SETUP + """
import ctypes, faulthandler, os, shmstore
faulthandler.disable()  # the SIGSEGV below is the expected end, not a crash to report
s = shmstore.connect(os.environ["N"])
a = arrays(s.get(os.environ["K"]))[0]
print("got", flush=True)
ctypes.memset(a.ctypes.data, 42, 8)
print("wrote", flush=True)
""", env={"N": store.name, "K": key})
    assert child.readline(timeout=60) == "got"
    assert child.proc.wait(60) == -signal.SIGSEGV
    child.kill()
    assert wait_for(lambda: not store.get_info(key).pinned, timeout=30)  # the janitor released its pin
    assert _read_in_another_process(store.name) == _checksums()
    assert store.check() == []


def test_writers_keep_working_beside_read_only_views(store):
    put_all(store)
    old = store.get("big")
    store.put("big", np.zeros(MiB), overwrite=True)
    with store.open_writer("blob", 64) as w:
        w.write(b"\x05" * 64)
    store["raw"] = b"new"
    assert float(old.sum()) == float(np.arange(MiB, dtype=np.float64).sum())  # the old view: unchanged
    assert float(store.get("big").sum()) == 0.0 and bytes(store.get("blob")) == b"\x05" * 64
    assert bytes(store.get("raw")) == b"new"
    assert try_writes(store, store.get("blob")) == 0 and try_writes(store, store.get("big")) == 0
