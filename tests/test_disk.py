"""disk: the spill directory's files, written all or nothing, read and mapped, refused when not ours."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest

import shmstore
from shmstore.levels.disk import SpillDir


@pytest.fixture
def spill(tmp_path):
    d = SpillDir(str(tmp_path), "store-dir")
    yield d
    d.close()


def test_not_created_until_first_write_then_owner_only(spill, tmp_path):
    assert spill.names() == [] and not os.path.exists(spill.path)
    spill.write(3, 1, [(0, memoryview(b"hello")), (5, memoryview(b" world"))], 11)
    assert spill.names() == ["3.1"]
    assert stat.S_IMODE(os.stat(spill.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(spill.file(3, 1)).st_mode) == 0o600
    dst = np.zeros(11, np.uint8)
    spill.read_into(3, 1, dst)
    assert dst.tobytes() == b"hello world"
    assert bytes(spill.map(3, 1, 11)[:5]) == b"hello" and spill.map(3, 1, 0) is None


def test_failed_write_leaves_nothing(spill):
    def parts():
        yield 0, memoryview(b"part")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        spill.write(4, 0, parts(), 100)
    assert spill.names() == []


def test_stale_tmp_of_a_dead_writer_is_replaced_and_publish_renames(spill):
    fd = spill.create_tmp(5, 2)
    os.write(fd, b"stale")
    os.close(fd)
    fd = spill.create_tmp(5, 2)  # a new writer of the same entry generation
    os.write(fd, b"fresh!")
    os.close(fd)
    spill.publish(5, 2)
    assert spill.names() == ["5.2"]
    with open(spill.file(5, 2), "rb") as f:
        assert f.read() == b"fresh!"


def test_short_file_is_a_spill_error(spill):
    spill.write(6, 0, [(0, memoryview(b"abc"))], 3)
    with pytest.raises(shmstore.SpillError, match="3 bytes, expected 10"):
        spill.read_into(6, 0, np.zeros(10, np.uint8))


def test_remove_and_remove_all(spill):
    for i in range(3):
        spill.write(i, 0, [(0, memoryview(b"x"))], 1)
    spill.remove(1, 0)
    spill.remove(1, 0)  # a missing file is no error
    assert sorted(spill.names()) == ["0.0", "2.0"]
    assert spill.remove_all() == 2 and not os.path.exists(spill.path)


def test_symlink_in_its_place_is_refused(spill, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    os.symlink(target, spill.path)
    with pytest.raises(shmstore.PermissionDeniedError, match="symbolic link"):
        spill.write(1, 0, [(0, memoryview(b"x"))], 1)
    assert spill.names() == [] and spill.remove_all() == 0
    assert os.listdir(target) == [] and stat.S_IMODE(os.stat(target).st_mode) == 0o755
    assert os.path.islink(spill.path)


def test_a_file_in_its_place_is_refused(spill):
    with open(spill.path, "w") as f:
        f.write("not a directory")
    with pytest.raises(shmstore.PermissionDeniedError, match="not a directory"):
        spill.ensure()


def test_own_directory_open_to_others_is_made_owner_only(spill):
    os.mkdir(spill.path, 0o755)
    os.chmod(spill.path, 0o777)
    spill.ensure()
    assert stat.S_IMODE(os.stat(spill.path).st_mode) == 0o700
