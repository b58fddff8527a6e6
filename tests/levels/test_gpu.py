"""The GPU level: what runs without a device here, what needs one (``-m gpu``, skipped without CuPy/a device).

Without a device: the CUDA-awareness override, the library probe's parsing,
priority lists that name the GPU on a node without one, and the GPU arena's
metadata (the allocator range, its crash rebuild, dropping the objects of an
arena whose owning spill process died) on a real store. The staging
pipeline over host buffers runs in tests/mpi/ranks. ``scripts/gpu-check.sh`` runs
the device tests and a device benchmark where a GPU is.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.levels import gpuarena
from shmstore.levels.gpu import cupy_or_reason, device_of
from shmstore.meta import layout as L
from shmstore.meta.alloc import Allocator

from helpers import Child, wait_for

try:  # MPI opens its descriptors once, at import: before the tests' leak check counts them
    from mpi4py import MPI  # noqa: F401
except ImportError:
    pass

MiB = 1 << 20
_, NO_GPU = cupy_or_reason()
needs_device = pytest.mark.skipif(NO_GPU is not None, reason=f"GPU level unavailable: {NO_GPU}")


# ---- without a device -------------------------------------------------------------------

def test_cuda_aware_override_parses_and_rejects_nonsense(monkeypatch):
    from shmstore.config import cuda_aware_override

    def parsed(value):
        if value is None:
            monkeypatch.delenv("SHMSTORE_CUDA_AWARE", raising=False)
        else:
            monkeypatch.setenv("SHMSTORE_CUDA_AWARE", value)
        return cuda_aware_override()

    assert [parsed(v) for v in (None, "", "auto", "1", "yes", "ON", "0", "false", "off")] == \
        [None, None, None, True, True, True, False, False, False]
    with pytest.raises(shmstore.ConfigError, match="SHMSTORE_CUDA_AWARE"):
        parsed("maybe")


def test_mpi_library_found_in_the_process_maps():
    pytest.importorskip("mpi4py")
    from shmstore.mpi.cuda import mpi_libraries
    maps = [
        "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6",
        "7f20-7f30 r-xp 00000000 08:01 456 /opt/venv/lib/python3.11/site-packages/mpich/lib/libmpi.so.12.4.3",
        "7f30-7f40 r--p 00010000 08:01 456 /opt/venv/lib/python3.11/site-packages/mpich/lib/libmpi.so.12.4.3",
        "7f50-7f60 rw-p 00000000 00:00 0",
        "7f70-7f80 r-xp 00000000 08:01 789 /usr/lib/libmpi_cxx.so.40",
    ]
    assert mpi_libraries(maps) == ["/opt/venv/lib/python3.11/site-packages/mpich/lib/libmpi.so.12.4.3",
                                   "/usr/lib/libmpi_cxx.so.40"]


def test_priority_lists_pass_over_a_gpu_this_node_lacks(store, monkeypatch):
    from shmstore.levels import device  # a node without one, wherever this runs: CuPy's answer made "none"
    monkeypatch.setattr(device, "_CUPY", [(None, "no CUDA device", os.getpid())])
    info = store.put("k", np.arange(10), levels=[Level.GPU, Level.MEMORY])
    assert info.level == Level.MEMORY
    with pytest.raises(shmstore.InvalidArgumentError, match="CuPy|device"):
        store.put("g", np.arange(10), levels=[Level.GPU])
    with pytest.raises(shmstore.InvalidArgumentError, match="CuPy|device"):
        store.move("k", Level.GPU)
    assert Level.GPU not in store.get_capacity()
    assert store.check() == []


def _fake_dead_owner() -> int:
    """The pid of a process that has exited (the spill process that held the arena)."""
    child = Child("print('bye')")
    child.readline()
    child.wait()
    return child.pid


def _arena_with_objects(store, d, cap, owner, sizes, uuid=b""):
    """GPU arena slot ``d`` registered in the metadata (owned by pid ``owner``), and objects ``g0``, ``g1``
    ... of ``sizes`` on it, written into the table the way a put on the GPU level writes them."""
    node = store.node_store
    buf, lay = node.buf, node.layout
    with node.alloc_lock:
        L.set_gpu(buf, lay, d, device=d, base=L.gpu_base(d), capacity=cap, owner=owner, epoch=1, uuid=uuid)
        Allocator(buf, lay, cap, gpu=d).init_arena()
        L.set_gpu(buf, lay, d, state=L.GPU_READY)
    arena = gpuarena.allocator(node, d)
    for i, size in enumerate(sizes):
        kb = f"g{i}".encode()
        idx, gen = store.kernel._supply.take_entry(kb.decode())
        h, b, stripe = node.table.locate(store.kernel.sid, kb)
        with node.stripes[stripe]:
            with node.alloc_lock:
                rec, off = arena.alloc(size, idx + 1)
                assert rec and device_of(off) == d
            L.ENTRY_HEAD.pack(buf, lay.entry(idx), offset=off, size=size, nbytes=size, hash=h, gen=gen, extent=rec,
                              keylen=len(kb), session=store.kernel.sid, state=L.SEALED, level=L.LEVEL_GPU)
            L.set_entry_key(buf, lay.entry(idx), kb)
            L.add_stripe_stats(buf, lay.stripe_stats(stripe), L.LEVEL_GPU, size, 1)
            node.table.link(idx, b)


def _spill_process_started(store):
    """The spill process drops lost arenas when it starts: tests that lose one by hand let it start first."""
    assert wait_for(lambda: L.unpack_spill_state(store.node_store.buf).heartbeat > 0, timeout=20)


def test_gpu_arena_metadata_on_a_real_store(store):
    """Without a device the arena's bytes cannot exist, but its bookkeeping can: a GPU arena registered in
    the metadata is cut by the shared allocator, checked by check(), kept by the crash rebuild, and when
    its owner dies its objects are dropped and their space goes back to it."""
    node = store.node_store
    buf, lay, d, cap = node.buf, node.layout, 1, 8 * MiB
    _spill_process_started(store)
    _arena_with_objects(store, d, cap, _fake_dead_owner(), (MiB, 3 * MiB))
    assert store.check() == []
    assert sorted(i.key for i in store.list(Level.GPU)) == ["g0", "g1"]
    with node.alloc_lock:  # a process died holding the ALLOC lock: the rebuild keeps both arenas tiled
        from shmstore.node.repair import rebuild_allocator
        rebuild_allocator(node)
    assert store.check() == []
    assert node.levels[Level.GPU].drop_lost() == 2  # the owner is dead: the objects went with its device memory
    assert L.unpack_gpu(buf, lay, d).state == L.GPU_LOST
    assert "g0" not in store and "g1" not in store and not store.list(Level.GPU)
    assert node.used(L.LEVEL_GPU) == 0
    lost = Allocator(buf, lay, cap, gpu=d)
    assert lost.free_extents() == [(L.gpu_base(d), cap)]  # every byte back, ready to be made again
    assert store.check() == []


def test_arena_slots_are_claimed_by_device_key_not_ordinal(store):
    """Two processes that call different GPUs "device 0" (CUDA_VISIBLE_DEVICES) get two slots; one GPU seen
    as device 0 here and device 1 there gets one."""
    from shmstore.levels.gpuarena import find_slot, slot_for
    from shmstore.levels.gpumaps import DeviceIds
    node = store.node_store
    here = DeviceIds(lambda: [("0000:1B:00.0", b"a" * 16), ("0000:3B:00.0", b"b" * 16)])
    there = DeviceIds(lambda: [("0000:3B:00.0", b"b" * 16)])  # a rank bound to the second GPU
    s0 = slot_for(node, here.key_of(0), "setting")
    s1 = slot_for(node, there.key_of(0), "setting")
    assert s0 != s1 and slot_for(node, here.key_of(1), "setting") == s1
    assert find_slot(node, here.key_of(1)) == s1 and bytes(L.unpack_gpu(node.buf, node.layout, s1).uuid) == \
        there.key_of(0)
    for i in range(L.MAX_GPUS - 2):
        slot_for(node, DeviceIds(lambda i=i: [(f"0000:{i:02x}:00.0", b"")]).key_of(0), "setting")
    with pytest.raises(shmstore.StorageFullError, match=f"{L.MAX_GPUS} other devices.*setting"):
        slot_for(node, DeviceIds(lambda: [("0000:ff:00.0", b"")]).key_of(0), "setting")
    assert store.check() == []


def test_relief_weighs_each_arena_against_its_own_capacity(store):
    """The mover sees one part per ready arena (its own objects, its own capacity), none for arenas not
    made, and never the sum of every arena against one device's size."""
    from shmstore.spill.mover import Mover
    from shmstore.spill.policy import spill_candidates
    node = store.node_store
    _spill_process_started(store)
    assert Mover(node)._parts(Level.GPU, node.levels[Level.GPU], L.entry_table(node.buf, node.layout)) == []
    _arena_with_objects(store, 2, 8 * MiB, os.getpid(), (MiB, 3 * MiB))
    t = L.entry_table(node.buf, node.layout)
    parts = Mover(node)._parts(Level.GPU, node.levels[Level.GPU], t)
    lo = L.gpu_base(2)
    assert parts == [(4 * MiB, 8 * MiB, (lo, lo + 8 * MiB))]
    pins = node.table.pin_counts(len(t))
    assert len(spill_candidates(t, pins, level=L.LEVEL_GPU, within=(lo, lo + 8 * MiB))) == 2
    assert len(spill_candidates(t, pins, level=L.LEVEL_GPU, within=(L.gpu_base(3), L.gpu_base(4)))) == 0
    node.levels[Level.GPU].release_arenas()  # leave no ready arena whose memory nobody holds
    assert store.check() == []


