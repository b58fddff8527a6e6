"""One process's attachment to a node store: segments, locks, clients.

A node store is two POSIX shm segments named after the user, the store and
the node (``/shmstore-<uid>-<name>-<node>-meta`` and ``...-arena``) plus a
spill process. :meth:`NodeStore.open` creates them all-or-nothing on first
use, or attaches; creation races are settled by ``O_EXCL`` on the metadata
segment, and attachers wait for the creator to publish ``state = ready``.

The creator takes the first client slot before it publishes the store. The
race it closes, step by step: the creator publishes ``ready``; another
process attaches, registers, puts, gets and closes while the creator is
still building its own view of the store; that process, the only client
registered, removes the store as its last client (the spill process is not
even started); the creator finds its wake-up semaphore gone
(``FileNotFoundError`` out of ``connect()``), or registers into a store
being destroyed. A store is never without a client between its creation
and its creator's ``close``.

The lifecycle race with the janitor, step by step: the spill process takes
the ADMIN lock, sees no client, sets ``state = destroying``, releases the
lock and unlinks the names. A client that mapped the segment before the
unlink takes the ADMIN lock to register, sees ``destroying``, detaches and
starts over (creating a fresh store). Registration and the destroy decision
both happen under the ADMIN lock, so exactly one of them wins.
"""
from __future__ import annotations

import mmap
import os
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..config import SHM_DIR, Config
from ..errors import LayoutError, PermissionDeniedError, ShmStoreError, StorageFullError, StoreNotFoundError
from ..meta import layout as L
from ..meta.alloc import Allocator
from ..meta.lock import ShmLock, init_lock
from ..meta.table import Table
from ..primitives.files import free_bytes
from ..primitives.procs import pid_alive, proc_start_time, reap_children
from ..primitives.segment import Segment, Wakeup, unlink_segment, unlink_semaphore
from ..units import format_size
from ..values import Level
from .prefault import Prefaulter
from .repair import rebuild_allocator, repair_stripe

if TYPE_CHECKING:
    from .protocols import DeviceLevel, Levels, MovableLevel
    from .supplies import ClientSupply

__all__ = ["NodeStore", "store_prefix", "proc_start_time", "pid_alive", "reap_children"]

NSTRIPES = 64
_ATTACH_TIMEOUT = 10.0
# the spill process does no linear algebra: numpy's BLAS need not start a thread per core at its import
# (which took as much CPU again as the import itself, beside the application's first steps)


def store_prefix(name: str, node: str, uid: int | None = None) -> str:
    """Common prefix of a store's segment names."""
    return f"/shmstore-{os.getuid() if uid is None else uid}-{name}-{node}"


