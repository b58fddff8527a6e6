"""POSIX shared-memory segments: create, attach, close, unlink.

The only module that touches posix_ipc shared memory and mmap.
"""
from __future__ import annotations

import errno
import mmap
import os
import stat
from typing import Any

import numpy as np
import posix_ipc

from ..errors import PermissionDeniedError, ShmStoreError, StorageFullError
from ..units import format_size
from . import native
from .files import describe, open_regular

__all__ = ["Segment", "Wakeup", "unlink_segment", "unlink_semaphore", "list_segments", "check_owner"]

_SHM_DIR = "/dev/shm"
_SQUAT_HINT = ("another user created it first: ask them or root to remove it, or choose another store name "
               "(name= / SHMSTORE_NAME)")
_PLANTED_HINT = ("someone may have planted it: ask its owner or root to remove it, or choose another store name "
                 "(name= / SHMSTORE_NAME)")
_MODE_HINT = "remove it (`shmstore destroy`) or choose another store name (name= / SHMSTORE_NAME)"


def _shm_path(name: str, semaphore: bool = False) -> str:
    bare = name.lstrip("/")
    return os.path.join(_SHM_DIR, "sem." + bare if semaphore else bare)


def check_owner(name: str, semaphore: bool = False, uid: int | None = None) -> bool:
    """Check that the segment (or semaphore) ``name`` is a regular, owner-only file of ``uid`` (default: this
    user), looking at the name only (``lstat``: nothing is opened, no link followed).

    Returns:
        False if it does not exist.

    Raises:
        PermissionDeniedError: it belongs to another user, is open to others or is not a regular file
            (a FIFO, socket, symbolic link or directory planted under the name).
    """
    what = "semaphore" if semaphore else "segment"
    uid = os.getuid() if uid is None else uid
    try:
        st = os.lstat(_shm_path(name, semaphore))
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /dev/shm to look at: posix_ipc's own checks apply
    if not stat.S_ISREG(st.st_mode):
        raise PermissionDeniedError(f"{what} {name!r} is {describe(st.st_mode)} of uid {st.st_uid}, not a "
                                    f"shared-memory file: {_PLANTED_HINT}")
    if st.st_uid != uid:
        raise PermissionDeniedError(f"{what} {name!r} belongs to uid {st.st_uid}, not {uid}: {_SQUAT_HINT}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionDeniedError(f"{what} {name!r} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                                    f"{_MODE_HINT}")
    return True


def _open_existing(name: str, uid: int) -> int:
    """A descriptor of the existing segment ``name`` (read-write), checked before and after the open.

    Raises:
        FileNotFoundError: no such segment. PermissionDeniedError: not a regular owner-only file of ``uid``.
    """
    if not check_owner(name, uid=uid):
        raise FileNotFoundError(errno.ENOENT, f"no segment {name!r}")
    if not os.path.isdir(_SHM_DIR):  # not Linux: shm_open's names are not files to look at
        try:
            return int(posix_ipc.SharedMemory(name, 0).fd)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(errno.ENOENT, f"no segment {name!r}") from exc
        except posix_ipc.PermissionsError as exc:
            raise PermissionDeniedError(f"segment {name!r} cannot be opened: {exc} ({_SQUAT_HINT})") from exc
    # what shm_open does on Linux, plus O_NONBLOCK: never waits on a FIFO swapped in since the look above
    return open_regular(_shm_path(name), os.O_RDWR, uid)


