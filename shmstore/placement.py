"""Placement policy above the kernel: priority lists of levels, waiting for room.

The kernel never waits; this layer does, but only ever on the spill process
and never while holding a store lock:

- a put tries the levels of its priority list in order; when MEMORY is full
  of spillable data it asks the spill process for ``size * 1.1`` bytes and
  waits (``spill_timeout``), then tries again; an object larger than the
  whole level goes to the next level at once;
- ``get`` with levels brings the object to the first listed level first;
- ``move`` asks the spill process to move an object and waits, reporting
  progress.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable, TypeVar

from .client.batches import batch_error
from .client.kernel import Kernel
from .config import Config
from .errors import (
    InvalidArgumentError,
    ObjectLockedError,
    ObjectNotFoundError,
    ShmStoreError,
    SpillError,
    StorageFullError,
)
from .levels import Capacity, Level, ObjectInfo
from .meta import layout as L
from .node.nodestore import NodeStore
from .spill import requests
from .spill.policy import spill_candidates
from .spill.supervisor import ensure_spill
from .units import format_size

__all__ = ["Placement", "DEFAULT_PUT_LEVELS", "DEVICE_PUT_LEVELS"]

DEFAULT_PUT_LEVELS = (Level.MEMORY, Level.DISK)
DEVICE_PUT_LEVELS = (Level.GPU, Level.MEMORY, Level.DISK)  # for device arrays: they stay on the device
_WAKE_EVERY = 256  # small puts between two looks at the high watermark
_T = TypeVar("_T")
# seconds without a spill process heartbeat before looking whether it is alive
_SPILL_STALE = 5.0


class Placement:
    """Level policy for one client; owned by its Store. Thread-safe like the kernel."""

    def __init__(self, kernel: Kernel, node: NodeStore, config: Config) -> None:
        self.kernel = kernel
        self.node = node
        self.config = config
        self._puts = 0
        self._usable: dict[tuple[Level, ...], tuple[Level, ...]] = {}  # priority list: its usable levels

    # ---- put ------------------------------------------------------------------
    def put(self, key: str, obj: Any, order: tuple[Level, ...], overwrite: bool = False) -> ObjectInfo:
        """Place ``obj`` on the first level of ``order`` with room (see :meth:`place`).

        Raises:
            StorageFullError: no level has room (the last level's error).
            SpillError: making room failed (disk full, I/O error).
        """
        info: ObjectInfo = self.place(key, order, partial(self.kernel.put, key, obj, overwrite=overwrite))
        self.hint(info.stored)
        return info

    def put_many(self, items: list[tuple[str, Any]], order: tuple[Level, ...],
                 overwrite: bool = False) -> list[ObjectInfo]:
        """Place each (key, value) of ``items`` (distinct keys): as one kernel batch on the first level of
        ``order`` with room for all of them, else (no room for the whole batch there, a device value) one
        :meth:`put` each, waiting for room as a put does.

        Raises:
            As :meth:`put`, for the first key that fails, its message saying which keys were stored before it
            (``exc.done``): the batch stops there.
        """
        if not items:
            return []
        first = (self._usable.get(order) or self.usable(order))[0]
        if first in self.node.devices or any(hasattr(v, "__cuda_array_interface__") for _, v in items):
            return self._put_each(items, order, overwrite)
        try:
            infos = self.kernel.put_many(items, first, overwrite)
        except StorageFullError as exc:
            if exc.level is None:  # the object table is full: no level helps
                raise batch_error(exc, "put_many", len(items), []) from None
            return self._put_each(items, order, overwrite)  # nothing was stored: each on its own
        except ShmStoreError as exc:
            raise batch_error(exc, "put_many", len(items), []) from None
        self.hint(sum(i.stored for i in infos))
        return infos

    def _put_each(self, items: list[tuple[str, Any]], order: tuple[Level, ...],
                  overwrite: bool) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        for key, obj in items:
            try:
                out.append(self.put(key, obj, order, overwrite))
            except ShmStoreError as exc:
                raise batch_error(exc, "put_many", len(items), [i.key for i in out]) from None
        return out

    def hint(self, nbytes: int) -> None:
        """Wake the spill process early when a put may have crossed the high watermark.

        Also restarts it if it stopped going round its loop (killed, or gone
        after a SIGTERM while this process lived on): nobody else would, and
        without it memory fills up and dead processes' leftovers stay.
        """
        self._puts += 1
        if nbytes < self.node.small_max and self._puts % _WAKE_EVERY:
            return
        s = L.unpack_spill_state(self.node.buf)
        if time.time() - s.heartbeat > _SPILL_STALE:
            ensure_spill(self.node)
        if self.node.used(L.LEVEL_MEMORY) > s.high * self.node.capacity:
            self.node.wake.post()

    def make_room(self, key: str, nbytes: int, deadline: float, level: Level = Level.MEMORY) -> None:
        """Ask the spill process for about ``nbytes * 1.1`` on ``level`` and wait for it.

        Raises:
            StorageFullError: nothing left to spill, or no answer before ``deadline``.
            SpillError: a spill failed.
        """
        want = min(int(nbytes * 1.1), self.node.levels[level].total())
        self._request(key, L.REQ_SPACE, deadline, nbytes=want, level=int(level))

    def _request(self, key: str, kind: int, deadline: float, progress: Callable[[Any], None] | None = None,
                 **args: int) -> None:
        seq = requests.submit(self.node, self.kernel.slot, kind, **args)
        r = requests.wait(self.node, self.kernel.slot, seq, max(0.0, deadline - time.monotonic()), progress)
        if r is None:
            raise StorageFullError(
                f"gave up on {key!r} after waiting {self.config.spill_timeout:g} s for the spill process "
                f"(raise spill_timeout= / SHMSTORE_SPILL_TIMEOUT)", key, Level(args.get("level", L.LEVEL_MEMORY)),
                args.get("nbytes"))
        if r.status == L.RS_DONE:
            return
        raise _request_error(key, r, Level(args.get("level", L.LEVEL_MEMORY)))

    def place(self, key: str, order: tuple[Level, ...], make: Callable[[Level], _T]) -> _T:
        """``make(level)`` on the first level of ``order`` with room: the one loop that waits for room.

        ``make`` puts or reserves (an object, a writer, an incoming transfer)
        and raises StorageFullError when its level has none. On a level that
        spills, the first such error starts the ``spill_timeout`` deadline and
        each one asks the spill process for room once before
        ``make`` is tried again; a level that cannot make room (it does not
        spill, the object is larger than the level, the spill process found
        nothing or timed out) passes the object to the next level at once.

        Raises:
            StorageFullError: no level has room (the last level's error), or the object table is full.
            SpillError: making room failed (disk full, I/O error).
        """
        last: StorageFullError | None = None
        retired = False
        for level in self._usable.get(order) or self.usable(order):
            deadline = None
            while True:
                try:
                    return make(level)
                except StorageFullError as exc:
                    if exc.level is None:  # the object table is full: no level helps
                        raise
                    last = exc
                    if not self._room_can_be_made(level, exc):
                        break  # the next level
                if deadline is None:
                    deadline = time.monotonic() + self.config.spill_timeout
                try:
                    self.make_room(key, last.requested or 0, deadline, level)
                except StorageFullError as full:  # nothing left to spill, or no answer in time
                    last = full
                    if level == Level.MEMORY and not retired and self.kernel.retire_chunk():
                        retired = True  # this client's chunk for small objects may split the free space:
                        continue  # once more without it
                    break
        raise last  # type: ignore[misc]

    def _room_can_be_made(self, level: Level, exc: StorageFullError) -> bool:
        """Whether the spill process could make room on ``level`` for what ``exc`` says did not fit."""
        lv = self.node.levels[level]
        return lv.spill_to is not None and exc.level == level and exc.requested is not None \
            and exc.requested <= lv.total()

    def usable(self, order: tuple[Level, ...]) -> tuple[Level, ...]:
        """The levels of a priority list this process can use (``[GPU, MEMORY]`` on a node without a
        GPU is ``[MEMORY]``).

        Raises:
            InvalidArgumentError: none of them, saying why for each.
        """
        out = tuple(lv for lv in order if lv in self.node.levels and not self.node.levels[lv].available())
        if not out:
            self._check_level(order[0])
        self._usable[order] = out  # a level's availability here never changes
        return out

    def _check_level(self, level: Any) -> Level:
        """``level`` as a Level this process can use.

        Raises:
            InvalidArgumentError: the level is not available here, saying why.
        """
        lv = self.node.levels.get(Level(level))
        why = "it is not registered" if lv is None else lv.available()
        if why:
            raise InvalidArgumentError(f"{Level(level)} is not available: {why} (use Level.MEMORY or Level.DISK)")
        return Level(level)

    # ---- get / move -------------------------------------------------------------
    def bring(self, key: str, order: tuple[Level, ...]) -> None:
        """Make sure ``key`` is on one of ``order``'s levels, moving it to the first if not."""
        if Level(self.kernel.lookup(self.kernel.begin(key), False).entry.level) not in order:
            self.move(key, self.usable(order)[0])

    def move(self, key: str, level: Level, progress: Callable[[L.SpillState], None] | None = None) -> ObjectInfo:
        """Move ``key`` to ``level`` through the spill process; waits (``spill_timeout``).

        ``progress`` is called with the spill state while this move's copy
        runs only: the spill process serves one request at a time, and what it
        moves before this one (another client's move, room it makes on
        ``level``) is not this move's progress.

        Raises:
            ObjectNotFoundError, ObjectLockedError (pinned), StorageFullError, SpillError.
        """
        level = self._check_level(level)
        idx, e, _ = self.kernel.lookup(self.kernel.begin(key), False)
        if e.level != level:
            deadline = time.monotonic() + self.config.spill_timeout
            device = self.node.devices.get(level)  # onto the arena of this process's device, not the spill process's
            arena = device.local_arena() + 1 if device is not None else 0
            own = None if progress is None else partial(_progress_of, idx, progress)
            self._request(key, L.REQ_MOVE, deadline, own, idx=idx, gen=e.gen, level=int(level), arena=arena)
        return self.kernel.info(key)

    # ---- capacity ---------------------------------------------------------------
    def capacity(self) -> dict[Level, Capacity]:
        """Total, used, pinned, free, objects, spillable, spilled and restored bytes per level."""
        k, node = self.kernel, self.node
        k.check_open()
        buf = node.buf
        t = L.entry_table(buf, node.layout)
        pins = node.table.pin_counts(len(t))
        s = L.unpack_spill_state(buf)
        live = (t["state"] != L.FREE) & (t["state"] != L.RESERVED)
        out = {}
        for level, lv in sorted(node.levels.items()):
            if lv.available():
                continue
            total = lv.total()
            on = live & (t["level"] == int(level))
            used = node.used(int(level))
            pinned = int(t["size"][on & (pins > 0)].sum())
            spillable = int(t["size"][spill_candidates(t, pins, level=int(level))].sum()) if lv.spill_to else 0
            out[level] = Capacity(total, used, pinned, total - used, int(on.sum()), spillable,
                                  s.spilled, s.restored)
        return out


def _progress_of(idx: int, progress: Callable[[L.SpillState], None], s: L.SpillState) -> None:
    """``progress(s)`` where ``s`` is the move of entry ``idx`` (the spill state names the entry it moves).

    The entry is the key's until the key is deleted; one reused meanwhile by
    another object that then moves would be shown, and the request still
    fails as the key is gone.
    """
    if s.moving == idx + 1:
        progress(s)


def _request_error(key: str, r: L.Request, level: Level = Level.MEMORY) -> Exception:
    # the spill process names the key in most answers ("'k' is pinned ..."): named once, not "'k': 'k' is ..."
    msg = (r.message if repr(key) in r.message else f"{key!r}: {r.message}") if r.message else \
        f"request for {key!r} failed"
    if r.error == L.ERR_LOCKED:
        return ObjectLockedError(msg, key)
    if r.error == L.ERR_MISSING:
        return ObjectNotFoundError(msg, key)
    if r.error == L.ERR_FULL:
        return StorageFullError(msg, key, level)
    return SpillError(msg, key)


def spill_progress_line(s: L.SpillState, key: str | None = None) -> str:
    """One line describing the move in progress (for the command line), naming ``key`` if given: the caller
    knows it is that key's move (the spill state names only the entry)."""
    if not s.moving or not s.total:
        return ""
    pct = 100.0 * s.progress / s.total
    what = f"moving {key!r}" if key is not None else "moving"
    return (f"{what} to {Level(s.moving_to).name.lower()}: {format_size(s.progress)} of {format_size(s.total)} "
            f"({pct:.0f}%)")

