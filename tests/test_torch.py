"""Torch CPU tensors and state dicts: stored as raw bytes, got back as tensors over the store's memory.

CI installs torch's CPU wheel (``.ci/run``: the +cpu build, never the CUDA
one, which pulls GBs of libraries); ``scripts/torch-check.sh`` does the same
in a venv of its own and runs these tests.
"""
from __future__ import annotations

import signal

import numpy as np
import pytest

from shmstore import Level

from helpers import Child, view_arena, wait_for

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/torch-check.sh installs it and runs this)")


def _state_dict() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "linear.weight": torch.randn(64, 32, generator=g),
        "linear.bias": torch.randn(64, generator=g).to(torch.float16),
        "emb": torch.randn(10, 8, generator=g).to(torch.bfloat16),
        "mask": torch.rand(7, generator=g) > 0.5,
        "steps": torch.tensor(12345, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        "param": torch.nn.Parameter(torch.ones(4)),
    }


def _arena(store) -> tuple[int, int]:
    return view_arena(store)


def test_state_dict_round_trip_keeps_dtypes_shapes_and_types(store):
    sd = _state_dict()
    store.put("sd", sd)
    got = store.get("sd")
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert type(got[k]) is type(v), k
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].detach(), v.detach()), k
    assert got["param"].requires_grad and not got["linear.weight"].requires_grad


def test_tensors_come_back_zero_copy_over_the_store(store):
    store.put("t", torch.arange(1 << 20, dtype=torch.float32))
    store.put("sd", {"a": torch.ones(1000), "b": torch.zeros(5000)})
    base, size = _arena(store)
    a, b = store.get("t"), store.get("t")
    assert a.data_ptr() == b.data_ptr()  # two gets: one shared buffer
    assert base <= a.data_ptr() < base + size
    sd = store.get("sd")
    assert all(base <= t.data_ptr() < base + size for t in sd.values())
    assert float(a.sum()) == float(torch.arange(1 << 20, dtype=torch.float64).sum())


def test_a_tensor_holds_its_object_until_dropped(store):
    store.put("t", torch.full((1000,), 3.0))
    t = store.get("t")
    assert store.get_info("t").pinned
    store.delete("t")
    assert "t" not in store and float(t.sum()) == 3000.0  # deleted, still readable
    del t
    assert store.get_capacity()[Level.MEMORY].used == 0


def test_tensor_spilled_to_disk_comes_back_as_a_tensor(store):
    store.put("t", torch.arange(100_000), levels=[Level.DISK])
    t = store.get("t")
    assert isinstance(t, torch.Tensor) and int(t.sum()) == sum(range(100_000))


class _StoreDataset(torch.utils.data.Dataset):
    """A Dataset that keeps the Store it was given (opened in the parent, before the workers are forked)."""

    def __init__(self, store, n: int) -> None:
        self.store, self.n = store, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = self.store.get(f"x{i}")  # a read-only view of the store's memory, in the worker
        return torch.from_numpy(np.array(x)), int(x.sum())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
@pytest.mark.slow
def test_a_dataloader_whose_dataset_keeps_its_store_reads_it_in_its_workers(store, context):
    """Issue 35 item 2 with a real DataLoader: its workers under the default start method on Linux (fork),
    forkserver and spawn use the Store the Dataset kept (it failed with StoreClosedError under fork); every item
    comes whole, and the workers' client slots go when they exit."""
    for i in range(32):
        store.put(f"x{i}", np.full(1000, i, dtype=np.int64))
    clients = len(store.node_store.clients())
    import gc
    loader = torch.utils.data.DataLoader(_StoreDataset(store, 32), batch_size=4, num_workers=2,
                                         multiprocessing_context=context, timeout=120)
    batches = iter(loader)
    try:
        got = [(b[0].shape, b[1].tolist()) for b in batches]
    finally:
        # multiprocessing's own helpers would outlive the test (the leak check counts them): stopped once the
        # loader's queues are gone (a semaphore finalized after the stop started the resource tracker again,
        # a process that lived on through every later test of the run)
        import threading
        del batches, loader
        gc.collect()
        # its queues' feeder threads hold them (and their semaphores) until they end
        wait_for(lambda: not any(t.name == "QueueFeederThread" for t in threading.enumerate()), timeout=60)
        gc.collect()
        from multiprocessing import forkserver, resource_tracker
        forkserver._forkserver._stop()
        resource_tracker._resource_tracker._stop()
    assert [shape for shape, _ in got] == [torch.Size([4, 1000])] * 8
    assert [s for _, sums in got for s in sums] == [1000 * i for i in range(32)]
    assert wait_for(lambda: len(store.node_store.clients()) == clients, timeout=60)  # the workers' slots went
    assert store.check() == []


