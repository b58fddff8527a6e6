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
