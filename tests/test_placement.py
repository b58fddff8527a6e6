"""placement: priority lists of levels, errors from the spill process's answers, progress lines."""
from __future__ import annotations

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.kernel import layout as L
from shmstore.levels import parse_levels
from shmstore.placement import DEFAULT_PUT_LEVELS, _request_error, spill_progress_line


def test_parse_levels_normalises_and_keeps_order():
    assert parse_levels(None, DEFAULT_PUT_LEVELS) == (Level.MEMORY, Level.DISK)
    assert parse_levels(Level.DISK, ()) == (Level.DISK,)
    assert parse_levels(["disk", 1, Level.DISK], ()) == (Level.DISK, Level.MEMORY)


@pytest.mark.parametrize("error, cls", [(L.ERR_LOCKED, shmstore.ObjectLockedError),
                                        (L.ERR_MISSING, shmstore.ObjectNotFoundError),
                                        (L.ERR_FULL, shmstore.StorageFullError), (L.ERR_IO, shmstore.SpillError)])
def test_each_answer_of_the_spill_process_becomes_its_error(error, cls):
    r = L.Request(L.REQ_MOVE, 1, 0, 0, 0, L.RS_FAILED, error, 0, "why it failed")
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