class Segment:
    """One named POSIX shared-memory segment mapped into this process.

    The process that created it (``create``) and :func:`unlink_segment`
    callers may unlink the name; ``close`` only unmaps. Not thread-safe to
    close while other threads use the mapping.
    """

    name: str = ""
    size: int = 0
    mm: mmap.mmap | None = None
    address: int = 0
    ro: mmap.mmap | None = None  # the read-only mapping, once readonly_mapping() made it
    _ro_address: int | None = None
    _anchor: object = None
    _fd: int = -1

    def __init__(self, name: str, size: int, fd: int) -> None:
        self.name = name
        self.size = size
        self._fd = fd
        try:
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.address, self._anchor = native.address_of(self.mm)
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create a new owner-only segment of ``size`` bytes (all or nothing).

        Raises:
            FileExistsError: the name exists.
            StorageFullError: /dev/shm cannot hold ``size`` bytes.
        """
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError as exc:
            check_owner(name)  # squatted by another user: say so instead of retrying
            raise FileExistsError(errno.EEXIST, f"segment {name!r} exists") from exc
        except posix_ipc.PermissionsError as exc:
            raise PermissionDeniedError(f"cannot create segment {name!r}: {exc} ({_SQUAT_HINT})") from exc
        fd = shm.fd
        try:
            os.fchmod(fd, 0o600)  # the umask may have narrowed it further, never widened
            os.ftruncate(fd, size)
            return cls(name, size, fd)
        except OSError as exc:
            os.close(fd)
            posix_ipc.unlink_shared_memory(name)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise StorageFullError(f"cannot create segment {name!r} of {format_size(size)}: "
                                       f"{exc.strerror}") from exc
            raise
        except BaseException:
            os.close(fd)
            posix_ipc.unlink_shared_memory(name)
            raise

    @classmethod
    def attach(cls, name: str, owner: int | None = None) -> Segment:
        """Map an existing segment of this user (of ``owner``: root removing another user's store).

        Nothing is opened before it is known to be a regular file of that user
        (see :mod:`shmstore.primitives.files`): a FIFO, socket, symbolic link or
        directory planted under the name is refused, never waited on.

        Raises:
            FileNotFoundError: no such segment.
            BlockingIOError: the segment exists but is still empty (being created).
            PermissionError: the segment belongs to another user, is not owner-only or is not a regular file.
        """
        uid = os.getuid() if owner is None else owner
        fd = _open_existing(name, uid)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                raise PermissionDeniedError(f"segment {name!r} is {describe(st.st_mode)} of uid {st.st_uid}, "
                                            f"not a shared-memory file of uid {uid}: {_SQUAT_HINT}")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise PermissionDeniedError(f"segment {name!r} is readable by others (mode "
                                            f"{stat.S_IMODE(st.st_mode):o}): {_MODE_HINT}")
            if st.st_size == 0:  # between the creator's shm_open and ftruncate
                raise BlockingIOError(errno.EAGAIN, f"segment {name!r} is being created")
            return cls(name, st.st_size, fd)
        except BaseException:
            os.close(fd)
            raise

    def mapping(self) -> mmap.mmap:
        """The mapping of the open segment.

        Raises:
            ValueError: the segment is closed.
        """
        if self.mm is None:
            raise ValueError(f"segment {self.name!r} is closed")
        return self.mm

    def readonly_mapping(self) -> mmap.mmap:
        """A second mapping of the segment, read-only (``PROT_READ``), made on first use and closed by ``close``.

        What views handed to users are built over: numpy refuses
        ``setflags(write=True)`` on an array over it (the mapping exports a
        read-only buffer), and a write that ignores the flag (a torch tensor,
        ctypes, a C extension) faults (SIGSEGV) in the writing process instead
        of changing the object under every reader. Its page-table entries are
        its own: a page this process wrote through ``mapping()`` costs a minor
        fault on the first read through this one.

        Raises:
            ValueError: the segment is closed.
        """
        if self.ro is None:
            if self._fd < 0:
                raise ValueError(f"segment {self.name!r} is closed")
            self.ro = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
            try:
                self.ro.madvise(mmap.MADV_HUGEPAGE)  # as advise_hugepages for the writable one
            except (AttributeError, OSError):
                pass
        return self.ro

    def advise_hugepages(self) -> None:
        """Ask for transparent huge pages (honoured where shmem THP is ``advise``; a no-op elsewhere).

        4 KiB pages cost a lot of TLB misses on large reads: on a VM whose
        tmpfs has no huge pages, reading the arena ran at a third of the speed
        of a (huge-page backed) private numpy array.
        """
        try:
            if self.mm is not None:
                self.mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass

    def populate(self, offset: int, length: int) -> int:
        """Fault ``[offset, offset+length)`` in for writing; returns 0 or an errno."""
        start = offset & ~4095
        end = min(self.size, (offset + length + 4095) & ~4095)
        return native.populate_write(self.address + start, end - start)

    def populate_readonly(self, offset: int, length: int) -> int:
        """Map ``[offset, offset+length)`` of :meth:`readonly_mapping` (pages faulted in through the writable
        one: no page is allocated); returns 0 or an errno."""
        start = offset & ~4095
        end = min(self.size, (offset + length + 4095) & ~4095)
        if self._ro_address is None:
            self._ro_address = int(np.frombuffer(self.readonly_mapping(), np.uint8, 1).ctypes.data)
        return native.populate_read(self._ro_address + start, end - start)

    def close(self) -> None:
        """Unmap and close the descriptor; idempotent.

        Raises nothing: if live views still export the mapping it stays
        mapped until they are garbage collected.
        """
        self._anchor = self._ro_address = None
        for attr in ("ro", "mm"):
            mm = getattr(self, attr)
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # views into it are alive; the mmap object unmaps when they die
                setattr(self, attr, None)
        if self._fd >= 0:
            fd, self._fd = self._fd, -1  # forgotten first: never closed twice
            os.close(fd)

    def unlink(self) -> None:
        """Remove the segment's name (creator or janitor only: the name is known to be this segment's)."""
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
            pass

    def named(self) -> bool | None:
        """Whether the segment's name still names this mapping: False where it was unlinked (or names
        another segment now), None where that cannot be told."""
        if self._fd < 0:
            return None
        try:
            return os.stat(_shm_path(self.name)).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return False
        except OSError:
            return None

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, ShmStoreError):  # a finalizer never raises; unmapping happens at exit anyway
            pass

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (Segment.attach, (self.name,))


def segment_exists(name: str) -> bool:
    """Whether a segment of that name exists on this node."""
    return os.path.exists(_shm_path(name))


def segment_path(name: str, semaphore: bool = False) -> str:
    """The file behind a segment (or semaphore) of that name."""
    return _shm_path(name, semaphore)


def _ours(name: str, semaphore: bool, owner: int | None) -> bool:
    """Whether ``name`` is a regular file of ``owner`` (default: this user), by ``lstat``: root may unlink
    anything in /dev/shm, so a planted FIFO or another user's file under one of our names stays."""
    try:
        st = os.lstat(_shm_path(name, semaphore))
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /dev/shm to look at: the unlink's own permission checks apply
    return stat.S_ISREG(st.st_mode) and st.st_uid == (os.getuid() if owner is None else owner)


