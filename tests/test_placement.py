"""placement: priority lists of levels, errors from the spill process's answers, progress lines."""
from __future__ import annotations

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.client.kernel import Kernel
from shmstore.levels import parse_levels
from shmstore.meta import layout as L
from shmstore.placement import DEFAULT_PUT_LEVELS, Placement, _request_error, spill_progress_line


def test_parse_levels_normalises_and_keeps_order():
    assert parse_levels(None, DEFAULT_PUT_LEVELS) == (Level.MEMORY, Level.DISK)
    assert parse_levels(Level.DISK, ()) == (Level.DISK,)
    assert parse_levels(["disk", 1, Level.DISK], ()) == (Level.DISK, Level.MEMORY)


@pytest.mark.parametrize("error, cls", [(L.ERR_LOCKED, shmstore.ObjectLockedError),
                                        (L.ERR_MISSING, shmstore.ObjectNotFoundError),
                                        (L.ERR_FULL, shmstore.StorageFullError), (L.ERR_IO, shmstore.SpillError)])
def test_each_answer_of_the_spill_process_becomes_its_error(error, cls):
    r = L.Request(L.REQ_MOVE, 1, 0, 0, 0, L.RS_FAILED, error, 0, 0, "why it failed")
    exc = _request_error("k", r)
    assert isinstance(exc, cls) and "'k': why it failed" in str(exc)


def test_progress_line():
    s = L.SpillState(0.9, 0.75, 0, 0, 0, 5, L.LEVEL_DISK, 3 << 20, 12 << 20, 0, 0.0, 0)
    assert spill_progress_line(s) == "moving to disk: 3.0 MiB of 12.0 MiB (25%)"
    assert spill_progress_line(s._replace(moving=0)) == ""


def test_first_level_with_room_wins(name, tmp_path):
    with shmstore.connect(name, capacity="8MiB", spill_dir=str(tmp_path)) as s:
        assert s.put("small", np.ones(10)).level == Level.MEMORY
        assert s.put("huge", np.ones(2 << 20)).level == Level.DISK  # 16 MiB: larger than memory
        assert s.put("ondisk", b"x", levels=[Level.DISK, Level.MEMORY]).level == Level.DISK
        with pytest.raises(shmstore.StorageFullError, match="capacity"):
            s.put("never", np.ones(2 << 20), levels=[Level.MEMORY])
        assert "never" not in s
        s.get("ondisk", levels=[Level.MEMORY])  # brought to the first level listed
        assert s.get_info("ondisk").level == Level.MEMORY
        assert s.check() == []


def test_memory_first_and_its_fallback_are_one_loop(name, tmp_path, monkeypatch):
    """A put with the default levels tries MEMORY, asks the spill process for room once per failed try and
    tries again; an object larger than MEMORY goes to DISK without asking (no second path in Store.put)."""
    tries: list[tuple[str, Level]] = []
    rooms: list[tuple[str, Level]] = []
    kernel_put, make_room = Kernel.put, Placement.make_room

    def counted_put(self, key, obj, level=Level.MEMORY, overwrite=False):
        tries.append((key, Level(level)))
        return kernel_put(self, key, obj, level, overwrite)

    def counted_room(self, key, nbytes, deadline, level=Level.MEMORY):
        rooms.append((key, Level(level)))
        return make_room(self, key, nbytes, deadline, level)

    monkeypatch.setattr(Kernel, "put", counted_put)
    monkeypatch.setattr(Placement, "make_room", counted_room)
    with shmstore.connect(name, capacity="8MiB", spill_dir=str(tmp_path), high_watermark=1.0,
                          low_watermark=0.99) as s:
        for i in range(7):  # 7 MiB of 8: under the high watermark, so nothing spills by itself
            s.put(f"fill{i}", np.ones(1 << 17))
        del tries[:]
        assert s.put("big", np.ones(1 << 18)).level == Level.MEMORY  # 2 MiB: room is made first
        assert rooms == [("big", Level.MEMORY)]
        assert tries == [("big", Level.MEMORY)] * 2
        del tries[:], rooms[:]
        assert s.put("huge", np.ones(2 << 20)).level == Level.DISK  # 16 MiB: no room can be made in MEMORY
        assert rooms == [] and tries == [("huge", Level.MEMORY), ("huge", Level.DISK)]
        assert s.check() == []


def test_a_large_put_is_not_refused_for_the_clients_own_empty_chunk_mid_arena(name, tmp_path):
    """The chunk a client cuts small objects from is taken wherever there is room (here mid-arena, the top
    being full); once its objects are gone it still split the free space, and a put of 12 MiB into an empty
    16 MiB store failed ('cannot make 13.2 MiB of room ... fragmented'; CI met it at random in
    test_usage_is_exact_while_the_store_spills). Placement now gives the chunk up and tries once more."""
    with shmstore.connect(name, capacity="16MiB", spill_dir=str(tmp_path), prefault=0) as s:
        s.put("x", np.zeros((10 << 20) // 8), levels=[Level.MEMORY])
        s.put("y", np.zeros(((6 << 20) - (64 << 10)) // 8), levels=[Level.MEMORY])  # the top is full
        s.delete("x")
        s.put("small", np.arange(10))  # the client's chunk: right below y
        cut = s.kernel._supply.cut
        assert 0 < cut[0] < (10 << 20) < cut[2] + (6 << 20)  # mid-arena
        s.clear()
        assert s.get_capacity()[Level.MEMORY].used == 0
        big = s.put("big", np.zeros((12 << 20) // 8), levels=[Level.MEMORY])
        assert big.level == Level.MEMORY and s.check() == []
        s.put("small2", np.arange(10))  # small puts go on, from a fresh chunk
        assert int(s.get("small2")[9]) == 9 and s.check() == []