def test_a_move_onto_the_gpu_lands_on_the_asking_clients_device(store):
    """The client's request names its device's arena; the spill process's mover is aimed at it, and places the
    copy there, not on the spill process's own device 0."""
    from shmstore.spill import requests
    node = store.node_store
    _spill_process_started(store)
    _arena_with_objects(store, 1, 8 * MiB, os.getpid(), (MiB,))
    _arena_with_objects(store, 3, 8 * MiB, os.getpid(), ())
    lv = node.levels[Level.GPU]
    idx = next(i for i in range(len(L.entry_table(node.buf, node.layout)))
               if L.entry(node.buf, node.layout.entry(i)).state == L.SEALED)
    lv.aim(3)
    off, rec = lv.space_for_move(idx, MiB)
    assert device_of(off) == 3 and rec
    with node.stripe_of(idx):
        lv.abort_move(idx, L.entry(node.buf, node.layout.entry(idx)))
    lv.aim(-1)
    if NO_GPU is not None:  # not aimed: its own device's arena, which needs CUDA to name
        with pytest.raises(shmstore.DeviceError, match="cannot move an object on the GPU"):
            lv.space_for_move(idx, MiB)
    slot = store.kernel.slot  # the request record carries the arena (this one names no live generation)
    seq = requests.submit(node, slot, L.REQ_MOVE, idx=idx, gen=1 << 31, level=L.LEVEL_GPU, arena=4)
    r = requests.wait(node, slot, seq, 20)
    assert r is not None and r.status == L.RS_FAILED and r.arena == 4
    lv.release_arenas()
    assert store.check() == []


