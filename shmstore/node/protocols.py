"""What a storage level is, and what it needs from the store: the protocols between the metadata and the levels.

The object table (entries, chains, pins, per-stripe usage) belongs to the
kernel and is the same for every level; a level owns where an object's
bytes live and how their space is counted. A level is built by the registry
(``shmstore/levels/registry.py``) from a :class:`LevelHost`, the narrow part
of the node store it may use; the verbs (``Kernel``, ``Puts``, the janitor,
``check``, repair, the mover) reach every level through these protocols and
never name one. The protocols live here, below the levels, so that the
kernel can type its seams without importing any level (the levels import
the kernel, never the other way round).

- :class:`StorageLevel`: every level: place, write, view, free, drop, and
  the level's own part of checks, repair and recovery (``check``,
  ``recount_locked``, ``remove_orphans``, ``drop_lost``).
- :class:`MovableLevel`: a level objects can be moved onto (the four
  ``*_move`` methods); every built-in level is one.
- :class:`DeviceLevel`: a level whose objects live in device memory: its
  values are device arrays (``value``, ``export``) and its arenas are made
  by the process that owns them (``make_arena``).

A new level is a new module with a class that satisfies these, plus one
line in ``registry.py``; ``tests/levels/test_conformance.py`` is the conformance suite
every registered level passes, on a bare metadata segment.

Locking contract (see ``meta/alloc.py`` and ``node/repair.py`` for why):

- ``place`` is called with the entry's stripe lock held. A level that
  charges a counter (DISK) calls ``write_entry`` inside the ALLOC-locked
  section that charges it, so the counter always equals what the table
  charges; an arena level (MEMORY) makes the entry name its extent in the
  ALLOC section that allocates it.
- ``free_locked``, ``charge_move_locked`` and ``recount_locked`` are called
  with the ALLOC lock held (the first two with the entry's stripe lock
  too); ``drop`` with the stripe lock only (files go before the entries
  that name them).
- ``write``, ``view``, ``sink`` and ``space_for_move`` take no store lock
  (``space_for_move`` takes the ALLOC lock itself); ``check`` runs with
  every lock held (``check.frozen``); ``remove_orphans`` and ``drop_lost``
  take the locks they need.
"""
from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..meta import layout as L
from ..meta.alloc import Allocator
from ..meta.fastpath import ClientOps
from ..meta.keyref import Contents, KeyRef, Reservation
from ..meta.lock import ShmLock
from ..meta.table import Table
from ..primitives.segment import Segment
from ..values import Level
from .prefault import Prefaulter

if TYPE_CHECKING:
    from .serialize import Encoded
    from .supplies import ClientSupply

__all__ = ["LevelHost", "StorageLevel", "MovableLevel", "DeviceLevel", "Levels", "Sink", "RequestArena", "PutContext"]

RequestArena = Callable[[int], "str | None"]
"""Asks the spill process to make arena slot ``d`` (on the device the slot names): None once made, else why not."""


class LevelHost(Protocol):
    """The part of a node store a level is built from (:class:`~shmstore.node.nodestore.NodeStore` is one).

    Metadata only: the segments, the ALLOC lock with the allocator and the
    counters it guards, the entry table and its stripe locks, the
    prefaulter. Nothing here names a level: a level finds what is its own
    from these (the DISK level its directory from the header's spill folder,
    the store's name and incarnation; the GPU level its arenas' records).
    """

    # the store's names: /shmstore-<uid>-<name>-<node> (+ -meta, -arena, ...) the metadata segment, as every function of
    # layout.py takes it
    prefix: str
    buf: mmap.mmap
    layout: L.Layout
    capacity: int                # bytes of the MEMORY arena
    alloc: Allocator             # the extent allocator (guarded by alloc_lock)
    alloc_lock: ShmLock
    table: Table
    # the MEMORY arena's segment, mapped twice: arena_mm (writable: puts copy into it) and arena_ro (a PROT_READ mapping
    # of the same pages: every view handed out is built over it, so numpy cannot make one writable)
    arena: Segment
    arena_mm: mmap.mmap
    arena_ro: memoryview
    prefault: Prefaulter

    def used(self, level: int) -> int:
        """Bytes of the objects on ``level`` (sum of the stripes' counters)."""

    def reclaim_retired_locked(self) -> int:
        """Free retired chunks that no entry points at (ALLOC lock held); returns how many."""

    def stripe_of(self, idx: int) -> ShmLock:
        """The lock guarding entry ``idx``."""

    def free_if_unpinned(self, idx: int, gen: int | None = None, blocking: bool = True,
                         supply: ClientSupply | None = None) -> bool | None:
        """Free ``idx`` if it is deleted and nobody pins it (see ``NodeStore.free_if_unpinned``)."""


class PutContext(NamedTuple):
    """What a level's put gets from the putting client (never the client's whole state): its slot, its
    supply of reserved entries and current chunk, the C table operations bound to it (None: not built,
    or disabled), the prefaulter of its mapping and the stripe locks (a dead holder's to repair)."""

    slot: int
    supply: ClientSupply
    ops: ClientOps | None
    prefault: Prefaulter
    stripes: Sequence[ShmLock]