@pytest.mark.slow
def test_another_process_gets_the_tensor(store):
    store.put("sd", {"w": torch.arange(10.0)})
    child = Child("""
import os, shmstore, torch
with shmstore.connect(os.environ['N']) as s:
    w = s.get('sd')['w']
    print(type(w).__name__, float(w.sum()), flush=True)
""", env={"N": store.name})
    assert child.readline() == "Tensor 45.0"
    child.wait()


def test_numpy_arrays_are_unaffected_and_mixed_trees_work(store):
    store.put("mixed", {"np": np.arange(5), "t": torch.arange(5), "x": [1, "two"]})
    got = store.get("mixed")
    assert isinstance(got["np"], np.ndarray) and isinstance(got["t"], torch.Tensor)
    assert got["x"] == [1, "two"]


def test_overwrite_of_a_state_dict_keeps_old_tensors_valid(store):
    store.put("sd", {"w": torch.zeros(100)})
    old = store.get("sd")["w"]
    store.put("sd", {"w": torch.ones(100)}, overwrite=True)
    assert float(old.sum()) == 0.0 and float(store.get("sd")["w"].sum()) == 100.0



def test_tensors_over_the_store_are_not_torch_shared_and_share_memory_copies_them_out(store):
    """What the README says (issue 21 item 9): torch cannot be told that the store's memory is shared, so
    is_shared() is False, and share_memory_() (what torch.multiprocessing does to a tensor it sends) moves
    the data into a torch shared segment of its own: a copy, no longer a view of the store."""
    store.put("sd", {"w": torch.arange(1000, dtype=torch.float32)})
    t = store.get("sd")["w"]
    base, capacity = _arena(store)
    assert base <= t.data_ptr() < base + capacity and not t.is_shared()
    t.share_memory_()
    assert t.is_shared() and not base <= t.data_ptr() < base + capacity
    assert float(t.sum()) == sum(range(1000))


def test_an_in_place_write_into_a_tensor_from_the_store_kills_the_writer_and_changes_nothing(store):
    """torch has no read-only tensors (issue 30 item 4): a tensor over the store is writable as far as torch
    knows, but its memory is the arena's read-only mapping, so an in-place op faults (SIGSEGV) in the process
    that tried it; every other process reads the tensor unchanged. ``clone()`` first to change one."""
    store.put("sd", {"w": torch.arange(1000, dtype=torch.float32)})
    child = Child("""
import faulthandler, os, shmstore, torch
faulthandler.disable()  # the SIGSEGV is the expected end
s = shmstore.connect(os.environ['N'])
w = s.get('sd')['w']
mine = w.clone().add_(1)  # a copy: the way to change one
print(float(mine.sum()), flush=True)
w.add_(1)
print('wrote', flush=True)
""", env={"N": store.name})
    assert child.readline() == str(float(sum(range(1, 1001))))
    assert child.proc.wait(60) == -signal.SIGSEGV
    child.kill()
    assert wait_for(lambda: not store.get_info("sd").pinned, timeout=30)  # the janitor released its pin
    assert torch.equal(store.get("sd")["w"], torch.arange(1000, dtype=torch.float32))