def test_the_owner_marks_its_arenas_lost_before_letting_the_memory_go(store):
    """What the spill process does as it exits: the record never says ready for memory that is gone."""
    node = store.node_store
    _spill_process_started(store)
    _arena_with_objects(store, 1, 8 * MiB, os.getpid(), (MiB, 2 * MiB))
    _arena_with_objects(store, 3, 8 * MiB, _fake_dead_owner(), ())  # another owner's: not ours to lose here
    assert node.levels[Level.GPU].release_arenas() == 2
    assert L.unpack_gpu(node.buf, node.layout, 1).state == L.GPU_LOST
    assert L.unpack_gpu(node.buf, node.layout, 3).state == L.GPU_READY
    assert "g0" not in store and node.used(L.LEVEL_GPU) == 0 and store.check() == []


def test_a_get_on_a_lost_arena_or_without_cupy_names_the_key_and_keeps_no_pin(store):
    import gc
    node = store.node_store
    _spill_process_started(store)
    _arena_with_objects(store, 1, 8 * MiB, os.getpid(), (MiB,))
    if NO_GPU is not None:
        with pytest.raises(shmstore.DeviceError, match="cannot read 'g0' on the GPU: " + re.escape(NO_GPU)):
            store.get("g0")
    with node.alloc_lock:  # lost, its objects not dropped yet: a reader that pinned one in time
        L.set_gpu(node.buf, node.layout, 1, state=L.GPU_LOST)
    with pytest.raises(shmstore.SpillError, match="cannot read 'g0' on .*GPU arena 1 is lost") as err:
        store.get("g0")
    assert err.value.object_id == "g0"
    del err
    gc.collect()
    assert not store.get_info("g0").pinned
    assert node.levels[Level.GPU].drop_lost() == 0  # lost already: the next owner's start drops nothing twice
    from shmstore.levels.gpuarena import lose_arena
    assert lose_arena(node, 1, L.LEVEL_GPU) == 1 and store.check() == []


class _FakeCuda:
    """Just what the GPU level's mapping and views touch of CuPy (no device here): a fake module."""

    def __init__(self, mode=0):
        self.cuda, self.runtime, self.mode = self, self, mode

    class Device:
        def __init__(self, d=None):
            self.id = 0 if d is None else d

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    def getDeviceProperties(self, d):
        return {"computeMode": self.mode}

    def UnownedMemory(self, ptr, size, owner, device):
        return (ptr, size, owner, device)

    def MemoryPointer(self, mem, offset):
        return mem

    def ndarray(self, shape, dtype, memptr, order="C"):
        return list(memptr)  # holds the memory owner, as a CuPy array does