class Sink(Protocol):
    """Where a writer streams an object's bytes (``Store.open_writer``, an incoming transfer)."""

    def write(self, data: Any, pos: int) -> None:
        """Write ``data`` (a uint8 array or bytes-like) at byte ``pos`` of the object.

        Raises:
            StorageFullError, SpillError, PermissionDeniedError: the level could not store it (the message
                names the level's limit or path); the writer then aborts.
        """

    def buffer(self) -> Any:
        """A writable uint8 array over the whole object to fill in place, or None where the level has none."""

    def close(self) -> None:
        """Make the bytes complete (before the entry is sealed).

        Raises:
            StorageFullError, SpillError, PermissionDeniedError: the level could not store them.
        """

    def abort(self) -> None:
        """Drop what was written; never raises."""


@runtime_checkable
class StorageLevel(Protocol):
    """One storage level of a node store, as one process sees it.

    Made by the registry from a :class:`LevelHost` and owned by the node
    store it is handed to (``NodeStore.use_levels``); owns what it opened in
    this process (a directory descriptor, a device mapping), released by
    ``close`` (idempotent). Thread-safe. The metadata methods (``place``,
    ``free_locked``, ``abort_move``, ``total``, ``check``,
    ``recount_locked``, ``drop_lost`` ...) work in every process, even one
    that cannot reach the level's bytes (a GPU level without a device):
    whoever frees an entry frees its space.
    """

    level: Level
    # where the spill policy moves objects off this level (None: never) the setting that sizes the level, for error
    # messages
    spill_to: Level | None
    setting: str

    def available(self) -> str | None:
        """None if this process can place and read objects on the level, else why not (a sentence)."""

    def total(self) -> int:
        """Capacity in bytes."""

    def watermarks(self) -> tuple[float, float]:
        """(high, low): the spill policy keeps usage between these fractions of ``total``."""

    def prepare(self, key: str) -> None:
        """Whatever a :meth:`place` here needs that waits on another process, done before the caller takes
        the key's stripe lock (``place`` itself never waits on one): the GPU level has the spill process make
        this device's arena. A put that waited for the spill process holding its stripe lock, while a client
        held every other stripe (``check``, a supply steal) and the spill process waited for one of those,
        stood until a lock timeout (issue 36's CI, stop 52).

        Raises:
            StorageFullError: what the place would raise for want of it (no arena could be made).
        """

    def place(self, key: str, idx: int, gen: int, size: int, client: PutContext,
              write_entry: Callable[[int, int, int], None]) -> tuple[int, int, int]:
        """Space for ``size`` bytes of reserved entry ``idx`` (stripe lock held; it never waits on another
        process: see :meth:`prepare`).

        Calls ``write_entry(offset, extent, flags)`` in the section that
        places the space, so that the entry names it from the start.

        Returns:
            (offset, extent record, entry flags) of the placement.

        Raises:
            StorageFullError: no room, at once (naming this level and what to raise).
        """

    def try_put(self, client: PutContext, ref: KeyRef, what: Encoded | Contents,
                give_up: Callable[[int, int], object], held: bool = False, seal: bool = True,
                entry: tuple[int, int] | None = None) -> Reservation | None:
        """The level's shortcut of a put, or None (nothing changed) where the general way (reserve, write,
        seal) must do it: every call, for a level without one.

        With ``what.src`` the value is placed, copied and its entry sealed in one step (a whole put);
        without, the entry is reserved (state ``writing``). ``held``: the caller holds the key's stripe
        lock and hands the entry to use (``entry``, taken before the lock); ``seal=False`` leaves copied
        bytes ``writing`` for the caller to seal. ``give_up(idx, gen)`` drops an entry this was cut short
        inside (an asynchronous exception).

        Raises:
            ObjectExistsError, ObjectLockedError, StorageFullError (the table is full), EntryStolen (only with
            ``entry``: another client holds it now; nothing changed).
        """

    def unplace(self, idx: int, extent: int, flags: int) -> None:
        """Give back a placement whose entry was not made."""

    def remove_files(self) -> int:
        """Remove what the level keeps outside shared memory for this store (its files) when the store goes
        away; returns how many. Never raises."""

    def largest_free(self) -> int:
        """The largest object that fits now (bytes)."""

    def write(self, idx: int, gen: int, offset: int, flags: int, enc: Encoded, key: str) -> None:
        """Copy an encoded value (``kernel.serialize.Encoded``) into its placement.

        Raises:
            StorageFullError, SpillError: the level could not store it (nothing is left behind).
        """

    def sink(self, idx: int, gen: int, offset: int, size: int, key: str) -> Sink:
        """A writer's target for ``size`` bytes of entry ``idx``."""

    def view(self, idx: int, gen: int, offset: int, nbytes: int) -> tuple[Any, int]:
        """(buffer, offset) of an object's bytes, read-only, zero-copy where the level allows.

        Raises:
            OSError: the bytes cannot be reached (a missing spill file).
        """

    def drop(self, idx: int, e: L.Entry) -> None:
        """Remove the bytes of entry ``e`` being freed that live outside the table (files); never raises."""

    def free_locked(self, idx: int, e: L.Entry) -> None:
        """Give back the space entry ``e`` holds on this level (its extent, its quota charge)."""

    def check(self, t: np.ndarray) -> list[str]:
        """What is wrong with this level's own state, given a copy of the entry table ``t`` taken with
        every lock held (its counter against what the table charges, its files against the entries); []
        where nothing is."""

    def recount_locked(self, t: np.ndarray) -> None:
        """Derive again from the entry table ``t`` whatever this level counts apart from the arena (DISK:
        its quota counter), after a holder of the ALLOC lock died (ALLOC lock held)."""

    def remove_orphans(self) -> int:
        """Remove bytes of this store that no entry explains (files of a killed writer or mover), each
        re-checked under its entry's lock; returns how many. Run by the spill process at start."""

    def drop_lost(self) -> int:
        """Drop the objects whose bytes died with the process that held them (a dead spill process's
        device memory); returns how many. Run by the spill process at start."""

    def close(self) -> None:
        """Release what this process opened for the level; idempotent."""