@pytest.mark.slow
def test_a_model_and_optimizer_checkpoint_restores_zero_copy_from_the_store_and_whole_from_the_folder(name,
                                                                                                   tmp_path):
    """Issue 34 item 4: ``store.checkpoint`` of a model's and an optimizer's state dicts; ``restore`` gives
    tensors over the store's memory (no copy), and after the store is gone, tensors over the folder's files;
    ``load_state_dict`` of either brings a fresh model and optimizer to the same state."""
    import shmstore
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).sum().backward()
        opt.step()
    want = {"model": model.state_dict(), "optim": opt.state_dict()}
    pdir = str(tmp_path / "persist")

    def check(got) -> None:
        m2 = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        o2 = torch.optim.Adam(m2.parameters(), lr=1e-3)
        m2.load_state_dict(got["model"])
        o2.load_state_dict(got["optim"])
        for k, v in model.state_dict().items():
            assert torch.equal(m2.state_dict()[k], v), k
        s1, s2 = opt.state_dict()["state"], o2.state_dict()["state"]
        assert all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)

    with shmstore.connect(name, capacity="64MiB", prefault="16MiB", persist_dir=pdir) as s:
        assert s.checkpoint("epoch1", want).wait(60)
        got = s.restore()
        base, size = _arena(s)
        assert all(base <= t.data_ptr() < base + size for t in got["model"].values())  # zero-copy
        check(got)
        del got
    shmstore.destroy(name)
    with shmstore.connect(name, capacity="64MiB", prefault="16MiB", persist_dir=pdir) as s:
        got = s.restore("epoch1")
        assert set(got.origins.values()) == set() and set(got) == {"model", "optim"}
        check(got)
        assert set(got.origins.values()) == {"folder"}
        del got


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_dcp_save_and_load_through_the_store(name, tmp_path, how):
    """Issue 34 item 4: ``torch.distributed.checkpoint`` users pass ShmStoreWriter/ShmStoreReader and get the
    store's checkpoints: a model's and an optimizer's state saved (also with ``async_save``), then loaded into
    fresh ones from the node's store and, after the store is gone, from the folder."""
    import torch.distributed.checkpoint as dcp

    import shmstore
    from shmstore.contrib.dcp import ShmStoreReader, ShmStoreWriter
    torch.manual_seed(1)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    path = str(tmp_path / "step1")
    with shmstore.connect(name, capacity="64MiB", prefault="16MiB") as s:
        sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
        if how == "save":
            dcp.save(sd, storage_writer=ShmStoreWriter(path, store=s), no_dist=True)
        else:
            dcp.async_save(sd, storage_writer=ShmStoreWriter(path, store=s), no_dist=True).result(120)
        assert shmstore.checkpoint.folder.latest(path, "meta") is not None  # complete on return
    shmstore.destroy(name)
    with shmstore.connect(name, capacity="64MiB", prefault="16MiB") as s:
        m2 = torch.nn.Linear(16, 4)
        o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        m2(torch.randn(3, 16)).sum().backward()
        o2.step()
        sd2 = {"model": m2.state_dict(), "optim": o2.state_dict(), "step": 0}
        dcp.load(sd2, storage_reader=ShmStoreReader(path, store=s), no_dist=True)
        m2.load_state_dict(sd2["model"])
        assert torch.equal(m2.weight, model.weight) and sd2["step"] == 1
        assert torch.equal(sd2["optim"]["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])


DCP_RANK = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
import shmstore
from shmstore.contrib.dcp import ShmStoreReader, ShmStoreWriter
rank, path = int(os.environ['RANK']), os.environ['CK']
dist.init_process_group('gloo', init_method='file://' + os.environ['INIT'], rank=rank, world_size=2)
def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {'model': {f'l{i}.weight': torch.randn(256, 64 + i, generator=g) for i in range(8)},
            'step': torch.tensor(seed)}
with shmstore.connect(os.environ['N'], capacity='64MiB', prefault='8MiB', persist=os.environ['WHAT'] == 'save') as s:
    if os.environ['WHAT'] == 'save':
        dcp.save(state(7), storage_writer=ShmStoreWriter(path, store=s))
    else:
        sd = state(0)
        dcp.load(sd, storage_reader=ShmStoreReader(path, store=s))
        want = state(7)
        bad = [k for k in want['model'] if not torch.equal(sd['model'][k], want['model'][k])]
        assert not bad and int(sd['step']) == 7, (bad, sd['step'])
    dist.barrier()
dist.destroy_process_group()
print('ok', rank, flush=True)
"""


@pytest.mark.slow
def test_dcp_save_and_load_with_two_ranks_of_a_gloo_group(name, tmp_path):
    """dcp with a real process group (two ranks, gloo): dcp spreads the replicated items over the ranks, each
    rank's writer checkpoints its share, the coordinator's finish waits for both parts; both ranks then load
    every item (half of them written by the other rank) into fresh tensors, from the node's (persistent)
    store and, in a later pair of processes after the store is gone, from the folder."""
    import os
    import subprocess
    import sys

    import shmstore

    from helpers import ROOT
    path = str(tmp_path / "ck")
    for what in ("save", "load", "load-folder"):
        init = str(tmp_path / f"init-{what}")
        procs = [subprocess.Popen([sys.executable, "-c", DCP_RANK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=dict(os.environ, RANK=str(r), CK=path, INIT=init, N=name,
                                                      WHAT=what.split("-")[0], PYTHONPATH=ROOT))
                 for r in range(2)]
        outs = [p.communicate(timeout=180) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
        assert sorted(o[0].split()[1] for o in outs) == ["0", "1"]
        if what == "load":
            assert shmstore.destroy(name, force=True)  # it outlived the savers: the first load read it
    parts = sorted(d.split("@")[0] for d in os.listdir(path))
    assert parts == ["meta", "r0", "r1"], parts