def unlink_segment(name: str, owner: int | None = None) -> bool:
    """Remove a segment name of this user (of ``owner``: root removing another user's store); False if it
    was already gone or is not a regular file of that user (left alone)."""
    if not _ours(name, False, owner):
        return False
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        return False


def list_segments(prefix: str) -> list[str]:
    """Names (with a leading slash) of segments in /dev/shm starting with ``prefix``."""
    try:
        entries = os.listdir(_SHM_DIR)
    except OSError:
        return []
    bare = prefix.lstrip("/")
    return sorted("/" + e for e in entries if e.startswith(bare))


class Wakeup:
    """A named POSIX semaphore that clients post to wake the spill process.

    The creator of the store creates it (exclusively: a semaphore of that
    name left by a dead store of this user is replaced, one of another user
    refused); ``unlink`` (with the store) removes the name. Process-safe and
    thread-safe.
    """

    _sem = None

    def __init__(self, name: str, create: bool) -> None:
        self.name = name
        try:
            if create:
                self._sem = self._create(name)
            else:
                if not check_owner(name, semaphore=True):
                    raise FileNotFoundError(errno.ENOENT, f"no semaphore {name!r}")
                self._sem = posix_ipc.Semaphore(name, 0)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(errno.ENOENT, f"no semaphore {name!r}") from exc
        except posix_ipc.PermissionsError as exc:
            raise PermissionDeniedError(f"semaphore {name!r} cannot be opened: {exc} ({_SQUAT_HINT})") from exc

    @staticmethod
    def _create(name: str) -> Any:
        try:
            return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        except posix_ipc.ExistentialError:
            check_owner(name, semaphore=True)  # another user's: refused
            unlink_semaphore(name)  # ours, left by a store that died before removing it
            return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)

    def post(self) -> None:
        """Wake the waiter (cheap; extra posts only cause extra rounds)."""
        if self._sem is not None and self._sem.value < 8:
            self._sem.release()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a post; True if one came.

        A signal arriving meanwhile (SIGTERM from a batch system) ends the
        wait early with False, after its Python handler ran.
        """
        if self._sem is None:
            raise ValueError(f"semaphore {self.name!r} is closed")
        try:
            self._sem.acquire(timeout)
            return True
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False

    def close(self) -> None:
        if self._sem is not None:
            self._sem.close()
            self._sem = None

    def unlink(self) -> None:
        unlink_semaphore(self.name)


def unlink_semaphore(name: str, owner: int | None = None) -> bool:
    """Remove a named semaphore of this user (of ``owner``); False if it was already gone or is not ours."""
    if not _ours(name, True, owner):
        return False
    try:
        posix_ipc.unlink_semaphore(name)
        return True
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        return False
