"""The spill directory: one owner-only file per DISK object of a store, in a directory of its own.

Files are scratch, not persistence: no fsync. A file is written under a
``.tmp`` name and renamed when complete, so a reader or a restarted spill
process never mistakes a half-written file for an object. Reads map the file
read-only, so a slice of a spilled array reads only the pages it touches.

Files are named ``<tag>.<idx>.<gen>`` (and ``.tmp`` while being written):
the entry and its generation, after the store's incarnation tag (who made
the store and when, from its header). The directory is named after the
store's name, and a name can outlive a store: if a store's shared-memory
names are unlinked behind its back (an ``rm`` in /dev/shm, a cleaner), its
clients go on using it while the next client to connect makes a new store
under the same name, with the same directory. Each of the two sees, checks,
recovers and removes only its own files, so neither takes the other's
objects for strays (see :meth:`SpillFiles.names`).

Safety: the directory's name is predictable (``<spill_dir>/shmstore-<uid>-<name>-<node>``)
and spill directories are often shared (``/tmp``), so another user may have
put something there first. The directory is opened once per process with
``O_NOFOLLOW | O_DIRECTORY`` and checked through that descriptor (a
directory, ours, owner-only); every file operation then goes relative to the
descriptor, files are created with ``O_EXCL | O_NOFOLLOW``, and a symlink, a
directory of another user or anything else is refused with
:class:`~shmstore.errors.PermissionDeniedError` naming the path and what to do.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Callable

import numpy as np

from ..errors import PermissionDeniedError, ShmStoreError, SpillError
from ..meta import layout as L
from ..node.protocols import LevelHost
from ..primitives.files import SAFE_OPEN, free_bytes, make_dir, make_dirs, open_regular

__all__ = ["SpillFiles", "CHUNK", "LINGER", "incarnation", "remove_dir", "of_store"]

CHUNK = 64 << 20  # bytes per write/read call: progress granularity, bounded memory
LINGER = 2.0  # seconds a removal waits for other processes to let the directory go
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | SAFE_OPEN
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_OPEN  # O_EXCL: never an existing file, FIFO or link


def incarnation(creator_pid: int, created: float) -> str:
    """The tag of one store's spill files: the pid that made the store and when (both in its header)."""
    return f"{creator_pid:x}-{round(created * 1e6):x}"


def of_store(host: LevelHost) -> SpillFiles:
    """The spill files of the store ``host``: its folder (named after the store, in the spill folder its
    header records) and its incarnation (a name can outlive its store: see the module notes)."""
    h = L.unpack_header(host.buf)
    return SpillFiles(L.spill_dir(host.buf), host.prefix.lstrip("/"), incarnation(h.creator_pid, h.created))


class SpillFiles:
    """The directory holding a store's DISK objects, or those of one incarnation of it (``tag``).

    Owned by the node store: the spill process (or ``destroy``) removes its
    files with the store, and the directory once no other incarnation's
    files are left in it. Holds one descriptor of the directory per process,
    released by ``close``. Process-safe by naming (each object has its own
    file); thread-safe. Every name it takes and gives (``names``,
    ``unlink``) is without the tag: ``<idx>.<gen>`` and ``<idx>.<gen>.tmp``.
    """

    _fd = -1

    def __init__(self, root: str, name: str, tag: str = "") -> None:
        self.root = root
        self.folder = name
        self.path = os.path.join(root, name)
        self.tag = tag
        self._own = f"{tag}." if tag else ""  # what starts the name of each file of ours
        self._lock = threading.Lock()

    # ---- the directory ----------------------------------------------------
    def ensure(self) -> int:
        """Create the directory (0700) and any missing parents if needed, check it is ours, and return its
        descriptor.

        Raises:
            PermissionDeniedError: it, or a parent it had to create, is a symlink, not a directory, another
                user's, or open to others and not ours to fix; or a parent cannot be written.
            OSError: it cannot be created (a parent is a file, a read-only file system); the message names
                the path.
        """
        fd = self._fd
        if fd >= 0:
            return fd
        with self._lock:
            for _ in range(100):
                if self._fd >= 0:
                    break
                fd = self._open()
                _hold(fd, fcntl.LOCK_SH)  # while we have it open (see remove_all)
                if not os.fstat(fd).st_nlink:
                    os.close(fd)  # removed between our open and our lock: make it again
                    continue
                self._fd = fd
                _held.add(self)
            if self._fd < 0:
                raise OSError(errno.ENOENT, f"spill directory {self.path!r} keeps being removed under us")
            return self._fd

    def _open(self) -> int:
        root = make_dirs(self.root)
        try:
            made = make_dir(root, self.folder, self.path)
            fd = self._open_checked(root)
            if made:
                os.fchmod(fd, 0o700)  # the umask may have narrowed it (to unwritable, even)
            return fd
        finally:
            os.close(root)

    def _open_checked(self, root: int) -> int:
        try:
            fd = os.open(self.folder, _DIR_FLAGS, dir_fd=root)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                what = "a symbolic link" if os.path.islink(self.path) else "not a directory"
                raise PermissionDeniedError(
                    f"spill directory {self.path!r} is {what}, not a directory of this user: refusing to use it "
                    f"(someone else may have planted it; remove it, or set spill_dir= / SHMSTORE_SPILL_DIR to a "
                    f"directory of your own)") from None
            raise
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise PermissionDeniedError(
                    f"spill directory {self.path!r} belongs to uid {st.st_uid}, not {os.getuid()}: refusing to use "
                    f"it (remove it, or set spill_dir= / SHMSTORE_SPILL_DIR to a directory of your own)")
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.fchmod(fd, 0o700)  # ours: through the descriptor, so no symlink can redirect it
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _existing(self) -> int:
        """The directory's descriptor, or -1 if there is none of ours (never created, or refused)."""
        if self._fd < 0 and not os.path.lexists(self.path):
            return -1
        try:
            return self.ensure()
        # refused (PermissionDeniedError) or unusable: nothing of ours is in it
        except OSError:
            return -1

    def free_bytes(self) -> int:
        """Free space of the file system holding the directory (or that will, before it is made)."""
        return free_bytes(self.path)

    # ---- files ------------------------------------------------------------
    def file(self, idx: int, gen: int) -> str:
        return os.path.join(self.path, self._own + self.name(idx, gen))

    @staticmethod
    def name(idx: int, gen: int) -> str:
        return f"{idx}.{gen}"

    def create_tmp(self, idx: int, gen: int) -> int:
        """Open a new, empty ``<idx>.<gen>.tmp`` for writing; returns its descriptor.

        A stale one (of a writer that died) is replaced.

        Raises:
            OSError: it cannot be created. PermissionDeniedError: see :meth:`ensure`.
        """
        dfd = self.ensure()
        tmp = self.name(idx, gen) + ".tmp"
        try:
            return os.open(self._own + tmp, _NEW_FILE, 0o600, dir_fd=dfd)
        except FileExistsError:
            self.unlink(tmp)
            return os.open(self._own + tmp, _NEW_FILE, 0o600, dir_fd=dfd)

    def publish(self, idx: int, gen: int) -> None:
        """Rename a complete ``<idx>.<gen>.tmp`` to its final name."""
        dfd = self.ensure()
        name = self._own + self.name(idx, gen)
        os.rename(name + ".tmp", name, src_dir_fd=dfd, dst_dir_fd=dfd)

    def write(self, idx: int, gen: int, parts: Iterable[tuple[int, memoryview]], size: int,
              progress: Callable[[int], None] | None = None) -> None:
        """Write an object's file from ``(offset, bytes)`` parts, all or nothing.

        Raises:
            OSError: the write failed (no space, I/O error, permission); nothing is left behind.
        """
        fd = self.create_tmp(idx, gen)
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
            # forgotten before it is closed: an asynchronous exception right after the close must not close
            # it again (by then the number may be another thread's file); one right before it leaks it
            closing, fd = fd, -1
            os.close(closing)
            self.publish(idx, gen)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            self.unlink(self.name(idx, gen) + ".tmp")
            raise

    def _open_read(self, idx: int, gen: int) -> int:
        """Open an object's file for reading: only a regular file of ours (see :mod:`shmstore.primitives.files`)."""
        return open_regular(self._own + self.name(idx, gen), os.O_RDONLY, os.getuid(), dir_fd=self.ensure(),
                            shown=self.file(idx, gen))

    def read_into(self, idx: int, gen: int, dst: np.ndarray, progress: Callable[[int], None] | None = None) -> None:
        """Read an object's file into the writable uint8 array ``dst``.

        Raises:
            OSError: the file is missing or unreadable. SpillError: it is shorter than expected.
        """
        with os.fdopen(self._open_read(idx, gen), "rb", buffering=0) as f:
            mv = memoryview(dst.data)
            done = 0
            while done < len(mv):
                n = f.readinto(mv[done: done + CHUNK])
                if not n:
                    raise SpillError(f"spill file {self.file(idx, gen)!r} is {done} bytes, expected {len(mv)} "
                                     f"(something else truncated it)")
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
        fd = self._open_read(idx, gen)
        try:
            return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)

    def remove(self, idx: int, gen: int) -> None:
        """Remove an object's file and any half-written one; never raises on a missing file."""
        name = self.name(idx, gen)
        self.unlink(name)
        self.unlink(name + ".tmp")

    def unlink(self, name: str) -> None:
        """Remove one file of ours by name (as :meth:`names` gives it); a missing one (or directory) is
        no error."""
        dfd = self._existing()
        if dfd < 0:
            return
        try:
            os.unlink(self._own + name, dir_fd=dfd)
        except FileNotFoundError:
            pass

    def size(self, name: str) -> int:
        """The size of one file of ours (named as :meth:`names` gives it).

        Raises:
            OSError: it is not there.
        """
        return os.stat(self._own + name, dir_fd=self.ensure(), follow_symlinks=False).st_size

    def names(self) -> list[str]:
        """Names of our files in the directory, without the tag ([] if it was never created).

        Files of another incarnation of the store (another tag) are not ours:
        that store may be alive, its names unlinked behind its back (see the
        module notes).
        """
        dfd = self._existing()
        if dfd < 0:
            return []
        own = self._own
        return [n[len(own):] for n in os.listdir(dfd) if n.startswith(own)]

    def remove_all(self) -> int:
        """Remove our files and then the directory itself, unless another process has it open or other
        files are left in it (another incarnation's); returns how many files of ours there were. This
        process's descriptor of the directory goes too.

        Leaves alone what is not ours (a planted symlink stays, untouched).

        Every process holds a shared ``flock`` on the directory while it has
        it open, and the directory is removed only under an exclusive one.
        The race without, step by step: two stores of one name share the
        directory (see the module notes); the new one has no file yet; the
        old one goes and removes the empty directory; a process of the new
        store keeps the descriptor of the removed directory while another
        makes the directory again and spills into it: each reads "no such
        file" for the other's objects.
        """
        dfd = self._existing()
        if dfd < 0:
            return 0
        names = self.names()
        for name in names:
            try:
                os.unlink(self._own + name, dir_fd=dfd)
            except OSError:
                pass
        # LINGER: a store's last client wakes its spill process before it lets go
        remove_dir(dfd, self.path, LINGER)
        self.close()
        return len(names)

    def close(self) -> None:
        """Release this process's descriptor of the directory; idempotent."""
        with self._lock:
            if self._fd >= 0:
                fd, self._fd = self._fd, -1  # forgotten first: never closed twice
                os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, ShmStoreError):  # a finalizer never raises; the descriptor closes at exit anyway
            pass