@pytest.fixture
def fake_cuda(monkeypatch, store):
    """The GPU level of ``store`` (and a second one, as a second connect has) over a fake CuPy, fake devices
    and a registry with fake IPC calls; arena slot 2 registered for fake device 0."""
    from shmstore.levels import device, gpu
    from shmstore.levels.gpumaps import DeviceIds, MappingRegistry
    calls = []
    cuda = _FakeCuda()
    ids = DeviceIds(lambda: [("0000:3B:00.0", b"u" * 16)])
    monkeypatch.setattr(device, "_CUPY", [(cuda, None, os.getpid())])
    monkeypatch.setattr(device, "_MODES", {})
    monkeypatch.setattr(gpu, "DEVICES", ids)
    monkeypatch.setattr(gpu, "MAPPINGS", MappingRegistry(lambda h, d: calls.append(("open", h, d)) or 0x10000,
                                                         lambda ptr: calls.append(("close", ptr))))
    monkeypatch.setattr(gpu, "settle", lambda d: calls.append(("settle", d)))
    _spill_process_started(store)
    _arena_with_objects(store, 2, 8 * MiB, os.getpid(), (MiB,), uuid=ids.key_of(0))
    L.set_gpu(store.node_store.buf, store.node_store.layout, 2, handle=b"h" * 64)
    yield calls, cuda, gpu
    store.node_store.levels[Level.GPU].release_arenas()


def test_two_levels_of_one_process_share_a_mapping_that_outlives_close(store, fake_cuda):
    """Items 10 and 12 wired through the level: a second connect opens nothing again; close() of both leaves
    the views' mapping open; the last view settles the device, then unmaps, then unpins."""
    import gc
    calls, cuda, gpu = fake_cuda
    node = store.node_store
    mine, second = node.levels[Level.GPU], gpu.GpuLevel(node, lambda d: None)
    off = L.gpu_base(2) + 4096
    pins = []
    a = mine.array(off, 64, _Pin(pins, "a"))
    b = second.array(off, 64, _Pin(pins, "b"))
    assert calls == [("open", b"h" * 64, 0)] and a[0] == b[0] == 0x10000 + 4096
    mine.close()
    second.close()
    assert calls == [("open", b"h" * 64, 0)] and not pins  # the views still read it
    del a
    gc.collect()
    assert calls[1:] == [("settle", 0)] and pins == ["a"]
    del b
    gc.collect()
    assert calls[2:] == [("settle", 0), ("close", 0x10000)] and pins == ["a", "b"]


def test_a_lost_arena_unmaps_and_an_unseen_device_or_exclusive_mode_is_named(store, fake_cuda):
    calls, cuda, gpu = fake_cuda
    node = store.node_store
    lv = node.levels[Level.GPU]
    view = lv.array(L.gpu_base(2), 64)
    with node.alloc_lock:
        L.set_gpu(node.buf, node.layout, 2, state=L.GPU_LOST)
    with pytest.raises(OSError, match="GPU arena 2 is lost"):
        lv.array(L.gpu_base(2), 64)
    assert [c[0] for c in calls] == ["open"]  # the level let go; the view still holds it
    del view
    assert [c[0] for c in calls] == ["open", "close"]
    with node.alloc_lock:
        L.set_gpu(node.buf, node.layout, 2, uuid=b"x" * 16, epoch=2, state=L.GPU_READY)
    with pytest.raises(shmstore.DeviceError, match="does not see the device of GPU arena 2, which holds 'k'.*"
                                                   "CUDA_VISIBLE_DEVICES"):
        lv.array(L.gpu_base(2), 64, key="k")
    with node.alloc_lock:
        L.set_gpu(node.buf, node.layout, 2, uuid=gpu.DEVICES.key_of(0))
    cuda.mode = 3
    from shmstore.levels import device
    device._MODES.clear()
    with pytest.raises(shmstore.DeviceError, match="EXCLUSIVE_PROCESS.*nvidia-smi -c DEFAULT"):
        lv.array(L.gpu_base(2), 64, key="k")
    assert "EXCLUSIVE_PROCESS" in lv.available()


