"""The stores on this host: list them (``shmstore stores``), remove the stale ones (``shmstore gc``, the epilog).

Both read metadata segments in /dev/shm that other processes (and, for root,
other users) made, in a directory where anybody can make a file under any
store's name. So:

- nothing is opened before it is known to be a regular file owned by the uid
  its name carries (``lstat``, then ``O_NONBLOCK | O_NOFOLLOW`` and ``fstat``:
  see :mod:`shmstore.primitives.files`). A FIFO, socket, symbolic link, directory,
  another user's file, a file too short for a header, a header that is not
  ours, of another layout version or naming another store than its file name:
  skipped with a logged warning, never waited on, never removed. A FIFO made
  this way hung ``shmstore stores``, ``gc`` and the Slurm epilog forever.
- a store is removed only if it is stale: not persistent, no live client, its
  spill process not running, not being created by a live process. The
  listing says so first; then, right before removing it, the same is decided
  again under the store's ADMIN lock, where it is marked ``destroying`` (a
  client may have attached since the listing). That is the janitor's own
  protocol (see :mod:`shmstore.node.nodestore`): a client registering under the
  same lock either came first (the store stays) or sees ``destroying`` and
  starts a fresh store.
- only the store's own names go: ``-arena``, ``-wake``, the files of its
  incarnation in its spill directory (a newer or older store of the same
  name may share the directory: see :mod:`shmstore.levels.spillfiles`) and
  ``-meta`` last, each only if it belongs to the store's owner.
"""
from __future__ import annotations

import logging
import mmap
import os
import stat
import time
from typing import Any, Callable

from .config import SHM_DIR
from .errors import PermissionDeniedError, ShmStoreError
from .levels.spillfiles import incarnation, remove_dir
from .meta import layout as L
from .meta.lock import ShmLock
from .node.nodestore import pid_alive, store_prefix
from .persist.plans import is_plan_file, plan_dir
from .primitives.files import SAFE_OPEN, open_regular
from .primitives.segment import Segment, list_segments, segment_path, unlink_segment, unlink_semaphore

__all__ = ["list_stores", "collect_stale", "collect_mpi_orphans", "MPI_SEGMENT_PREFIXES"]

# The shared memory MPI libraries leave in /dev/shm when a job is aborted or killed: MPICH's (mpich_shm_*,
# mpich_vci_*) and Open MPI's (sm_segment.*, vader_segment.*)
MPI_SEGMENT_PREFIXES = ("mpich_", "sm_segment.", "vader_segment.")

log = logging.getLogger("shmstore")
# a live holder of the ADMIN lock means a live process: not stale anyway
_LOCK_TIMEOUT = 5.0


def list_stores(uid: int | None = None, all_users: bool = False) -> list[dict[str, Any]]:
    """The stores on this host: this user's, another ``uid``'s, or (``all_users``) everyone's.

    Each as a dict: ``name``, ``node``, ``uid``, ``persistent``, ``capacity``,
    ``clients`` (attached and alive), ``spill_pid``, ``spill_alive``,
    ``stale`` (nobody alive uses it: ``shmstore gc`` would remove it),
    ``segment``, ``spill_dir``. Reads the stores' headers only; changes
    nothing. What is not a store's metadata segment is skipped with a warning.
    """
    prefix = "/shmstore-" if all_users else f"/shmstore-{os.getuid() if uid is None else uid}-"
    found = (_look(meta) for meta in list_segments(prefix) if meta.endswith("-meta"))
    return [store for store in found if store is not None]


def _named_uid(meta: str) -> int | None:
    """The uid in a segment name ``/shmstore-<uid>-...``, None if there is none."""
    uid = meta[len("/shmstore-"):].split("-", 1)[0]
    return int(uid) if uid.isdigit() else None


