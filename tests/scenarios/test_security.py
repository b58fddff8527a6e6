"""Attaching to segments that are not ours fails clearly and changes nothing."""
from __future__ import annotations

import os
import pwd
import subprocess
import uuid

import posix_ipc
import pytest

import shmstore
from shmstore import Level
from shmstore.config import Config
from shmstore.meta import layout as L
from shmstore.node.nodestore import store_prefix
from shmstore.primitives.segment import Segment

from helpers import shm_segments, wait_for


def _fake_meta(name: str, content: bytes, uid: int | None = None, mode: int = 0o600) -> Segment:
    seg = Segment.create(store_prefix(name, Config.from_kwargs().node) + "-meta", 1 << 16)
    seg.mm[: len(content)] = content
    if uid is not None:
        os.fchown(seg._fd, uid, -1)
    os.fchmod(seg._fd, mode)
    return seg


def _cleanup(seg: Segment) -> None:
    seg.close()
    seg.unlink()


def test_non_shmstore_segment_is_a_layout_error(name):
    seg = _fake_meta(name, b"NOTOURS!" + b"\1" * 100)
    try:
        with pytest.raises(shmstore.LayoutError, match="not a shmstore segment"):
            shmstore.connect(name)
    finally:
        _cleanup(seg)


def test_other_layout_version_is_a_layout_error(name):
    buf = bytearray(L.HEADER_SIZE)
    L.pack_header(buf, L.Header(L.MAGIC, L.LAYOUT_VERSION + 1, L.STATE_READY, 0, os.getuid(), 1, 0, 1 << 20,
                                1 << 16, 16, 4, 4, 16, 0.0, name, "x"))
    seg = _fake_meta(name, bytes(buf))
    try:
        with pytest.raises(shmstore.LayoutError, match=f"layout version {L.LAYOUT_VERSION + 1}"):
            shmstore.connect(name)
    finally:
        _cleanup(seg)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a segment to another user")
def test_segment_of_another_user_is_refused(name):
    seg = _fake_meta(name, b"\0" * 64, uid=4242)
    try:
        with pytest.raises(shmstore.PermissionDeniedError, match="4242"):
            shmstore.connect(name)
    finally:
        _cleanup(seg)


def test_segment_readable_by_others_is_refused(name):
    seg = _fake_meta(name, b"\0" * 64, mode=0o644)
    try:
        with pytest.raises(PermissionError, match="readable by others"):
            shmstore.connect(name)
    finally:
        _cleanup(seg)


# ---- another user on the node: squatting on names, planted symlinks ----------------------------------
#
# The throwaway user's files are made by root and handed to that user (chown): the kernel then treats
# them exactly as files that user made (what matters in the sticky /tmp and /dev/shm is the owner).
# Its processes could not run this venv's interpreter anyway (it lives under root's home).

@pytest.fixture(scope="module")
def other_user():
    if os.getuid() != 0:
        pytest.skip("needs root: creates a throwaway unprivileged user to play the other user on the node")
    login = "shmsq" + uuid.uuid4().hex[:8]
    r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", login],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"useradd failed: {r.stderr.strip()}")
    pw = pwd.getpwnam(login)
    try:
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", login], capture_output=True)


def _give(path: str, user: tuple[int, int], mode: int | None = None) -> None:
    os.lchown(path, *user)
    if mode is not None:
        os.chmod(path, mode)


def _names(name: str) -> tuple[str, str, str]:
    prefix = store_prefix(name, Config.from_kwargs().node)
    return prefix + "-meta", prefix + "-arena", prefix + "-wake"


def test_planted_symlink_spill_directory_is_refused(name, tmp_path, other_user):
    """Regression: the victim (root too) chmodded the symlink's target to 0700 and wrote spill files into it."""
    target = tmp_path / "precious"
    target.mkdir(mode=0o755)
    link = tmp_path / f"shmstore-{os.getuid()}-{name}-{Config.from_kwargs().node}"
    os.symlink(target, link)
    _give(str(link), other_user)
    with shmstore.connect(name, capacity="8MiB", spill_dir=str(tmp_path)) as s:
        with pytest.raises(shmstore.PermissionDeniedError, match="symbolic link"):
            s.put("x", b"y" * 1000, levels=[Level.DISK])
        assert "x" not in s
        s.put("m", b"in memory is fine")
        assert s.check() == []
    assert wait_for(lambda: not any(name in seg for seg in shm_segments()), timeout=10)
    assert os.stat(target).st_mode & 0o777 == 0o755 and not os.listdir(target)
    assert os.path.islink(link) and os.readlink(link) == str(target)  # not ours: left alone


def test_spill_directory_of_another_user_is_refused(name, tmp_path, other_user):
    d = tmp_path / f"shmstore-{os.getuid()}-{name}-{Config.from_kwargs().node}"
    d.mkdir()
    _give(str(d), other_user, 0o777)
    with shmstore.connect(name, capacity="8MiB", spill_dir=str(tmp_path)) as s:
        with pytest.raises(shmstore.PermissionDeniedError, match=f"belongs to uid {other_user[0]}"):
            s.put("x", b"y", levels=[Level.DISK])
    assert not os.listdir(d) and os.stat(d).st_mode & 0o777 == 0o777


def _squat(kind: str, path_name: str, user: tuple[int, int]) -> str:
    if kind == "semaphore":
        sem = posix_ipc.Semaphore(path_name, posix_ipc.O_CREX, mode=0o666)
        sem.close()
        path = "/dev/shm/sem." + path_name.lstrip("/")
    else:
        shm = posix_ipc.SharedMemory(path_name, posix_ipc.O_CREX, mode=0o666, size=4096)
        os.close(shm.fd)
        path = "/dev/shm/" + path_name.lstrip("/")
    _give(path, user, 0o666)
    return path


@pytest.mark.parametrize("which", ["meta", "arena", "wake"])
def test_squatted_names_are_refused_clearly_and_leave_nothing(name, other_user, which):
    """Regression: a squatted wake semaphore was used silently (the spill process then died of a raw
    PermissionsError); a squatted arena gave a bare posix_ipc.PermissionsError naming nothing."""
    meta, arena, wake = _names(name)
    target = {"meta": meta, "arena": arena, "wake": wake}[which]
    path = _squat("semaphore" if which == "wake" else "segment", target, other_user)
    try:
        with pytest.raises(shmstore.PermissionDeniedError, match=f"{target}.*uid {other_user[0]}.*name="):
            shmstore.connect(name, capacity="8MiB")
        assert os.stat(path).st_uid == other_user[0]  # theirs, untouched
        mine = [s for s in shm_segments() if name in s and not path.endswith(s)]
        assert not mine, f"left behind: {mine}"
    finally:
        os.unlink(path)


def test_own_stale_semaphore_is_replaced(name):
    """A wake semaphore of this user left by a store that died before removing it does not block a new store."""
    *_, wake = _names(name)
    posix_ipc.Semaphore(wake, posix_ipc.O_CREX, mode=0o600).close()
    with shmstore.connect(name, capacity="8MiB") as s:
        s.put("a", 1)
        assert s.get("a") == 1
