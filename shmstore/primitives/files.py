"""Opening files that another user could have planted (in /dev/shm or a spill directory).

/dev/shm and the usual spill roots (``/tmp``, node-local scratch) are
world-writable, and every name shmstore uses there is predictable, so anybody
on the node can be first to make one: a FIFO (an ``open`` without
``O_NONBLOCK`` waits forever for a writer: ``shmstore stores`` and the Slurm
epilog hung on one), a socket, a symbolic link to someone's file, a directory,
a file of garbage. So nothing there is opened before it is known to be a
regular file of the expected owner, in three steps:

1. ``lstat`` the name (no link followed): a regular file, owned by ``uid``;
2. ``open`` it with ``O_NONBLOCK | O_NOFOLLOW`` (even if it was swapped for a
   FIFO or a link since step 1, the open neither waits nor follows);
3. ``fstat`` the descriptor: still a regular file of ``uid``, and the same
   inode that step 1 saw.

Anything else is refused with :class:`~shmstore.errors.PermissionDeniedError`
naming the path and what it is; listings skip it with a logged warning.

Directories made there (the missing parents of a spill directory,
``$LOCAL/job123/...``) are made 0700 through the descriptor of their parent
and opened without following links, so a name planted in between is refused,
never used.
"""
from __future__ import annotations

import errno
import os
import stat

from ..errors import PermissionDeniedError

__all__ = ["describe", "check_regular", "open_regular", "make_dirs", "make_dir", "SAFE_OPEN", "free_bytes"]

SAFE_OPEN = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | SAFE_OPEN

_KINDS = ((stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def describe(mode: int) -> str:
    """What a file of ``mode`` is, for messages: ``"a fifo"``, ``"a regular file"``, ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def check_regular(path: str, st: os.stat_result, uid: int) -> None:
    """Refuse ``st`` (of ``path``) unless it is a regular file owned by ``uid``.

    Raises:
        PermissionDeniedError: it is not; the message names the path, what it is and its owner.
    """
    if not stat.S_ISREG(st.st_mode):
        raise PermissionDeniedError(f"{path!r} is {describe(st.st_mode)} (owner uid {st.st_uid}), not a regular "
                                    f"file: not shmstore's, left alone")
    if st.st_uid != uid:
        raise PermissionDeniedError(f"{path!r} belongs to uid {st.st_uid}, not {uid}: not shmstore's, left alone")


def open_regular(path: str, flags: int, uid: int, dir_fd: int | None = None, shown: str | None = None) -> int:
    """Open ``path`` (relative to ``dir_fd`` if given) only if it is a regular file of ``uid``.

    Args:
        flags: the access mode and extra flags; ``O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC`` are added.
        shown: the path as messages name it (default ``path``).

    Returns:
        The open descriptor (the caller closes it).

    Raises:
        FileNotFoundError: no such file, or it was replaced (by another regular file of ``uid``) while it was
            opened: the file looked at is gone.
        PermissionDeniedError: a FIFO, socket, link, directory or device, or another user's file.
    """
    shown = path if shown is None else shown
    seen = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    check_regular(shown, seen, uid)
    fd = os.open(path, flags | SAFE_OPEN, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        check_regular(shown, st, uid)
        # Replaced between the lstat and the open by another regular file of uid: in a sticky directory (or
        # one of uid's own) only uid or root can do that, so the file looked at is gone, not planted. A
        # store removed and made again under its name does it: connect() tries again on FileNotFoundError
        # (a PermissionDeniedError here once ended a connect beside a store's last close).
        if (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
            raise FileNotFoundError(errno.ENOENT, f"{shown!r} was replaced while it was opened (removed and made "
                                                  f"again meanwhile)")
        return fd
    except BaseException:
        os.close(fd)
        raise


def make_dirs(root: str) -> int:
    """Open the directory ``root`` (a spill root), making the components that are missing; returns its
    descriptor.

    The components that exist are used as the user named them (``/tmp``, a
    link to node-local scratch), except a symbolic link of another user where
    the first missing one is to be made. Each one created here is made 0700 through
    the descriptor of its parent and opened without following links, so a
    name planted meanwhile (a symlink, a file, another user's directory) is
    refused, never used: ``$LOCAL/job123/...`` of a job whose folder is not
    made yet works, and stays the job's own.

    Raises:
        PermissionDeniedError: a component is planted, or a parent cannot be written.
        OSError: a component cannot be made (a file in the way, a read-only file system).
    """
    path = os.path.abspath(root)
    base, missing = path, []
    while not os.path.lexists(base):
        base, tail = os.path.split(base)
        missing.append(tail)
    if missing:
        _check_link(path, base)
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _root_error(path, base, exc) from None
    for tail in reversed(missing):
        base = os.path.join(base, tail)
        try:
            made = make_dir(fd, tail, base)
            child = _open_own(fd, tail, base)
        finally:
            os.close(fd)
        if made:
            os.fchmod(child, 0o700)  # owner-only, even where the umask narrowed it to unwritable
        fd = child
    return fd


def _check_link(path: str, base: str) -> None:
    """Refuse to make ``path``'s missing components under ``base`` if ``base`` is a symbolic link of another
    user (root's and this user's are taken as given): planted where the job's own folder was to be made."""
    st = os.lstat(base)
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.getuid()):
        raise PermissionDeniedError(
            f"cannot create spill directory {path!r}: {base!r} is a symbolic link of uid {st.st_uid}, refusing to "
            f"follow it (someone else may have planted it; remove it, or set spill_dir= / SHMSTORE_SPILL_DIR to a "
            f"directory of your own)")


def make_dir(parent: int, name: str, path: str) -> bool:
    """``mkdir`` ``name`` (0700) in the directory ``parent``; True if made here, False if it existed."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        raise _root_error(path, os.path.dirname(path), exc, gone="removed meanwhile") from None


def _open_own(parent: int, name: str, path: str) -> int:
    """Open the directory ``name`` of ``parent`` that this process (or another of this user) just made,
    refusing a link, a non-directory or another user's directory planted under its name."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PermissionDeniedError(
                f"cannot create spill directory {path!r}: something else appeared under that name (a symbolic "
                f"link or a file), refusing to use it (remove it, or set spill_dir= / SHMSTORE_SPILL_DIR to a "
                f"directory of your own)") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise PermissionDeniedError(
                f"cannot create spill directory {path!r}: it belongs to uid {st.st_uid}, not {os.getuid()}; "
                f"refusing to use it (remove it, or set spill_dir= / SHMSTORE_SPILL_DIR to a directory of your own)")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _root_error(path: str, at: str, exc: OSError, gone: str = "a symbolic link to nothing") -> OSError:
    """The error for a spill directory ``path`` that cannot be made because of ``exc`` at ``at`` (``gone``:
    what a missing ``at`` means there)."""
    hint = "set spill_dir= / SHMSTORE_SPILL_DIR to a directory you can write"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermissionDeniedError(f"cannot create spill directory {path!r}: no permission to write in {at!r} "
                                     f"({hint})")
    why = {errno.ENOTDIR: f"{at!r} is not a directory", errno.ENOENT: f"{at!r} is {gone}",
           errno.EROFS: f"{at!r} is on a read-only file system"}.get(exc.errno or 0, exc.strerror or str(exc))
    return OSError(exc.errno, f"cannot create spill directory {path!r}: {why} ({hint})")


def free_bytes(path: str) -> int:
    """Free space of the file system that holds ``path`` (or will: the nearest folder of it that exists)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize
