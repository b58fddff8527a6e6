"""The user API: :func:`connect`, :class:`Store`, :func:`destroy`.

A :class:`Store` is one process's connection to its node's store: a client
slot, a :class:`~shmstore.kernel.Kernel` for its session, and the policy the
kernel leaves out (priority lists of levels, waiting for the spill process).
"""
from __future__ import annotations

import builtins
import mmap
import os
import struct
import time
from typing import Any, Iterable

import numpy as np

from .config import Config
from .errors import PermissionDeniedError, ShmStoreError, StorageFullError, StoreClosedError, StoreInUseError
from .kernel import Kernel, NodeStore
from .kernel import layout as L
from .kernel.check import check as check_node
from .kernel.node import pid_alive, reap_children, store_prefix
from .kernel.segment import list_segments, segment_path, unlink_segment, unlink_semaphore
from .levels import Capacity, Level, ObjectInfo, parse_levels
from .placement import DEFAULT_PUT_LEVELS, DEVICE_PUT_LEVELS, Placement
from .streams import Reader, Writer

__all__ = ["Store", "connect", "destroy", "collect_stale"]

_HOST_TYPES = frozenset((np.ndarray, bytes, bytearray, memoryview, dict, list, tuple, str, int, float))


class Store:
    """A connection to this node's store (see :func:`connect`).

    Owns a client slot, given back by ``close``; never destroys data other
    processes use. Process-safe; thread-safe. Pickling sends the settings
    only: the receiver connects to the same store.
    """

    _kernel: Kernel | None = None
    _node: NodeStore | None = None

    def __init__(self, config: Config, create: bool = True, observe: bool = False) -> None:
        self.config = config
        self._observe = observe
        deadline = time.monotonic() + 10
        while True:
            node = NodeStore.open(config, create)
            try:
                slot = node.register()
                break
            except FileNotFoundError:  # the janitor is removing it: start a fresh one
                node.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        self._node = node
        try:
            self._kernel = Kernel(node, slot, config.session, on_detach=self._on_detach)
            self._placement = Placement(self._kernel, node, config)
            if not observe:
                node.ensure_spill()
                node.prefault.start(config.prefault)
        except BaseException:
            node.deregister(slot)
            node.close()
            raise

    # ---- properties -----------------------------------------------------
    @property
    def kernel(self) -> Kernel:
        """The kernel verbs on this store (never wait; raise at once when full)."""
        return self._checked()

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def node(self) -> str:
        return self.config.node

    @property
    def session(self) -> str:
        return self.config.session

    @property
    def spill_pid(self) -> int:
        """Pid of this node store's spill process (restarted here if it died)."""
        return self._node_checked().ensure_spill()

    def wait_prefaulted(self, nbytes: int, timeout: float = 60.0) -> bool:
        """Wait until the first ``nbytes`` of the arena are faulted in (by the background thread of the
        process that created the store: ``prefault=``); False after ``timeout`` seconds, or where this
        process did not create the store. For benchmarks and jobs that want warm pages before timing."""
        return self._node_checked().prefault.wait(nbytes, timeout)

    @property
    def closed(self) -> bool:
        return self._kernel is None or self._kernel._closed

    def _checked(self) -> Kernel:
        k = self._kernel
        if k is None:
            raise StoreClosedError("store is closed (connect() again)")
        k._check()
        return k

    def _node_checked(self) -> NodeStore:
        """The node store, unless this connection is closed.

        Raises:
            StoreClosedError: it is.
        """
        self._checked()
        node = self._node
        if node is None:
            raise StoreClosedError("store is closed (connect() again)")
        return node

    # ---- objects --------------------------------------------------------
    def put(self, key: str, obj: Any, levels: Iterable[Level] | Level | None = None,
            overwrite: bool = False) -> ObjectInfo:
        """Store ``obj`` under ``key`` on the first level of ``levels`` with room.

        ``levels`` defaults to ``[Level.MEMORY, Level.DISK]`` (``[Level.GPU,
        Level.MEMORY, Level.DISK]`` for a device array; levels this process
        cannot use, GPU without CuPy or a device, are passed over). When MEMORY is
        full of spillable objects, the spill process makes room first (the
        put waits up to ``spill_timeout``); an object larger than the level
        goes to the next one at once. Numpy arrays, alone or inside
        containers, come back from ``get`` as read-only zero-copy views;
        bytes-like values are stored raw.

        ``overwrite=True`` replaces an existing object atomically: a get
        returns the old object until this put returns and the new one
        after, never a miss in between (not even if this process is killed
        half way: then the old one stays); views of the old object stay
        valid until dropped, and its space is freed then.

        Raises:
            ObjectExistsError: ``key`` is present (delete it first, or pass ``overwrite=True``).
            ObjectLockedError: ``key`` is being written by another writer right now (another put of it, or
                a transfer of it into this node); retry, or order the writers.
            StorageFullError: no level of ``levels`` has room.
            SpillError: making room failed (disk full, I/O error).
            SerializationError, InvalidKeyError: bad input; nothing changes.
        """
        p = self._placement_checked()
        if levels is None and type(obj) not in _HOST_TYPES and hasattr(obj, "__cuda_array_interface__"):
            levels = DEVICE_PUT_LEVELS  # a device array stays on the device where there is room
        if levels is not None:
            return p.put(key, obj, parse_levels(levels, DEFAULT_PUT_LEVELS), overwrite)
        try:  # the common case first: room in memory, nothing to wait for
            info = p.kernel.put(key, obj, Level.MEMORY, overwrite)
        except StorageFullError:
            return p.put(key, obj, DEFAULT_PUT_LEVELS, overwrite)
        p.hint(info.stored)
        return info

    def get(self, key: str, conditions: Any = None, levels: Iterable[Level] | Level | None = None) -> Any:
        """The value of ``key``: views into shared memory (or into the spill file) for arrays and bytes.

        ``conditions`` slices an array without materialising it, e.g.
        ``conditions=(slice(0, 100),)``; on DISK only the pages needed are
        read. With ``levels``, an object on none of them is first moved to
        the first one (``levels=[Level.MEMORY]`` brings a spilled object back).

        Raises:
            ObjectNotFoundError: no such object in this session.
            ObjectLockedError: it must move but is pinned.
            InvalidArgumentError: ``conditions`` on a non-array value.
        """
        k = self._kernel
        if k is None:
            raise StoreClosedError("store is closed (connect() again)")
        if levels is not None:
            self._placement_checked().bring(key, parse_levels(levels, DEFAULT_PUT_LEVELS))
        return k.get(key, conditions)

    def move(self, key: str, level: Level, progress: Any = None) -> ObjectInfo:
        """Move ``key`` to ``level`` (explicit spill or restore); waits for the spill process.

        Args:
            progress: called with the spill state while the move runs.

        Raises:
            ObjectNotFoundError, ObjectLockedError (pinned), StorageFullError, SpillError.
        """
        return self._placement_checked().move(key, parse_levels(level, ())[0], progress)

    def _placement_checked(self) -> Placement:
        self._checked()
        return self._placement

    def delete(self, key: str, missing_ok: bool = False) -> None:
        """Remove ``key``: hidden at once, space freed when its last view goes.

        Raises:
            ObjectNotFoundError: no such object (unless ``missing_ok``).
        """
        self._checked().delete(key, missing_ok)

    def __contains__(self, key: object) -> bool:
        return self._checked().contains(key)  # type: ignore[arg-type]

    def get_info(self, key: str) -> ObjectInfo:
        """What the store knows about ``key``.

        Raises:
            ObjectNotFoundError: no such object.
        """
        return self._checked().info(key)

    def list(self, level: Level | None = None) -> builtins.list[ObjectInfo]:
        """Objects of this session, optionally only those on ``level``."""
        return self._checked().list(None if level is None else parse_levels(level, ())[0])

    def keys(self) -> builtins.list[str]:
        return [i.key for i in self.list()]

    def get_capacity(self) -> dict[Level, Capacity]:
        """Total, used, pinned, free, spillable, spilled and restored bytes per level."""
        return self._placement_checked().capacity()

    def clear(self) -> int:
        """Delete every object of this session; returns how many."""
        k = self._checked()
        infos = k.list()
        for info in infos:
            k.delete(info.key, missing_ok=True)
        return len(infos)

    def pin(self, key: str) -> None:
        """Pin ``key`` (counted) so that spill never moves it."""
        self._checked().pin(key)

    def unpin(self, key: str) -> None:
        """Undo one ``pin``."""
        self._checked().unpin(key)

    def open_writer(self, key: str, size: int, levels: Iterable[Level] | Level | None = None) -> Writer:
        """A writer for a new raw object of exactly ``size`` bytes, sealed on close.

        Placed like ``put``: the first level of ``levels`` with room.
        """
        p = self._placement_checked()
        order = parse_levels(levels, DEFAULT_PUT_LEVELS)
        writer: Writer = p.place(key, order, lambda level: Writer(self._checked(), key, size, level))
        return writer

    def open_reader(self, key: str) -> Reader:
        """A reader streaming the stored bytes of ``key`` (pinned while open)."""
        return Reader(self._checked(), key)

    def check(self) -> builtins.list[str]:
        """Check every invariant of this node store's metadata, spill files and counters.

        Holds every lock of the store meanwhile (tens of milliseconds for a
        large table). Meant for tests, debugging and ``shmstore check``.

        Returns:
            The problems found, as sentences; empty when the store is consistent.

        Raises:
            LockTimeoutError: a lock stayed taken for ``lock_timeout``.
        """
        return check_node(self._node_checked())

    def status(self) -> dict[str, Any]:
        """A snapshot of the whole node store: capacity per level, clients, spill process."""
        node = self._node_checked()
        spill = node.spill_pid()
        return {
            "name": self.config.name, "node": self.config.node, "segments": node.prefix + "-*",
            "persistent": bool(L.header_flags(node.buf) & L.FLAG_PERSIST),
            "objects": node.nobjects(),
            "levels": {lv.name.lower(): c._asdict() for lv, c in self._placement.capacity().items()},
            "spill_dir": node.disk.path,
            "moving": _moving(node),
            "clients": [{"pid": pid, "alive": pid_alive(pid, start), "slot": slot}
                        for slot, pid, start in node.clients()],
            "spill": {"pid": spill, "alive": pid_alive(spill),
                      "heartbeat": L.unpack_spill_state(node.buf).heartbeat},  # time.time() of its last round
        }

    # ---- lifecycle ------------------------------------------------------
    def close(self) -> None:
        """Detach this process; idempotent. Never destroys data others use.

        If views returned by ``get`` are still alive, the mapping stays until
        they are garbage collected.
        """
        if self._kernel is not None:
            self._kernel.close()  # detaching runs _on_detach, now or when the last view dies

    def _on_detach(self, remaining: int) -> None:
        node, self._node = self._node, None
        if node is not None:
            if remaining == 0 and not self._observe:
                if node.spill_alive():
                    node.wake.post()  # the janitor removes the store now rather than at its next round
                else:
                    node.remove_if_unused()  # no janitor left to do it: the last client does
            node.close()
        reap_children()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, ShmStoreError):  # a finalizer never raises; the janitor reclaims the slot
            pass

    def __reduce__(self) -> tuple[Any, tuple[Config]]:
        return (_reconnect, (self.config,))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        c = self.config
        return f"<shmstore.Store {c.name!r} node={c.node!r} session={c.session!r} {state}>"


def _moving(node: NodeStore) -> dict[str, Any] | None:
    s = L.unpack_spill_state(node.buf)
    if not s.moving:
        return None
    return {"entry": s.moving - 1, "to": Level(s.moving_to).name.lower(), "done": s.progress, "total": s.total}


def _reconnect(config: Config) -> Store:
    return Store(config)


def connect(name: str | None = None, *, create: bool = True, **kwargs: Any) -> Store:
    """Connect to this node's store, creating it on first use.

    Args:
        name: the store's name (``SHMSTORE_NAME``; default ``job-$SLURM_JOB_ID``
            under Slurm, else ``"default"``).
        **kwargs: ``capacity``, ``spill_dir``, ``session``, ``node``,
            ``persist``, ``high_watermark``, ``low_watermark``,
            ``lock_timeout``, ``max_objects``, ``max_clients``, ``prefault``.
        create: False to attach only: a consumer that must find data a producer
            left raises StoreNotFoundError (also a FileNotFoundError) instead of
            silently creating an empty store.

    Raises:
        TypeError: an unknown setting. ConfigError: a bad value.
        StorageFullError: /dev/shm cannot hold the capacity asked for.
        LayoutError, PermissionError: the segments are not ours to use.
    """
    return Store(Config.from_kwargs(name=name, **kwargs), create)


def observe(name: str | None = None, **kwargs: Any) -> Store:
    """Attach to an existing store only to look at it (the CLI's status, ls, info, check): starts no spill
    process and removes nothing when it closes, even where the store's job is gone, so a look changes
    nothing. ``kwargs``: ``node``, ``session``.

    Raises:
        StoreNotFoundError: no such store on this node.
    """
    return Store(Config.from_kwargs(name=name, prefault=0, **kwargs), create=False, observe=True)


def destroy(name: str | None = None, force: bool = False, node: str | None = None) -> bool:
    """Remove a store's segments and spill files.

    Refuses while live clients are attached, unless ``force``.

    Returns:
        True if anything was removed.

    Raises:
        StoreInUseError: live clients are attached and ``force`` is False.
    """
    cfg = Config.from_kwargs(name=name, node=node)
    prefix = store_prefix(cfg.name, cfg.node)
    try:
        ns = NodeStore.open(cfg, create=False)
    except (FileNotFoundError, ShmStoreError, PermissionError, BlockingIOError):
        leftovers = [unlink_segment(n) for n in list_segments(prefix + "-")]
        return any(leftovers + [unlink_semaphore(prefix + "-wake")])
    try:
        with ns.admin:
            live = [pid for _, pid, start in ns.clients() if pid_alive(pid, start)]
            if live and not force:
                raise StoreInUseError(f"store {cfg.name!r} has {len(live)} attached client(s) (pids "
                                      f"{', '.join(map(str, live[:8]))}); close them or pass force=True")
            L.set_header_state(ns.buf, L.STATE_DESTROYING)
        ns.unlink()
    finally:
        ns.close()
    return True


def list_stores(uid: int | None = None, all_users: bool = False) -> list[dict[str, Any]]:
    """The stores on this host: this user's, another ``uid``'s, or (``all_users``) everyone's.

    Each as a dict: ``name``, ``node``, ``uid``, ``persistent``, ``capacity``,
    ``clients`` (attached and alive), ``spill_pid``, ``spill_alive``,
    ``stale`` (nobody alive uses it: ``shmstore gc`` would remove it),
    ``segment``. Reads the stores' headers only; changes nothing.
    """
    out = []
    prefix = "/shmstore-" if all_users else f"/shmstore-{os.getuid() if uid is None else uid}-"
    for meta in list_segments(prefix):
        if not meta.endswith("-meta"):
            continue
        try:
            fd = os.open(segment_path(meta), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            owner = st.st_uid
            if not meta.startswith(f"/shmstore-{owner}-") or st.st_size < L.HEADER_SIZE:
                continue  # named for another user than its owner, or being created
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)  # a look: read-only, any owner
        except (OSError, ValueError):
            os.close(fd)
            continue
        try:
            h = L.unpack_header(mm)
            if h.magic != L.MAGIC:
                continue
            lay = L.Layout.from_header(h)
            if lay.size > st.st_size:
                continue
            clients = L.client_table(mm, lay)
            alive = sum(1 for p, st, state in zip(clients["pid"], clients["start"], clients["state"])
                        if state == 1 and pid_alive(int(p), int(st)))
            spill = pid_alive(h.spill_pid)
            out.append({"name": h.name, "node": h.node, "uid": owner, "persistent": bool(h.flags & L.FLAG_PERSIST),
                        "capacity": int(h.capacity), "clients": alive, "spill_pid": int(h.spill_pid),
                        "spill_alive": spill, "stale": not alive and not spill and not h.flags & L.FLAG_PERSIST,
                        "segment": meta, "spill_dir": L.spill_dir(mm)})
            del clients
        except (ValueError, TypeError, struct.error):
            continue  # not a store of this layout
        finally:
            _close_quietly(mm)
            os.close(fd)
    return out


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive: unmapped with it


def collect_stale(uid: int | None = None, all_users: bool = False) -> list[str]:
    """Remove the stores on this host that nobody uses any more: this user's, another ``uid``'s, or
    (``all_users``) everyone's (root, in a Slurm epilog).

    A store is stale when none of its clients and not its spill process is
    alive (say every process of a job was SIGKILLed, the spill process too,
    as a batch system's cleanup does). Persistent stores are kept. Meant for
    a job epilog: ``shmstore gc`` (``--all-users`` as root).

    Returns:
        The ``name@node`` of every store removed.

    Raises:
        PermissionDeniedError: another user's stores asked for without being root.
    """
    me = os.getuid()
    if (all_users or (uid is not None and uid != me)) and me != 0:
        raise PermissionDeniedError("only root can remove other users' stores (shmstore gc --all-users / --uid "
                                    "in a Slurm epilog, which runs as root)")
    removed = []
    for st in list_stores(uid, all_users):
        if not st["stale"]:
            continue
        if st["uid"] == me:
            destroy(st["name"], force=True, node=st["node"])
        else:
            _remove_foreign(st)
        removed.append(f"{st['name']}@{st['node']}" + (f" (uid {st['uid']})" if st["uid"] != me else ""))
    return removed


def _segment_uid(name: str) -> int | None:
    try:
        return os.stat(segment_path(name)).st_uid
    except OSError:
        return None


def _remove_foreign(st: dict[str, Any]) -> None:
    """Remove another user's stale store as root: its segments, semaphore and spill files. Touches only
    what that user owns, under names made from the store's own prefix (never following a link)."""
    uid = st["uid"]
    prefix = store_prefix(st["name"], st["node"], uid)
    for seg in list_segments(prefix + "-"):
        if _segment_uid(seg) == uid:
            unlink_segment(seg)
    sem = segment_path(prefix + "-wake", semaphore=True)
    try:
        if os.lstat(sem).st_uid == uid:
            os.unlink(sem)
    except OSError:
        pass
    folder = os.path.join(st["spill_dir"], prefix.lstrip("/"))
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        if os.fstat(fd).st_uid != uid:
            return
        for entry in os.listdir(fd):
            try:
                if os.stat(entry, dir_fd=fd, follow_symlinks=False).st_uid == uid:
                    os.unlink(entry, dir_fd=fd)
            except OSError:
                pass
    finally:
        os.close(fd)
    try:
        os.rmdir(folder)
    except OSError:
        pass