class _Pin:
    """Stands for the kernel's pin token: records when it is collected."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __del__(self):
        self.log.append(self.name)


# ---- with a device ------------------------------------------------------------------------

@pytest.fixture
def cp():
    import cupy
    return cupy


@pytest.fixture
def gstore(name, tmp_path):
    with shmstore.connect(name, capacity="64MiB", gpu_capacity="64MiB", spill_dir=str(tmp_path)) as s:
        yield s


@pytest.mark.gpu
@needs_device
def test_device_array_stays_on_the_device_and_comes_back_zero_copy(gstore, cp):
    a = cp.arange(1 << 20, dtype=cp.float32)
    info = gstore.put("a", a)  # a device array: GPU first by default
    assert info.level == Level.GPU
    got = gstore.get("a")
    assert isinstance(got, cp.ndarray) and bool((got == a).all())
    again = gstore.get("a")
    assert got.data.ptr == again.data.ptr  # one shared allocation, no copy
    assert gstore.get_info("a").pinned
    del got, again
    assert gstore.check() == []


@pytest.mark.gpu
@needs_device
def test_another_process_gets_a_view_through_cuda_ipc(gstore, cp):
    gstore.put("a", cp.full((1000,), 7, cp.int64))
    child = Child("""
import os, shmstore, cupy
with shmstore.connect(os.environ['N'], spill_dir=os.environ['D']) as s:
    a = s.get('a')
    print(type(a).__name__, int(a.sum()), flush=True)
""", env={"N": gstore.name, "D": gstore.config.spill_dir})
    assert child.readline() == "ndarray 7000"
    child.wait()


@pytest.mark.gpu
@needs_device
def test_host_up_device_down_zero_length_and_spill(gstore, cp):
    gstore.put("host", np.arange(1000), levels=[Level.GPU])  # copied up
    assert int(gstore.get("host").sum()) == sum(range(1000))
    gstore.put("dev", cp.arange(1000), levels=[Level.MEMORY])  # copied down
    assert isinstance(gstore.get("dev"), np.ndarray) and int(gstore.get("dev").sum()) == sum(range(1000))
    gstore.put("empty", cp.empty((0, 4)), levels=[Level.GPU])  # no pointer reaches CUDA
    assert gstore.get("empty").shape == (0, 4)
    gstore.put("big", cp.ones(4 * MiB, cp.uint8), levels=[Level.GPU])
    gstore.move("big", Level.MEMORY)
    gstore.move("big", Level.DISK)
    gstore.move("big", Level.GPU)
    assert int(gstore.get("big").sum()) == 4 * MiB
    assert gstore.check() == []


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("verb", ["put", "put_many", "open_writer"])
def test_a_first_put_waiting_for_its_gpu_arena_holds_no_lock_another_client_needs(gstore, cp, verb):
    """The first put on the GPU level has the spill process make the device's arena, and waits for it. It
    waited holding its key's stripe lock: a client taking every stripe (``check``, a supply steal) then
    waited on it, and a spill process busy with a move under one of that client's stripes never answered it,
    until a lock timeout (a rank suite's ``check()`` in CI, stop 52; 1 round in 16 of it two jobs at once,
    the put a rank's first on the GPU level). Here the spill process is stopped (SIGSTOP) while the put
    waits: another client's puts, deletes and ``check()`` (every stripe) go on meanwhile, and once the spill
    process resumes the put lands whole."""
    import signal
    import threading

    from shmstore.spill import requests
    node = gstore.node_store
    assert all(L.unpack_gpu(node.buf, node.layout, d).state != L.GPU_READY for d in range(L.MAX_GPUS))
    child = Child("""
import os, numpy as np, shmstore
with shmstore.connect(os.environ['N'], spill_dir=os.environ['D']) as s:
    print('ready', flush=True)
    input()
    keys = [f'm{i}' for i in range(512)]  # every stripe's lock, many times over
    for k in keys:
        s.put(k, np.full(4, 1.0))
    problems = s.check()
    for k in keys:
        s.delete(k)
    print('done', problems, flush=True)
""", env={"N": gstore.name, "D": gstore.config.spill_dir, "SHMSTORE_LOCK_TIMEOUT": "5"})
    assert child.readline() == "ready"
    want, out = cp.arange(1 << 20, dtype=cp.float32), {}

    def put() -> None:
        try:
            if verb == "put":
                gstore.put("g", want, levels=[Level.GPU])
            elif verb == "put_many":
                gstore.put_many({"g": want}, levels=[Level.GPU])
            else:
                with gstore.open_writer("g", want.nbytes, levels=[Level.GPU]) as w:
                    w.write(cp.asnumpy(want).tobytes())
            out["done"] = True
        except BaseException as exc:  # noqa: BLE001 (asserted below)
            out["error"] = exc
    pid = gstore.spill_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        putter = threading.Thread(target=put, daemon=True)
        putter.start()
        assert wait_for(lambda: requests.pending(node) != [], timeout=30)  # the put waits for its arena
        child.send("go")
        assert child.readline(timeout=60) == "done []"
        assert putter.is_alive() and not out  # still waiting for the stopped spill process
    finally:
        os.kill(pid, signal.SIGCONT)
    putter.join(60)
    assert not putter.is_alive() and "error" not in out, out
    got = gstore.get("g")
    got = got if verb != "open_writer" else got.view(cp.float32)  # raw bytes, on the GPU
    assert gstore.get_info("g").level == Level.GPU and bool((got == want).all())
    del got
    child.wait()
    assert gstore.check() == []


@pytest.mark.gpu
@needs_device
def test_torch_cuda_tensor_is_accepted(gstore):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    t = torch.arange(100, device="cuda")
    gstore.put("t", t)
    assert int(gstore.get("t").sum()) == sum(range(100))


def test_the_device_tests_run_here_and_skip_saying_why_where_the_gpu_level_is_off(tmp_path):
    """Under the test suite the GPU level is always there (a device, or the CuPy stand-in of tests/fakecuda):
    its tests never skip for want of one. With ``SHMSTORE_NO_GPU=1`` they are skipped, each with the reason,
    never counted as passing."""
    assert NO_GPU is None, f"the GPU tests would skip: {NO_GPU}"
    import subprocess
    import sys
    env = dict(os.environ, SHMSTORE_NO_GPU="1", PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu",
                          "-k", "item11 or item15", __file__], env=env, capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"\b2 skipped\b", run.stdout) and " passed" not in run.stdout, run.stdout
    assert run.stdout.count("GPU level unavailable: SHMSTORE_NO_GPU is set") == 2, run.stdout


# ---- with a device: issue 23 items 8-15 (each test's name says which item it checks) ----------------------

@pytest.mark.gpu
@needs_device
def test_item08_a_put_under_a_user_stream_is_sealed_after_its_bytes_land(gstore, cp):
    with cp.cuda.Stream(non_blocking=True):  # neither the legacy stream nor synchronised with it
        a = cp.arange(4 << 20, dtype=cp.int32) * 3  # queued on the user stream, maybe still running at the put
        gstore.put("s", a)
        gstore.put("h", np.arange(1 << 20, dtype=np.int64), levels=[Level.GPU])
    assert bool((gstore.get("s") == cp.arange(4 << 20, dtype=cp.int32) * 3).all())
    assert int(gstore.get("h")[-1]) == (1 << 20) - 1


@pytest.mark.gpu
@needs_device
def test_item09_a_views_pin_goes_after_the_work_queued_on_it(gstore, cp):
    import gc
    gstore.put("v", cp.ones(8 << 20, cp.float32))
    v = gstore.get("v")
    y = v * 2  # queued; the pin must outlive it
    assert gstore.get_info("v").pinned
    del v
    gc.collect()
    assert not gstore.get_info("v").pinned
    assert float(y.sum()) == 2.0 * (8 << 20)


@pytest.mark.gpu
@needs_device
def test_item10_close_keeps_views_mapped_until_they_go(name, tmp_path, cp):
    from shmstore.levels.gpu import MAPPINGS
    with shmstore.connect(name, capacity="64MiB", gpu_capacity="64MiB", spill_dir=str(tmp_path)) as s:
        s.put("a", cp.full((1000,), 7, cp.int64))
        a = s.get("a")
        store_id = next(k[0] for k in MAPPINGS.live() if k[0][0].rstrip(b"\0") == name.encode())
    assert [r for k, r in MAPPINGS.live().items() if k[0] == store_id] == [1]  # the view's reference only
    assert int(a.sum()) == 7000  # after close: still mapped (an unmapped view is an illegal address)
    del a
    import gc
    gc.collect()
    assert not [k for k in MAPPINGS.live() if k[0] == store_id]  # unmapped with the last view


@pytest.mark.gpu
@needs_device
def test_item11_the_arena_names_its_device_by_key(gstore, cp):
    from shmstore.levels.gpu import DEVICES
    gstore.put("a", cp.arange(10))
    node = gstore.node_store
    d = cp.cuda.Device().id
    slots = [s for s in range(L.MAX_GPUS) if L.unpack_gpu(node.buf, node.layout, s).state == L.GPU_READY]
    assert len(slots) == 1, slots
    g = L.unpack_gpu(node.buf, node.layout, slots[0])
    assert bytes(g.uuid) == DEVICES.key_of(d), (DEVICES.name_of(d), g)
    assert len({DEVICES.key_of(i) for i in range(cp.cuda.runtime.getDeviceCount())}) == \
        cp.cuda.runtime.getDeviceCount()  # every device its own key


@pytest.mark.gpu
@needs_device
def test_item12_two_connects_in_one_process_share_one_mapping(gstore, cp):
    from shmstore.levels.gpu import MAPPINGS
    gstore.put("a", cp.arange(1000))
    with shmstore.connect(gstore.name, spill_dir=gstore.config.spill_dir) as other:
        a, b = gstore.get("a"), other.get("a")  # no "already mapped" from a second cudaIpcOpenMemHandle
        assert a.data.ptr == b.data.ptr and bool((a == b).all())
        mine = [k for k in MAPPINGS.live() if k[0][0].rstrip(b"\0") == gstore.name.encode()]
        assert len(mine) == 1, MAPPINGS.live()
        del a, b


@pytest.mark.gpu
@needs_device
@pytest.mark.slow
def test_item13_the_spill_process_marks_its_arena_lost_as_it_exits(gstore, cp):
    import signal
    node = gstore.node_store
    gstore.put("a", cp.arange(1000))
    slot = next(s for s in range(L.MAX_GPUS) if L.unpack_gpu(node.buf, node.layout, s).state == L.GPU_READY)
    epoch = L.unpack_gpu(node.buf, node.layout, slot).epoch
    os.kill(node.spill_pid(), signal.SIGTERM)  # we stay attached: it leaves the store to us after its grace
    assert wait_for(lambda: L.unpack_gpu(node.buf, node.layout, slot).state == L.GPU_LOST, timeout=20)
    assert "a" not in gstore  # dropped with the memory
    gstore.put("b", cp.arange(10))  # a new spill process makes the arena again
    g = L.unpack_gpu(node.buf, node.layout, slot)
    assert g.state == L.GPU_READY and g.epoch == epoch + 1 and int(gstore.get("b").sum()) == 45
    assert gstore.check() == []


@pytest.mark.gpu
@needs_device
def test_item14_cuda_errors_name_the_device_and_what_to_do(cp):
    from shmstore.levels.device import cuda_errors
    with pytest.raises(shmstore.DeviceError, match="cannot use device 999 on GPU 999: cudaErrorInvalidDevice.*"
                                                   "CUDA_VISIBLE_DEVICES"):
        with cuda_errors("use device 999", None, 999):
            cp.cuda.runtime.setDevice(999)  # CuPy's own error class: its module is what cuda_errors looks for


@pytest.mark.gpu
@needs_device
def test_item15_the_device_is_in_a_mode_the_arena_can_serve(gstore, cp):
    from shmstore.levels.device import device_problem
    d = cp.cuda.Device().id
    mode = cp.cuda.runtime.getDeviceProperties(d)["computeMode"]
    assert device_problem(d, f"GPU {d}") is None, f"compute mode {mode}"
    assert gstore.node_store.levels[Level.GPU].available() is None


# ---- with a device: issue 31 item 6 (real use) -------------------------------------------------------------

@pytest.mark.gpu
@needs_device
def test_item06_an_f_ordered_device_array_reaches_every_level_and_comes_back_as_it_was(gstore, cp):
    """A Fortran-ordered device matrix put on the host levels and streamed in pieces onto the GPU: its bytes
    as they lie (``view(uint8)`` of such an array is refused: that ValueError escaped before)."""
    f = cp.asfortranarray(cp.arange(6 * 1000, dtype=cp.float32).reshape(6, 1000))
    want = f.get(order="F")
    from shmstore.levels.device import DeviceSink, to_host
    host = np.empty(f.nbytes, np.uint8)
    to_host(host, f)  # the helpers themselves, as moves, fetches and writers call them
    dev = cp.zeros(f.nbytes, cp.uint8)
    DeviceSink(dev, "k").write(f, 0)
    assert host.tobytes() == dev.get().tobytes() == want.tobytes(order="F")
    for level in (Level.MEMORY, Level.DISK, Level.GPU):
        gstore.put(f"f{level.name}", f, levels=[level])
        got = gstore.get(f"f{level.name}")
        assert got.flags.f_contiguous and not got.flags.c_contiguous, level
        host = got.get(order="F") if hasattr(got, "__cuda_array_interface__") else got
        assert np.array_equal(host, want), level
    pieces = (f[:, :500], f[:, 500:][:, ::-1])  # F-ordered: as it lies; not contiguous: in C order
    expect = want[:, :500].tobytes(order="F") + want[:, 500:][:, ::-1].tobytes(order="C")
    for level in (Level.MEMORY, Level.DISK, Level.GPU):
        with gstore.open_writer(f"w{level.name}", f.nbytes, levels=[level]) as w:
            for piece in pieces:
                w.write(piece)
        got = gstore.get(f"w{level.name}")
        assert (got.get() if hasattr(got, "__cuda_array_interface__") else got).tobytes() == expect, level
    assert gstore.check() == []


@pytest.mark.gpu
@needs_device
def test_item06_a_view_let_go_during_a_graph_capture_leaves_the_capture_valid(gstore, cp):
    """A view collected while the thread's stream captures a CUDA graph (torch.compile's "reduce-overhead"):
    no device-wide synchronise breaks the capture, the pin goes, and a view let go outside a capture is
    still settled on its stream before its pin goes."""
    import gc
    gstore.put("v", cp.ones(1 << 20, cp.float32))
    x = cp.zeros(1 << 20, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        v = gstore.get("v")
        stream.begin_capture()
        try:
            x *= 2  # captured work, nothing allocated inside the capture
            del v
            gc.collect()
        finally:
            graph = stream.end_capture()  # raises cudaErrorStreamCaptureInvalidated where a sync broke it
        graph.launch(stream)
        stream.synchronize()
    assert not gstore.get_info("v").pinned
    w = gstore.get("v")
    y = w * 3  # queued; its pin outlives it
    del w
    gc.collect()
    assert not gstore.get_info("v").pinned and float(y.sum()) == 3.0 * (1 << 20)


@pytest.mark.gpu
@needs_device
@pytest.mark.slow
def test_item06_an_exiting_spill_process_keeps_its_arena_while_a_client_reads_a_view_of_it(gstore, cp):
    """SIGTERM to the spill process while a client holds a view: it marks the arena lost (no new view), then
    keeps the allocation until the view goes (CUDA leaves freeing memory another process maps undefined),
    and only then exits."""
    import gc
    import signal

    from helpers import spill_running
    node = gstore.node_store
    gstore.put("a", cp.full((1000,), 7, cp.int64))
    a = gstore.get("a")
    slot = next(s for s in range(L.MAX_GPUS) if L.unpack_gpu(node.buf, node.layout, s).state == L.GPU_READY)
    clients = L.client_table(node.buf, node.layout)
    me = gstore.kernel.slot
    assert int(clients["gpu_views"][me]) == 1 << slot  # what the spill process reads
    spill = node.spill_pid()
    os.kill(spill, signal.SIGTERM)  # we stay attached: it leaves the store to us after its grace
    assert wait_for(lambda: L.unpack_gpu(node.buf, node.layout, slot).state == L.GPU_LOST, timeout=30)
    assert not wait_for(lambda: not spill_running(spill), timeout=1.0), "it freed the arena under our view"
    assert int(a.sum()) == 7000  # still mapped, still its bytes
    del a
    gc.collect()
    assert int(clients["gpu_views"][me]) == 0
    assert wait_for(lambda: not spill_running(spill), timeout=30)


@pytest.mark.gpu
@needs_device
@pytest.mark.slow
def test_bench_gpu_runs_in_both_modes(name):
    """scripts/bench_gpu.py, single process and two ranks on two emulated nodes, through the real store (on the
    CuPy stand-in where no device is: its figures mean nothing there, its paths run)."""
    import subprocess
    import sys

    from helpers import ROOT, child_path
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PYTHONPATH=child_path(), PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    bench = os.path.join(ROOT, "scripts", "bench_gpu.py")
    one = subprocess.run([sys.executable, bench, "--mib", "4", "--repeats", "2", "--name", name], env=env,
                         capture_output=True, text=True, timeout=180)
    assert one.returncode == 0, one.stdout + one.stderr
    assert re.search(r"device put 4 MiB: [\d.]+ ms; cupy copy [\d.]+ ms", one.stdout), one.stdout
    assert re.search(r"from a second process \(CUDA IPC\): \d+ us", one.stdout), one.stdout  # not nan
    import launchers
    mpi = launchers.launcher("mpich")
    if isinstance(mpi, str):
        pytest.skip(mpi)
    two = subprocess.run(mpi.command("n0:1,n1:1", ["-m", "mpi4py", bench, "--mpi", "--mib", "4", "--repeats", "2",
                                                   "--name", name + "m"]),
                         env=mpi.environ(dict(env, MPIEXEC_TIMEOUT="170")), capture_output=True, text=True, timeout=180)
    assert two.returncode == 0, two.stdout + two.stderr
    assert re.search(r"device fetch 4 MiB between nodes: [\d.]+ ms; raw mpi4py Send/Recv [\d.]+ ms", two.stdout), \
        two.stdout
