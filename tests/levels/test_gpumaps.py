"""The GPU level's process-side bookkeeping, with fake CUDA calls (no device here): device keys, the arena
mappings' registry and the owner of the arrays handed out (issue 23 items 9-12)."""
from __future__ import annotations

import gc

import pytest

import shmstore
from shmstore.levels.gpumaps import UNCLAIMED, DeviceIds, MappingRegistry, claim_slot, device_key, view_owner

H100 = ("0000:1B:00.0", bytes(range(1, 17)))
H200 = ("0000:3B:00.0", bytes(range(17, 33)))


def test_a_device_key_names_the_device_whatever_its_ordinal():
    assert device_key(*H100) == device_key("0000:1b:00.0 ", H100[1])  # the same bus id, however spelled
    assert device_key(*H100) != device_key(*H200)
    assert device_key(H100[0], b"mig-a") != device_key(H100[0], b"mig-b")  # MIG instances share a bus id
    assert device_key(H100[0], b"") != UNCLAIMED and len(device_key(H100[0], b"")) == 16  # a short UUID


def test_each_process_maps_the_key_to_its_own_ordinal():
    asked = []

    def visible(*devices):
        def source():
            asked.append(devices)
            return list(devices)
        return DeviceIds(source)

    spill = visible(H100, H200)  # CUDA_VISIBLE_DEVICES unset
    rank = visible(H200)         # a rank bound to the second GPU: its "device 0"
    assert rank.key_of(0) == spill.key_of(1)
    assert spill.ordinal_of(rank.key_of(0)) == 1 and rank.ordinal_of(spill.key_of(0)) is None
    assert rank.name_of(0) == "GPU 0 (0000:3B:00.0)"
    with pytest.raises(shmstore.DeviceError, match="no CUDA device 1 .*CUDA_VISIBLE_DEVICES") as err:
        rank.key_of(1)
    assert isinstance(err.value, RuntimeError) and err.value.device == 1
    assert len(asked) == 2  # each process lists its devices once


def test_a_slot_is_claimed_once_per_device():
    a, b, c = device_key(*H100), device_key(*H200), device_key("0000:5B:00.0", b"x")
    assert claim_slot([UNCLAIMED] * 3, a) == 0
    assert claim_slot([a, UNCLAIMED, UNCLAIMED], b) == 1
    assert claim_slot([a, b, UNCLAIMED], a) == 0 and claim_slot([UNCLAIMED, b, a], a) == 2
    assert claim_slot([a, b], c) == -1


class FakeCuda:
    """Records the IPC calls the registry makes."""

    def __init__(self):
        self.calls = []
        self.next = 0x7F00_0000_0000

    def open(self, handle, ordinal):
        self.calls.append(("open", handle, ordinal))
        self.next += 1 << 30
        return self.next

    def close(self, ptr):
        self.calls.append(("close", ptr))

    def free(self, ptr):
        self.calls.append(("free", ptr))

    def settle(self, ordinal):
        self.calls.append(("settle", ordinal))


class Pin:
    """Stands for the kernel's pin token: records when it is collected (the pin released)."""

    def __init__(self, calls):
        self.calls = calls

    def __del__(self):
        self.calls.append(("unpin",))


def test_one_mapping_per_arena_and_epoch_shared_by_every_store_of_the_process():
    cuda = FakeCuda()
    reg = MappingRegistry(cuda.open, cuda.close)
    a = reg.open(("s", 0, b"k", 1), b"h1", 0)   # a connect
    b = reg.open(("s", 0, b"k", 1), b"h1", 0)   # a second connect, or a Cluster beside the Store
    assert a is b and cuda.calls == [("open", b"h1", 0)] and reg.live() == {("s", 0, b"k", 1): 2}
    c = reg.open(("s", 0, b"k", 2), b"h2", 0)   # the arena made again: a new handle, mapped apart
    a.release()
    assert [x[0] for x in cuda.calls] == ["open", "open"]
    b.release()
    c.release()
    assert cuda.calls[2:] == [("close", a.ptr), ("close", c.ptr)] and reg.live() == {}