@runtime_checkable  # the conformance suite asks
class MovableLevel(StorageLevel, Protocol):
    """A level objects can be moved onto and off (by the spill process's mover)."""

    def charge_move_locked(self, idx: int, e: L.Entry) -> None:
        """Charge this level for a move of entry ``e`` onto it, where the level counts space up front.

        Raises:
            StorageFullError: no room.
        """

    def space_for_move(self, idx: int, size: int) -> tuple[int, int]:
        """(offset, extent) for a move of entry ``idx`` onto this level; the entry names the extent
        (``target_extent``) in the ALLOC section that allocates it. (0, 0) where no space is placed.

        Raises:
            StorageFullError: no room.
        """

    def write_move(self, idx: int, gen: int, offset: int, src: Any, size: int,
                   progress: Callable[[int], None]) -> None:
        """Copy ``size`` bytes from the buffer ``src`` into a move's placement.

        Raises:
            OSError: the level could not store them (the move then gives up).
        """

    def abort_move(self, idx: int, e: L.Entry) -> None:
        """Roll back a move of entry ``e`` onto this level: what it placed and charged goes, and the
        entry stops moving (stripe lock held; takes the ALLOC lock)."""


@runtime_checkable  # the conformance suite asks
class DeviceLevel(MovableLevel, Protocol):
    """A level whose bytes live in device memory, reached through arenas its owner process makes."""

    def value(self, e: L.Entry, array: tuple[Any, ...] | None, token: Any, key: str | None = None) -> Any:
        """The value of entry ``e`` (pinned by the caller; ``key``, for messages): a device array over its
        bytes (``array`` = dtype, shape, order) whose memory owner is ``token`` (it holds the pin); other
        kinds as the level gives them back.

        Raises:
            OSError: the bytes cannot be reached here (their arena was lost).
            DeviceError: no CuPy or no such device here, or CUDA refused (naming ``key``).
        """

    def export(self, e: L.Entry, token: Any) -> Any:
        """The stored bytes of entry ``e`` (pinned by the caller) as one flat uint8 device array, to send
        as they are; ``token`` holds the pin as long as the array lives."""

    def host_bytes(self, arr: Any) -> bytes:
        """The bytes of a device array this level gave (``export``), copied to the host."""

    def local_arena(self) -> int:
        """The arena slot of this process's current device, claimed if no slot names it yet (metadata
        only); -1 where this process has no device.

        Raises:
            StorageFullError: every slot names another device.
        """

    def aim(self, slot: int) -> None:
        """Make ``space_for_move`` place the moves that follow on arena ``slot`` (a client's device's, as
        its request says), or (-1) where the level chooses; the spill process's mover is single-threaded."""

    def arenas(self) -> Sequence[tuple[int, int, int, int]]:
        """(slot, first offset, end offset, capacity) of every ready arena (metadata only): the relief pass
        weighs each arena's objects against that arena's own capacity."""

    def forget_mappings(self) -> None:
        """Let go of what this process holds open for the level's own use (not for the views it handed out,
        which keep their own): the store was closed while views live."""

    def make_arena(self, d: int) -> None:
        """Make arena slot ``d`` on the device it names, owned by this process (the spill process, serving a
        client's request).

        Raises:
            StorageFullError: it cannot be made (no device memory, no CUDA here).
        """


class Levels(NamedTuple):
    """The levels opened for one node store in one process (what ``NodeStore.use_levels`` takes)."""

    levels: dict[Level, MovableLevel]   # every registered level
    devices: dict[Level, DeviceLevel]   # those of them whose values are device arrays
