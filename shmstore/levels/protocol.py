"""What a storage level is: the interface every level implements (MEMORY, DISK, GPU).

The object table (entries, chains, pins, per-stripe usage) belongs to the
kernel and is the same for every level; a level owns where an object's
bytes live and how their space is counted. A new level is a new module with
a class that satisfies :class:`StorageLevel`, plus one line in
``registry.py``; ``tests/test_levels.py`` is the conformance suite every
registered level passes.

Locking contract (see ``kernel/alloc.py`` and ``kernel/repair.py`` for why):

- ``place`` is called with the entry's stripe lock held. A level that
  charges a counter (DISK) calls ``write_entry`` inside the ALLOC-locked
  section that charges it, so the counter always equals what the table
  charges; an arena level (MEMORY) makes the entry name its extent in the
  ALLOC section that allocates it.
- ``free_locked`` and ``charge_move_locked`` are called with the entry's
  stripe lock and the ALLOC lock held; ``drop`` with the stripe lock only
  (files go before the entries that name them).
- ``write``, ``view``, ``sink`` and ``space_for_move`` take no store lock
  (``space_for_move`` takes the ALLOC lock itself).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from .base import Level

__all__ = ["StorageLevel", "Sink"]


class Sink(Protocol):
    """Where a writer streams an object's bytes (``Store.open_writer``, an incoming transfer)."""

    def write(self, data: Any, pos: int) -> None:
        """Write ``data`` (a uint8 array or bytes-like) at byte ``pos`` of the object.

        Raises:
            OSError: the level could not store it.
        """

    def buffer(self) -> Any:
        """A writable uint8 array over the whole object to fill in place, or None where the level has none."""

    def close(self) -> None:
        """Make the bytes complete (before the entry is sealed).

        Raises:
            OSError: the level could not store them.
        """

    def abort(self) -> None:
        """Drop what was written; never raises."""


@runtime_checkable
class StorageLevel(Protocol):
    """One storage level of a node store, as one process sees it.

    Made by the registry for each :class:`~shmstore.kernel.NodeStore`; owns
    what it opened in this process (a directory descriptor, a device
    mapping), released by ``close``. Thread-safe. The metadata methods
    (``place`` ... ``abort_move``, ``total``) work in every process, even
    one that cannot reach the level's bytes (a GPU level without a device):
    whoever frees an entry frees its space.
    """

    level: Level
    spill_to: Level | None  # where the spill policy moves objects off this level (None: never)
    setting: str            # the setting that sizes the level, for error messages

    def available(self) -> str | None:
        """None if this process can place and read objects on the level, else why not (a sentence)."""

    def total(self) -> int:
        """Capacity in bytes."""

    def watermarks(self) -> tuple[float, float]:
        """(high, low): the spill policy keeps usage between these fractions of ``total``."""

    def place(self, key: str, idx: int, gen: int, size: int, at: Any,
              write_entry: Callable[[int, int, int], None]) -> tuple[int, int, int]:
        """Space for ``size`` bytes of reserved entry ``idx`` (stripe lock held).

        Calls ``write_entry(offset, extent, flags)`` in the section that
        places the space, so that the entry names it from the start.

        Returns:
            (offset, extent record, entry flags) of the placement.

        Raises:
            StorageFullError: no room, at once (naming this level and what to raise).
        """

    def unplace(self, idx: int, extent: int, flags: int) -> None:
        """Give back a placement whose entry was not made."""

    def largest_free(self) -> int:
        """The largest object that fits now (bytes)."""

    def write(self, idx: int, gen: int, offset: int, flags: int, enc: Any, key: str) -> None:
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

    def drop(self, idx: int, e: tuple[Any, ...]) -> None:
        """Remove the bytes of entry ``e`` being freed that live outside the table (files); never raises."""

    def free_locked(self, idx: int, e: tuple[Any, ...]) -> None:
        """Give back the space entry ``e`` holds on this level (its extent, its quota charge)."""

    def charge_move_locked(self, idx: int, e: tuple[Any, ...]) -> None:
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

    def abort_move(self, idx: int, e: tuple[Any, ...]) -> None:
        """Roll back a move of entry ``e`` onto this level: what it placed and charged goes, and the
        entry stops moving (stripe lock held; takes the ALLOC lock)."""

    def close(self) -> None:
        """Release what this process opened for the level; idempotent."""