def test_a_failed_open_registers_nothing():
    def refuse(handle, ordinal):
        raise RuntimeError("cudaErrorMapBufferObjectFailed")
    reg = MappingRegistry(refuse, lambda ptr: None)
    with pytest.raises(RuntimeError):
        reg.open("k", b"h", 0)
    assert reg.live() == {}


def test_the_owners_allocation_is_used_in_place_and_freed_not_unmapped():
    cuda = FakeCuda()
    reg = MappingRegistry(cuda.open, cuda.close)
    own = reg.adopt("k", 0xA000, 0, cuda.free)  # the spill process's arena
    other = reg.open("k", b"h", 0)              # a level of the same process: never its own handle (CUDA refuses)
    assert other is own and cuda.calls == []
    own.release()
    other.release()
    assert cuda.calls == [("free", 0xA000)]


def test_close_keeps_the_mapping_until_the_last_view_goes_and_settles_before_the_pin():
    cuda = FakeCuda()
    reg = MappingRegistry(cuda.open, cuda.close)
    level_ref = reg.open("k", b"h", 3)
    view = view_owner(Pin(cuda.calls), level_ref, cuda.settle)  # what a get hands out owns this
    level_ref.release()  # the store's close()
    assert reg.live() == {"k": 1} and [c[0] for c in cuda.calls] == ["open"]  # still mapped: the view reads it
    del view
    gc.collect()
    assert cuda.calls[1:] == [("settle", 3), ("close", level_ref.ptr), ("unpin",)]  # queued work first, pin last
    assert reg.live() == {}


def test_a_dead_context_at_release_still_unpins_and_unmaps():
    cuda = FakeCuda()

    def dead(ordinal):
        raise RuntimeError("cudaErrorIllegalAddress")
    reg = MappingRegistry(cuda.open, cuda.close)
    m = reg.open("k", b"h", 0)
    view = view_owner(Pin(cuda.calls), m, dead)
    m.release()
    del view
    gc.collect()
    assert [c[0] for c in cuda.calls] == ["open", "close", "unpin"]


def test_a_release_run_by_the_collector_inside_the_registry_is_queued_not_deadlocked():
    cuda = FakeCuda()
    reg = MappingRegistry(cuda.open, cuda.close)
    first = reg.open("a", b"h", 0)

    def open_while_collecting(handle, ordinal):
        first.release()  # what a view's finalizer does if the collector runs here, under the registry's lock
        return cuda.open(handle, ordinal)
    reg._open = open_while_collecting
    reg.open("b", b"h2", 0)
    assert ("close", first.ptr) in cuda.calls and list(reg.live()) == ["b"]


def test_watchers_hear_of_the_first_view_and_of_the_last_and_late_watchers_at_once():
    """What the GPU level records for the arena's owner (CLIENT gpu_views): views, not the level's own
    reference, keep the owner's allocation."""
    heard = []
    reg = MappingRegistry(lambda h, d: 0x1000, lambda ptr: heard.append("closed"))
    m = reg.open("arena", b"h", 0)  # the level's own reference: no view yet
    m.watch("level", lambda held: heard.append(("level", held)))
    assert heard == []
    a = view_owner(["pin a"], m, lambda d: None)
    b = view_owner(["pin b"], m, lambda d: None)
    m.watch("second", lambda held: heard.append(("second", held)))  # views already live: told now
    assert heard == [("level", True), ("second", True)]
    del a
    gc.collect()
    assert heard == [("level", True), ("second", True)]
    del b
    gc.collect()
    assert heard[2:] == [("level", False), ("second", False)] and reg.live() == {"arena": 1}
    m.release()
    assert heard[-1] == "closed" and reg.live() == {}