def _look(meta: str) -> dict[str, Any] | None:
    """The store whose metadata segment is ``meta``, or None (skipped: gone, or not a store's)."""
    path, owner = segment_path(meta), _named_uid(meta)
    if owner is None:
        log.warning("skipping %s: not named for a uid (shmstore-<uid>-<name>-<node>-meta)", path)
        return None
    try:
        fd = open_regular(path, os.O_RDONLY, owner)
    except FileNotFoundError:
        return None  # removed since the directory was read
    # a FIFO, socket, link, directory, another user's file (PermissionDeniedError)
    except OSError as exc:
        log.warning("skipping %s", exc)
        return None
    try:
        return _read(meta, fd, owner)
    finally:
        os.close(fd)


def _read(meta: str, fd: int, owner: int) -> dict[str, Any] | None:
    """Read the store described by the open metadata segment ``fd`` (read-only, whoever owns it)."""
    path, size = segment_path(meta), os.fstat(fd).st_size
    if size < L.HEADER_SIZE:
        if size:  # 0: its creator is between shm_open and ftruncate
            log.warning("skipping %s: %d bytes, too short for a store's header", path, size)
        return None
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        return _describe(meta, mm, size, owner)
    except Exception as exc:  # garbage past the checks must not end a listing, let alone an epilog
        log.warning("skipping %s: unreadable header (%s)", path, exc)
        return None
    finally:
        _close_quietly(mm)


def _header_problem(meta: str, h: Any, owner: int, size: int) -> str | None:
    """Why the header ``h`` of ``meta`` is not one of a store of this build, or None if it is."""
    if h.magic != L.MAGIC:
        return None if h.magic == b"\0" * 8 else "not a shmstore segment"
    if h.version != L.LAYOUT_VERSION:
        return f"layout version {h.version}, this build reads {L.LAYOUT_VERSION}"
    if h.uid != owner or store_prefix(h.name, h.node, owner) + "-meta" != meta:
        return f"its header names store {h.name!r} on node {h.node!r} of uid {h.uid}, not this file"
    if L.Layout.from_header(h).size > size:
        return f"{size} bytes, shorter than its header says"
    return None


def _describe(meta: str, mm: mmap.mmap, size: int, owner: int) -> dict[str, Any] | None:
    h = L.unpack_header(mm)
    problem = _header_problem(meta, h, owner, size)
    if problem is not None or h.magic != L.MAGIC:  # all zeros: being created
        if problem is not None:
            log.warning("skipping %s: %s", segment_path(meta), problem)
        return None
    clients = _live_clients(mm, L.Layout.from_header(h))
    spill = pid_alive(h.spill_pid)
    return {"name": h.name, "node": h.node, "uid": owner, "persistent": bool(h.flags & L.FLAG_PERSIST),
            "capacity": int(h.capacity), "clients": clients, "spill_pid": int(h.spill_pid),
            "spill_alive": spill, "stale": _stale(h, clients, spill), "segment": meta,
            "spill_dir": L.spill_dir(mm)}


def _live_clients(mm: Any, lay: L.Layout) -> int:
    t = L.client_table(mm, lay)
    return sum(1 for pid, start, state in zip(t["pid"], t["start"], t["state"])
               if state == 1 and pid_alive(int(pid), int(start)))


def _stale(h: Any, clients: int, spill: bool) -> bool:
    """Nobody alive uses the store of header ``h``: no client, no spill process, no creator still at work."""
    creating = h.state == L.STATE_INIT and pid_alive(h.creator_pid)
    return not clients and not spill and not creating and not h.flags & L.FLAG_PERSIST


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive: unmapped with it


def collect_stale(uid: int | None = None, all_users: bool = False, name: str | None = None) -> list[str]:
    """Remove the stores on this host that nobody uses any more: this user's, another ``uid``'s, or
    (``all_users``) everyone's (root, in a Slurm epilog); only those named ``name`` if given.

    A store is stale when none of its clients and not its spill process is
    alive (say every process of a job was SIGKILLed, the spill process too,
    as a batch system's cleanup does). Persistent stores are kept, and so is
    any store a live process attached to meanwhile (decided again under its
    ADMIN lock). Meant for a job epilog: ``shmstore gc`` (``--uid`` or
    ``--all-users`` as root).

    Returns:
        The ``name@node`` of every store removed.

    Raises:
        PermissionDeniedError: another user's stores asked for without being root.
    """
    me = _may_collect(uid, all_users, "stores")
    removed = []
    for st in list_stores(uid, all_users):
        if st["stale"] and name in (None, st["name"]) and _remove_if_stale(st):
            removed.append(f"{st['name']}@{st['node']}" + (f" (uid {st['uid']})" if st["uid"] != me else ""))
    return removed


def _may_collect(uid: int | None, all_users: bool, what: str) -> int:
    """This process's uid, where it may remove the ``what`` asked for (another user's only as root).

    Raises:
        PermissionDeniedError: another user's asked for without being root.
    """
    me = os.getuid()
    if (all_users or (uid is not None and uid != me)) and me != 0:
        raise PermissionDeniedError(f"only root can remove other users' {what} (shmstore gc --all-users / --uid "
                                    f"in a Slurm epilog, which runs as root)")
    return me


def _remove_if_stale(st: dict[str, Any]) -> bool:
    """Remove the store listed as ``st`` if it is still stale under its ADMIN lock; True if removed."""
    uid = st["uid"]
    prefix = store_prefix(st["name"], st["node"], uid)
    try:
        seg = Segment.attach(prefix + "-meta", owner=uid)
    except FileNotFoundError:
        return False  # removed meanwhile (its janitor, another gc)
    except (OSError, ShmStoreError) as exc:
        log.warning("leaving store %r on node %r of uid %d: %s", st["name"], st["node"], uid, exc)
        return False
    try:
        h = _claim(seg, st)
        if h is None:
            return False
    except ShmStoreError as exc:  # its ADMIN lock stayed taken: somebody alive holds it
        log.warning("leaving store %r on node %r of uid %d: %s", st["name"], st["node"], uid, exc)
        return False
    finally:
        seg.close()
    _remove_names(prefix, uid, st["spill_dir"], incarnation(h.creator_pid, h.created))
    return True


def _claim(seg: Segment, st: dict[str, Any]) -> Any:
    """Mark the store ``destroying`` if it is still stale, under its ADMIN lock; its header then, None if it is
    not stale."""
    mm = seg.mapping()
    h = L.unpack_header(mm)
    if _header_problem(seg.name, h, st["uid"], seg.size) is not None or h.magic != L.MAGIC:
        return None
    lay = L.Layout.from_header(h)
    with ShmLock(seg.address + lay.lock_offset(L.LOCK_ADMIN), "admin", _LOCK_TIMEOUT):
        h = L.unpack_header(mm)
        if not _stale(h, _live_clients(mm, lay), pid_alive(h.spill_pid)):
            return None
        L.HEAD.set(mm, "state", L.STATE_DESTROYING)
    return h


def _remove_names(prefix: str, uid: int, spill_root: str, tag: str) -> None:
    """Remove a claimed store's names, each only if ``uid`` owns it; the metadata segment last (a process
    killed in between leaves a store that the next ``gc`` finds)."""
    unlink_segment(prefix + "-arena", owner=uid)
    unlink_semaphore(prefix + "-wake", owner=uid)
    _remove_spill_files(spill_root, prefix.lstrip("/"), tag, uid)
    # its checkpoints' flush plans (persist/plans.py: the parts were in its memory, never to be flushed now)
    _remove_own_files(spill_root, plan_dir(prefix.lstrip("/")), uid, is_plan_file)
    unlink_segment(prefix + "-meta", owner=uid)


def _remove_spill_files(root: str, folder: str, tag: str, uid: int) -> int:
    """Remove the files of the store incarnation ``tag`` in the spill directory ``<root>/<folder>`` of ``uid``,
    then the directory if nothing else is in it and no process has it open; returns how many files went.

    What :meth:`~shmstore.levels.spillfiles.SpillFiles.remove_all` does for the store's own processes, for a
    store of maybe another user: the directory is never made, no link is followed, only regular files of
    ``uid`` named for ``tag`` go, and nobody is waited for. A process that has the directory open belongs to
    another incarnation of the name (the stale store has no live process): a store whose names were unlinked
    behind its back, its clients still at work, whose files share the directory. Removing every file of the
    user there took that store's objects on DISK with the stale one's.
    """
    return _remove_own_files(root, folder, uid, lambda entry: entry.startswith(tag + "."))


def _remove_own_files(root: str, folder: str, uid: int, wanted: Callable[[str], bool]) -> int:
    """Remove the regular files of ``uid`` in ``<root>/<folder>`` whose names are ``wanted``, never following
    a link, then the directory if nothing else is in it and no process has it open; returns how many went."""
    path = os.path.join(root, folder)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | SAFE_OPEN)
    except OSError:
        return 0  # none, or something planted under its name: nothing of the store's
    try:
        if os.fstat(fd).st_uid != uid:
            return 0
        removed = sum(_unlink_own(fd, entry, uid) for entry in os.listdir(fd) if wanted(entry))
        remove_dir(fd, path, 0.0)
        return removed
    finally:
        os.close(fd)


def _unlink_own(dir_fd: int, entry: str, uid: int) -> bool:
    """Remove ``entry`` of the directory ``dir_fd`` if it is a regular file of ``uid``; True if removed."""
    try:
        st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return False
        os.unlink(entry, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def collect_mpi_orphans(uid: int | None = None, all_users: bool = False, min_age: float = 5.0,
                        only: set[str] | None = None) -> list[str]:
    """Remove the MPI libraries' shared memory segments in /dev/shm (``MPI_SEGMENT_PREFIXES``) that no live
    process maps or holds open: what an aborted or killed job leaves (MPICH 2 MiB and more per node and run,
    Open MPI 16 MiB per singleton). This user's, another ``uid``'s or (``all_users``, root) everyone's; only
    regular files at least ``min_age`` seconds old (a job starting now maps its own at once): unused ones
    younger than that are looked at again once they are that old, where that is at most 10 s away (a Slurm
    epilog runs at once after an aborted job, whose segments are seconds old); ``only``: just these names
    (tests). Returns the names removed.

    Raises:
        PermissionDeniedError: another user's asked for without being root.
    """
    me = _may_collect(uid, all_users, "MPI segments")
    want = me if uid is None else uid
    removed: list[str] = []
    wait_until = 0.0
    for _ in range(2):
        now = time.time()
        candidates: dict[str, tuple[int, int]] = {}
        young: dict[str, tuple[int, int]] = {}
        try:
            names = os.listdir(SHM_DIR)
        except OSError:
            return removed
        for entry in names:
            if not entry.startswith(MPI_SEGMENT_PREFIXES) or (only is not None and entry not in only):
                continue
            try:
                st = os.lstat(os.path.join(SHM_DIR, entry))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (all_users or st.st_uid == want):
                if now - st.st_mtime >= min_age:
                    candidates[entry] = (st.st_dev, st.st_ino)
                elif st.st_mtime + min_age - now <= _YOUNG_WAIT_MAX:  # of age soon: looked at again then
                    young[entry] = (st.st_dev, st.st_ino)
                    wait_until = max(wait_until, st.st_mtime + min_age)
        used = _in_use(candidates | young)
        for entry, ident in sorted(candidates.items()):
            if entry in used:
                continue
            path = os.path.join(SHM_DIR, entry)
            try:
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) == ident:  # the same file still (not one made again meanwhile)
                    os.unlink(path)
                    removed.append(entry)
            except OSError:
                continue
        if not [e for e in young if e not in used]:
            break
        time.sleep(max(0.0, wait_until - time.time()) + 0.05)
    return removed


_YOUNG_WAIT_MAX = 10.0  # collect_mpi_orphans waits this long at most for unused segments to come of age


def _in_use(candidates: dict[str, tuple[int, int]]) -> set[str]:
    """The candidates some live process maps (/proc/<pid>/maps) or holds open (/proc/<pid>/fd)."""
    used: set[str] = set()
    if not candidates:
        return used
    idents = {v: k for k, v in candidates.items()}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        name = line.split("/dev/shm/", 1)[1].split()[0]
                        if name in candidates:
                            used.add(name)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                held = idents.get((st.st_dev, st.st_ino))
                if held is not None:
                    used.add(held)
        except OSError:  # gone, or not ours to read (another user's process maps none of this user's)
            continue
    return used