class NodeStore:
    """The segments, locks and tables of one node store, mapped in this process.

    Owns its mappings; ``close`` unmaps them. Only the janitor (spill
    process), the last client, or :func:`shmstore.destroy` unlink the names.
    Process-safe through its locks; thread-safe.

    Knows no level: the metadata is the same for all of them. The process
    that uses the store's levels (a ``Store``, the spill process) opens them
    on it (``levels/registry.py``: each level is built from this store as
    its :class:`~shmstore.node.protocols.LevelHost`) and hands them in with
    :meth:`use_levels`; from then on this store frees an entry's space on its
    level and closes the levels with itself. A store without levels (a bare
    one: ``destroy``, tests) reads and repairs the metadata; freeing an
    entry that is on a level needs that level.
    """

    meta: Segment
    arena: Segment
    prefault: Prefaulter
    # the client slot the creator took before publishing the store, until register() hands it out
    _held_slot = -1

    def __init__(self, cfg: Config, meta: Segment, arena: Segment, created: bool) -> None:
        self.cfg = cfg
        self.meta, self.arena = meta, arena
        self.buf: mmap.mmap = meta.mapping()  # the metadata, as every function of layout.py takes it
        self.arena_mm: mmap.mmap = arena.mapping()
        self.created = created
        self.prefix = store_prefix(cfg.name, cfg.node)
        self.header = L.unpack_header(self.buf)
        self.layout = L.Layout.from_header(self.header)
        self.capacity = self.header.capacity
        self.alloc = Allocator(self.buf, self.layout, self.capacity)
        self.table = Table(self.buf, self.layout, self.alloc)
        base, timeout = meta.address, cfg.lock_timeout

        def lock(i: int, name: str, rec: Callable[[], None] | None = None) -> ShmLock:
            return ShmLock(base + self.layout.lock_offset(i), name, timeout, rec)
        self.admin = lock(L.LOCK_ADMIN, "admin")
        self.alloc_lock = lock(L.LOCK_ALLOC, "alloc", lambda: rebuild_allocator(self))
        # a stripe whose holder died may hold a live entry out of its chain and wrong counters
        self.stripes = [lock(self.layout.stripe_lock(s), f"stripe {s}", self._stripe_repair(s))
                        for s in range(self.layout.nstripes)]
        # small objects are carved from per-client chunks (see supplies.py)
        self.chunk_size = min(4 << 20, max(L.MIN_CHUNK, self.capacity // 64)) & ~(L.PAGE - 1)
        self.small_max = self.chunk_size // 16
        arena.advise_hugepages()
        self.arena_ro = memoryview(arena.readonly_mapping())  # views: PROT_READ (see Segment.readonly_mapping)
        self.levels: dict[Level, MovableLevel] = {}  # handed in by use_levels
        self.devices: dict[Level, DeviceLevel] = {}
        self._held_slot = 0 if created else -1  # the creator's, taken before it published the store (_create)
        try:
            self.wake = Wakeup(self.prefix + "-wake", create=False)  # the creator made it (see _create)
            self.prefault = Prefaulter(meta, arena, self.capacity, self.layout)
        # gone (a store being removed): let go of what this built (the caller of its segments)
        except BaseException:
            self.close()
            raise

    # ---- open / create / attach -------------------------------------------
    @classmethod
    def open(cls, cfg: Config, create: bool = True) -> NodeStore:
        """Attach to the store named by ``cfg``, creating it if needed.

        Raises:
            StoreNotFoundError: it does not exist and ``create`` is False.
            LayoutError, PermissionError: a segment that is not ours to use.
            StorageFullError: /dev/shm cannot hold ``capacity``.
        """
        deadline = time.monotonic() + _ATTACH_TIMEOUT
        prefix = store_prefix(cfg.name, cfg.node)
        why: OSError | None = None
        while True:
            try:
                return cls._attach(cfg, prefix, deadline)
            except FileNotFoundError as exc:  # none, or a name of it gone: the store is going away
                why = exc
                if not create:
                    raise StoreNotFoundError(
                        f"no store {cfg.name!r} on node {cfg.node!r}: never created here, or removed when its last "
                        f"client closed it (a store lives while a client is attached; to let data outlive the "
                        f"process that put it, create the store with persist=True / SHMSTORE_PERSIST=1 and remove "
                        f"it with shmstore.destroy(); or connect with create=True)") from exc
            except BlockingIOError:  # being created right now
                if time.monotonic() > deadline:  # its creator died before sizing it
                    unlink_segment(prefix + "-meta")
                time.sleep(0.002)
                continue
            try:
                return cls._create(cfg, prefix)
            except FileExistsError:
                # lost the creation race, or the store is being removed: attach to what is there
                pass
            except FileNotFoundError as exc:  # removed under its creator (a destroy --force): make it again
                why = exc
            if time.monotonic() > deadline:
                raise LayoutError(f"store {cfg.name!r} on node {cfg.node!r} neither attachable nor creatable for "
                                  f"{_ATTACH_TIMEOUT:g} s (last: {why}; segments {prefix}-*: if no process uses "
                                  f"them, remove them with `shmstore destroy {cfg.name}`)") from why
            time.sleep(0.005)

    @classmethod
    def _create(cls, cfg: Config, prefix: str) -> NodeStore:
        capacity = L.page_align(cfg.capacity)
        lay = L.Layout(cfg.max_objects, cfg.max_clients, NSTRIPES, capacity)
        _check_room(capacity + lay.size)
        meta = Segment.create(prefix + "-meta", lay.size)
        arena, wake_made = None, False
        try:
            buf = meta.mm
            for i in range(lay.nlocks):
                init_lock(meta.address + lay.lock_offset(i))
            L.pack_header(buf, L.Header(L.MAGIC, L.LAYOUT_VERSION, L.STATE_INIT,
                                        L.FLAG_PERSIST if cfg.persist else 0, os.getuid(), os.getpid(), 0,
                                        capacity, lay.size, lay.max_objects, lay.max_clients, lay.nstripes,
                                        lay.nbuckets, time.time(), cfg.name, cfg.node))
            L.pack_session(buf, lay.session(0), "")
            L.set_spill_dir(buf, os.path.abspath(cfg.spill_dir))
            disk = cfg.disk_capacity if cfg.disk_capacity is not None else free_bytes(cfg.spill_dir)
            L.pack_spill_state(buf, L.SpillState(cfg.high_watermark, cfg.low_watermark, disk, 0, 0, 0, 0, 0, 0, 0, 0.0,
                                                 cfg.gpu_capacity or 0))
            Wakeup(prefix + "-wake", create=True).close()
            wake_made = True
            Allocator(buf, lay, capacity).init()
            try:
                arena = Segment.create(prefix + "-arena", capacity)
            except FileExistsError:  # stale arena of a store whose metadata is gone
                unlink_segment(prefix + "-arena")
                arena = Segment.create(prefix + "-arena", capacity)
            # the creator is a client before anyone can attach (see the module notes)
            _occupy(meta.mapping(), lay, 0)
            L.HEAD.set(buf, "state", L.STATE_READY)
            return cls(cfg, meta, arena, created=True)
        except BaseException:
            _undo_create(prefix, meta, arena, wake_made)
            raise

    @classmethod
    def _attach(cls, cfg: Config, prefix: str, deadline: float) -> NodeStore:
        meta = Segment.attach(prefix + "-meta")  # FileNotFoundError goes to open()
        arena = None
        try:
            h = _wait_ready(meta, prefix, deadline)
            if meta.size < L.Layout.from_header(h).size:
                raise LayoutError(f"segment {meta.name!r} is {format_size(meta.size)}, shorter than its header says")
            try:
                arena = Segment.attach(prefix + "-arena")
            except FileNotFoundError:
                if L.HEAD.get(meta.mm, "state") == L.STATE_DESTROYING or meta.named() is False:
                    # its last client (or spill process) is removing it right now: open() tries again
                    raise
                raise LayoutError(f"store {cfg.name!r} has metadata but no arena segment "
                                  f"(remove it with `shmstore destroy {cfg.name}`)") from None
            return cls(cfg, meta, arena, created=False)
        except BaseException:  # every descriptor of this attempt goes (open() may try many times)
            if arena is not None:
                arena.close()
            meta.close()
            raise

    def use_levels(self, opened: Levels) -> None:
        """Take the levels opened on this store in this process (``open_levels(self, ...)``); they are
        this store's from now on, closed by :meth:`close`."""
        self.levels, self.devices = opened.levels, opened.devices

    # ---- clients -----------------------------------------------------------
    def register(self) -> int:
        """Take a client slot for this process; returns the slot.

        Raises:
            FileNotFoundError: the store is being destroyed (open it again).
            StorageFullError: every client slot is taken (``max_clients``).
        """
        with self.admin:
            if L.HEAD.get(self.buf, "state") != L.STATE_READY:
                raise FileNotFoundError(f"store {self.cfg.name!r} is being destroyed")
            if self._held_slot >= 0:  # the creator's, taken in _create
                slot, self._held_slot = self._held_slot, -1
                return slot
            clients = L.client_table(self.buf, self.layout)
            free = [int(s) for s in (clients["state"] == 0).nonzero()[0]]
            if not free:
                raise StorageFullError(
                    f"store {self.cfg.name!r} has all {self.layout.max_clients} client slots taken "
                    f"(raise max_clients= / SHMSTORE_MAX_CLIENTS when creating the store)")
            slot = free[0]
            _occupy(self.buf, self.layout, slot)
            return slot

    def deregister(self, slot: int) -> int:
        """Give slot ``slot`` back; returns how many clients remain."""
        with self.admin:
            self.table.clear_pins(slot)
            L.pack_client(self.buf, self.layout.client(slot), 0, 0, 0, 0.0)
            L.pack_request(self.buf, self.layout.client(slot), L.Request(0, 0, 0, 0, 0, 0, 0, 0, 0, ""))
            return int((L.client_table(self.buf, self.layout)["state"] == 1).sum())

    def clients(self) -> list[tuple[int, int, int]]:
        """(slot, pid, start time) of every registered client."""
        t = L.client_table(self.buf, self.layout)
        return [(int(s), int(t["pid"][s]), int(t["start"][s])) for s in (t["state"] == 1).nonzero()[0]]

    # ---- entries shared by every client (caller holds the entry's stripe lock) ---
    def device_allocators(self) -> list[Allocator]:
        """The allocators of every device arena made so far (the GPU_ARENA records): ready ones, and lost ones
        (kept for remaking): every extent record that is not the MEMORY arena's belongs to one of them."""
        out = []
        for d in range(L.MAX_GPUS):
            g = L.unpack_gpu(self.buf, self.layout, d)
            if g.state in (L.GPU_READY, L.GPU_LOST):
                out.append(Allocator(self.buf, self.layout, g.capacity, gpu=d))
        return out

    def stripe_of(self, idx: int) -> ShmLock:
        """The lock guarding entry ``idx`` (valid while the entry is pinned or locked)."""
        return self.stripes[self.table.stripe_of(idx)]

    def release(self, idx: int, blocking: bool = True, supply: ClientSupply | None = None) -> bool:
        """Free entry ``idx`` and its space (already unlinked from its chain; stripe lock held).

        An object carved from a chunk goes back to ``supply`` (a client's
        ClientSupply) without the ALLOC lock. With ``blocking=False``
        (finalizers) it gives up instead of waiting for the ALLOC lock, and
        returns False. A spilled object's file goes first: a process killed
        in between leaves an entry without a file (freed again by whoever
        repairs it), never a file without an entry.
        """
        eoff = self.layout.entry(idx)
        e = L.entry(self.buf, eoff)
        if supply is not None and e.flags & L.FLAG_IN_CHUNK:
            supply.entries.append((idx, self.table.keep_entry(idx, supply.slot)))
            return True
        # a reserved entry is on no level yet (an extent it names is freed by the table)
        level = self.levels[Level(e.level)] if e.state not in (L.FREE, L.RESERVED) else None
        if level is not None:
            level.drop(idx, e)
        if blocking:
            with self.alloc_lock:  # repairs what an asynchronous exception left half done (see lock.py)
                self._free_locked(idx, e, level)
            return True
        lock = self.alloc_lock
        if not lock.acquire(blocking=False):
            return False
        # as the context manager does, in this frame: nothing can come between the acquire and the try
        try:
            self._free_locked(idx, e, level)
        except BaseException as exc:
            lock.abandon(exc)
            raise
        finally:
            lock.release()
        return True

    def _free_locked(self, idx: int, e: L.Entry, level: MovableLevel | None) -> None:
        if level is not None:
            level.free_locked(idx, e)
        self.table.release_entry(idx, free_extent=level is None)

    def free_if_unpinned(self, idx: int, gen: int | None = None, blocking: bool = True,
                         supply: ClientSupply | None = None) -> bool | None:
        """Free ``idx`` if it is deleted (of generation ``gen``) and nobody pins it.

        Returns True if freed, False if there was nothing to free, None if
        ``blocking`` is False and the ALLOC lock was busy (try again later).
        """
        eoff = self.layout.entry(idx)
        buf = self.buf
        e = L.entry(buf, eoff)
        if e.state != L.DELETED or (gen is not None and e.gen != gen):
            return False
        if L.ENTRY_HEAD.get(self.buf, eoff, "flags") & L.FLAG_MOVING:
            return False  # the mover frees it when it finishes
        if self.table.pin_count(idx):
            return False
        return True if self.release(idx, blocking, supply) else None

    # ---- the spill process's traces in the metadata (its supervision: spill/supervisor.py) ---------
    def spill_pid(self) -> int:
        """The pid the header names as the store's spill process (0: none started yet)."""
        pid: int = L.HEAD.get(self.buf, "spill_pid")
        return pid

    @property
    def spill_path(self) -> str:
        """The store's spill directory: named after the store, in its spill folder (``spill_dir``); the DISK
        level keeps its files there (each carrying the store's incarnation: a name can outlive its store)."""
        return os.path.join(L.spill_dir(self.buf), self.prefix.lstrip("/"))

    def remove_level_files(self) -> int:
        """Remove what the levels keep outside shared memory (spill files) for this store; returns how many."""
        return sum(level.remove_files() for level in self.levels.values())

    def remove_if_unused(self, keep: Callable[[], bool] | None = None) -> int | None:
        """Remove the store if it is not persistent and no client is attached. ``keep``: asked once no client
        is left, under the admin lock (no client registers meanwhile): True keeps the store (the spill
        process's checkpoint plans that a client wrote before it left, which its flusher has not taken yet).

        Returns:
            How many spill files went with it, or None if the store stays.
        """
        if L.HEAD.get(self.buf, "flags") & L.FLAG_PERSIST:
            return None
        with self.admin:
            if self.clients() or L.HEAD.get(self.buf, "state") != L.STATE_READY:
                return None
            if keep is not None and keep():
                return None
            L.HEAD.set(self.buf, "state", L.STATE_DESTROYING)
        return self.unlink()

    # ---- usage ----------------------------------------------------------------
    def used(self, level: int) -> int:
        """Bytes of the objects on ``level`` (sum of the stripes' counters)."""
        return int(L.stats_table(self.buf, self.layout)["used"][:, level].sum())

    def nobjects(self) -> int:
        return int(L.stats_table(self.buf, self.layout)["objects"].sum())

    def reclaim_retired_locked(self) -> int:
        """Free retired chunks that no entry points at (ALLOC lock held); returns how many."""
        buf = self.buf
        if not L.ALLOC.get(buf, "retired"):
            return 0
        ext = L.extent_table(buf, self.layout)
        retired = np.flatnonzero(ext["flags"] == L.EXT_RETIRED) + 1
        t = L.entry_table(buf, self.layout)
        live = (t["state"] != L.FREE) & (t["state"] != L.RESERVED) & ((t["flags"] & L.FLAG_IN_CHUNK) != 0)
        unused = np.setdiff1d(retired, t["extent"][live])
        for rec in unused:
            self.alloc.free(int(rec))
        L.ALLOC.set(buf, "retired", len(retired) - len(unused))
        return len(unused)

    def reclaim_retired(self) -> int:
        with self.alloc_lock:
            return self.reclaim_retired_locked()

    # ---- recovery -----------------------------------------------------------
    def _stripe_repair(self, stripe: int) -> Callable[[], None]:
        def repair() -> None:
            repair_stripe(self, stripe)
        return repair

    # ---- teardown ------------------------------------------------------------
    def close(self) -> None:
        """Stop the prefault thread and unmap; idempotent (and safe on a half-built store)."""
        held, self._held_slot = self._held_slot, -1
        # created here, never registered: the store is left without clients, as before its creation
        if held >= 0:
            try:
                self.deregister(held)
            # its ADMIN lock stayed taken: the janitor reclaims the slot once we are gone
            except ShmStoreError:
                pass
        prefault, arena_ro = getattr(self, "prefault", None), getattr(self, "arena_ro", None)
        if prefault is not None:
            prefault.stop()
        for level in getattr(self, "levels", {}).values():
            level.close()
        try:
            if arena_ro is not None:
                arena_ro.release()
        except BufferError:
            pass  # views into it are alive
        for part in (getattr(self, "wake", None), getattr(self, "arena", None), getattr(self, "meta", None)):
            if part is not None:
                part.close()

    def forget_mappings(self) -> None:
        """The device levels let go of their own mappings (views keep theirs): a client closed with views
        alive, whose detach waits for them."""
        for level in self.devices.values():
            level.forget_mappings()

    def unlink(self) -> int:
        """Remove the store's spill files, semaphore and segment names; returns how many files.

        The metadata segment goes last: a process killed in the middle leaves
        it, and with it a store that ``shmstore gc`` or ``destroy`` finds.

        Only what is this store's own: its spill files carry its incarnation
        (``levels/spillfiles.py``; removed by the levels handed in, see
        :meth:`remove_level_files`), and names that were unlinked behind its
        back (an ``rm`` in /dev/shm) may name a newer store of the same name by
        now, which its last client must not take with it.
        """
        files = self.remove_level_files()
        if self.meta.named() is False:
            return files
        self.wake.unlink()
        unlink_segment(self.prefix + "-arena")
        unlink_segment(self.prefix + "-meta")
        return files


def _occupy(buf: mmap.mmap, lay: L.Layout, slot: int) -> None:
    """Make client slot ``slot`` this process's (ADMIN lock held, or the store not published yet)."""
    if slot + 1 > L.ALLOC.get(buf, "slots_high"):  # first: whoever counts pins must look at this row
        L.ALLOC.set(buf, "slots_high", slot + 1)
    L.pack_client(buf, lay.client(slot), os.getpid(), 1, proc_start_time(os.getpid()) or 0, time.time())
    L.pack_request(buf, lay.client(slot), L.Request(0, 0, 0, 0, 0, 0, 0, 0, 0, ""))


def _undo_create(prefix: str, meta: Segment, arena: Segment | None, wake_made: bool) -> None:
    """Remove what a failed ``_create`` made: its names only while they are still its own (a ``destroy
    --force`` may have removed them, and a newer store taken the name); the metadata segment last."""
    ours = meta.named() is not False
    if ours and meta.mm is not None:
        L.HEAD.set(meta.mm, "state", L.STATE_DESTROYING)  # one that attached meanwhile starts over
    if arena is not None:
        arena.close()
        if ours:
            arena.unlink()
    if ours and wake_made:
        unlink_semaphore(prefix + "-wake")
    if ours:
        meta.unlink()
    meta.close()


def _check_room(size: int) -> None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise StorageFullError(
            f"a store of {format_size(size)} does not fit in {SHM_DIR}: {format_size(free)} free of "
            f"{format_size(st.f_blocks * st.f_frsize)} (lower capacity= / SHMSTORE_CAPACITY)",
            requested=size, available=free)


def _wait_ready(meta: Segment, prefix: str, deadline: float) -> L.Header:
    """Validate the header and wait for the creator to finish initialising."""
    while True:
        h = L.unpack_header(meta.mm)
        if h.magic != L.MAGIC:
            if h.magic != b"\0" * 8:
                raise LayoutError(f"segment {meta.name!r} is not a shmstore segment")
            if time.monotonic() > deadline:  # its creator died before writing the header
                unlink_segment(prefix + "-meta")
                raise FileNotFoundError(f"store {prefix} was left half-created")
        elif h.version != L.LAYOUT_VERSION:
            raise LayoutError(f"segment {meta.name!r} has layout version {h.version}, "
                              f"this build reads {L.LAYOUT_VERSION}")
        elif h.uid != os.getuid():
            raise PermissionDeniedError(f"segment {meta.name!r} belongs to uid {h.uid}, not {os.getuid()}")
        elif h.state == L.STATE_READY:
            return h
        elif h.state == L.STATE_DESTROYING:
            raise FileNotFoundError(f"store {prefix} is being destroyed")
        elif not pid_alive(h.creator_pid):  # creator died while initialising: stale
            unlink_segment(prefix + "-arena")
            unlink_segment(prefix + "-meta")
            raise FileNotFoundError(f"store {prefix} was left half-created")
        if time.monotonic() > deadline:
            raise LayoutError(f"segment {meta.name!r} stays uninitialised (creator pid {h.creator_pid})")
        time.sleep(0.002)