def remove_dir(dfd: int, path: str, linger: float) -> None:
    """Remove the spill directory ``path`` (open as ``dfd``) once no other process has it open (waiting
    ``linger`` seconds at most: see :meth:`SpillFiles.remove_all` for why), if it is empty."""
    deadline = time.monotonic() + linger
    while True:
        try:
            _hold(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return  # in use (by another store of this name): the last to go removes it
            time.sleep(0.01)
    try:
        if os.fstat(dfd).st_ino == os.lstat(path).st_ino:
            os.rmdir(path)
    except OSError:  # files are left (another store's), or it is gone already
        pass


_held: weakref.WeakSet[SpillFiles] = weakref.WeakSet()  # this process's open directories (and their locks)


def _forget_in_child() -> None:
    """After fork: the child lets go of the directories it inherited (with their locks, which would keep a
    store's removal from taking the directory for as long as the child lives); it opens them again if it
    uses them."""
    for d in list(_held):
        if d._fd >= 0:
            try:
                os.close(d._fd)
            except OSError:
                pass
            d._fd = -1
        d._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def _hold(fd: int, how: int) -> bool:
    """``flock(fd, how)``: True when held, False on a file system without such locks (there the directory
    is removed as before, whoever has it open).

    Raises:
        BlockingIOError: ``LOCK_NB`` and another process holds a lock that excludes it.
    """
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
            return False
        raise
    return True
