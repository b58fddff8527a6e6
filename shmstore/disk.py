"""The DISK level's files: one owner-only file per object in the store's directory.

Files are scratch, not persistence: no fsync. A file is written under a
``.tmp`` name and renamed when complete, so a reader or a restarted spill
process never mistakes a half-written file for an object. Reads map the file
read-only, so a slice of a spilled array reads only the pages it touches.
"""
from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
from typing import Callable, Iterable

import numpy as np

from .errors import LayoutError

__all__ = ["SpillDir", "CHUNK"]

CHUNK = 64 << 20  # bytes per write/read call: progress granularity, bounded memory


class SpillDir:
    """The directory holding a store's DISK objects.

    Owned by the node store: the spill process (or ``destroy``) removes it
    with the store. Process-safe by naming: each object has its own file.
    """

    def __init__(self, root: str, name: str) -> None:
        self.root = root
        self.path = os.path.join(root, name)

    def ensure(self) -> None:
        """Create the directory (0700) if needed and check that it is ours.

        Raises:
            PermissionError: it belongs to another user or others may read it.
            OSError: it cannot be created.
        """
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except FileExistsError:
            pass
        st = os.stat(self.path)
        if st.st_uid != os.getuid():
            raise PermissionError(errno.EACCES, f"spill directory {self.path!r} belongs to uid {st.st_uid}")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(self.path, 0o700)

    def file(self, idx: int, gen: int) -> str:
        return os.path.join(self.path, f"{idx}.{gen}")

    def free_bytes(self) -> int:
        """Free space of the file system holding the directory."""
        probe = os.path.abspath(self.path)
        while not os.path.exists(probe) and probe != os.path.dirname(probe):
            probe = os.path.dirname(probe)  # not created yet: the file system it will be on
        st = os.statvfs(probe)
        return st.f_bavail * st.f_frsize

    def write(self, idx: int, gen: int, parts: Iterable[tuple[int, memoryview]], size: int,
              progress: Callable[[int], None] | None = None) -> None:
        """Write an object's file from ``(offset, bytes)`` parts, all or nothing.

        Raises:
            OSError: the write failed (no space, I/O error, permission); nothing is left behind.
        """
        self.ensure()
        final = self.file(idx, gen)
        tmp = final + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            done = 0
            for offset, data in parts:
                for start in range(0, len(data), CHUNK):
                    piece = data[start: start + CHUNK]
                    pos = offset + start
                    while len(piece):
                        n = os.pwrite(fd, piece, pos)
                        piece, pos, done = piece[n:], pos + n, done + n
                    if progress is not None:
                        progress(done)
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _remove(tmp)
            raise

    def read_into(self, idx: int, gen: int, dst: np.ndarray, progress: Callable[[int], None] | None = None) -> None:
        """Read an object's file into the writable uint8 array ``dst``.

        Raises:
            OSError: the file is missing or unreadable. LayoutError: it is shorter than expected.
        """
        with open(self.file(idx, gen), "rb", buffering=0) as f:
            mv = memoryview(dst)
            done = 0
            while done < len(mv):
                n = f.readinto(mv[done: done + CHUNK])
                if not n:
                    raise LayoutError(f"spill file {self.file(idx, gen)!r} is {done} bytes, expected {len(mv)}")
                done += n
                if progress is not None:
                    progress(done)

    def map(self, idx: int, gen: int, size: int) -> mmap.mmap | None:
        """Map an object's file read-only (None for an empty object).

        Raises:
            FileNotFoundError: the file is gone (the object moved or was deleted).
        """
        if size == 0:
            return None
        with open(self.file(idx, gen), "rb") as f:
            return mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ)

    def remove(self, idx: int, gen: int) -> None:
        """Remove an object's file and any half-written one; never raises on a missing file."""
        final = self.file(idx, gen)
        _remove(final)
        _remove(final + ".tmp")

    def names(self) -> list[str]:
        try:
            return os.listdir(self.path)
        except OSError:  # not made yet, or not a directory
            return []

    def remove_all(self) -> int:
        """Remove the directory and every file in it; returns how many files there were."""
        n = len(self.names())
        shutil.rmtree(self.path, ignore_errors=True)
        return n


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
