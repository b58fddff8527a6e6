"""The kernel: put/get/delete/pin on one level, never waiting.

A :class:`Kernel` is one client's handle on a node store for one session.
Every verb is a few updates of the shared table under the key's stripe lock
plus the copy; no message goes to any other process. A full level raises
:class:`~shmstore.errors.StorageFullError` at once: waiting for the spill
process is the Store's business, one layer up.

Visibility: a put first reserves its entry in state ``writing`` (invisible
to get, and owned by this client's slot), copies outside any lock, then
seals. A writer that dies leaves a ``writing`` entry that the janitor drops;
one that fails drops it itself.

Views: ``get`` returns views into the arena. They hang off a ``_Lease``
(a read-only uint8 ndarray subclass over the object's bytes) whose
finalizer unpins the object, so a delete only hides the object and its
space is reused once the last view is gone.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from .. import serialize
from ..errors import (InvalidArgumentError, InvalidKeyError, ObjectExistsError, ObjectLockedError,
                      ObjectNotFoundError, StorageFullError, StoreClosedError)
from ..levels import Capacity, Level, ObjectInfo
from ..units import format_size
from . import layout as L
from .lock import held
from .node import NodeStore

__all__ = ["Kernel", "encode_key"]


def encode_key(key: Any) -> bytes:
    """UTF-8 bytes of a valid key.

    Raises:
        InvalidKeyError: not a non-empty str of at most 255 UTF-8 bytes.
    """
    if type(key) is not str:
        raise InvalidKeyError(f"keys are str, got {type(key).__name__}: {key!r}")
    try:
        kb = key.encode()
    except UnicodeEncodeError as exc:
        raise InvalidKeyError(f"key {key!r} is not valid UTF-8: {exc.reason}") from None
    if not kb or len(kb) > L.MAX_KEY:
        raise InvalidKeyError(f"key {key[:40]!r} is {len(kb)} bytes; keys are 1 to {L.MAX_KEY} UTF-8 bytes")
    return kb


class _Lease(np.ndarray):
    """Read-only bytes of one object; when the last view of it dies, it unpins."""

    def __del__(self) -> None:
        release = self.__dict__.get("_release")
        if release is not None:
            try:
                release[0](release[1])
            except Exception:  # finalizers must not raise; at worst the janitor unpins
                pass


class Kernel:
    """One client's verbs on one node store and session; never waits.

    Owns its client slot (given back by ``close``) but not the node store's
    segments. Process-safe through the store's locks; thread-safe. Not usable
    in a child after ``fork``: connect again there.
    """

    _closed = True
    _pins: dict[int, int] = {}

    def __init__(self, node: NodeStore, slot: int, session: str) -> None:
        self.node = node
        self.slot = slot
        self.session = session
        self._buf = node.meta.mm
        self._arena = node.arena.mm
        self._lay = node.layout
        self._table = node.table
        self._pid = os.getpid()
        self._pins = {}          # entry index -> local pin count (views, readers, explicit pins)
        self._explicit: dict[tuple[int, bytes], list[int]] = {}
        self._deferred: list[int] = []
        self._detach_when_unpinned = False
        self.sid = self._session_id(session)
        self._closed = False

    # ---- sessions and checks ----------------------------------------------
    def _session_id(self, name: str) -> int:
        with self.node.admin:
            free = -1
            for sid in range(L.MAX_SESSIONS):
                have = L.unpack_session(self._buf, self._lay.session(sid))
                if have == name:
                    return sid
                if have is None and free < 0:
                    free = sid
            if free < 0:
                raise StorageFullError(f"store has all {L.MAX_SESSIONS} sessions in use (reuse session names)")
            L.pack_session(self._buf, self._lay.session(free), name)
            return free

    def session_name(self, sid: int) -> str:
        return L.unpack_session(self._buf, self._lay.session(sid)) or ""

    def _check(self) -> None:
        if self._closed:
            raise StoreClosedError("store is closed (connect() again)")
        if os.getpid() != self._pid:
            raise StoreClosedError(f"store was opened in pid {self._pid}, not in this forked child; connect() again here")
        if self._deferred:
            self._drain()

    # ---- put --------------------------------------------------------------
    def put(self, key: str, obj: Any, level: Level = Level.MEMORY) -> ObjectInfo:
        """Store ``obj`` under ``key`` on ``level`` (MEMORY here).

        Raises:
            ObjectExistsError: the key is present. ObjectLockedError: it is being written.
            StorageFullError: no room on the level, at once.
            SerializationError, InvalidKeyError: bad input; nothing changes.
        """
        kb = encode_key(key)
        self._check()
        self._require_memory(level)
        enc = serialize.encode(obj)
        idx, off = self.reserve(key, kb, enc.kind, enc.size, enc.nbytes, enc.nblobs, enc.array)
        try:
            self.node.ensure_populated(off, enc.size, key)
            serialize.write(enc, self.writable(off, enc.size))
        except BaseException:
            self.abort(idx)
            raise
        self.seal(idx)
        return self._info(idx, key)

    def _require_memory(self, level: Level) -> None:
        if level != Level.MEMORY:
            raise InvalidArgumentError(f"the kernel places objects in memory only, not {Level(level).name}")

    def reserve(self, key: str, kb: bytes, kind: int, size: int, nbytes: int, nblobs: int = 0,
                array: tuple | None = None) -> tuple[int, int]:
        """Create an invisible ``writing`` entry with ``size`` bytes of arena.

        Returns:
            (entry index, arena offset).
        """
        if size < 0:
            raise InvalidArgumentError(f"size of {key!r} must not be negative, got {size}")
        node, buf, lay = self.node, self._buf, self._lay
        h, b, s = self._table.locate(self.sid, kb)
        with node.stripes[s]:
            found = self._table.find(h, b, self.sid, kb)
            if found >= 0:
                if L.entry_state(buf, lay.entry(found)) == L.WRITING:
                    raise ObjectLockedError(f"{key!r} is being written by another writer", key)
                raise ObjectExistsError(f"{key!r} already exists (delete it first, or use another key)", key)
            with node.alloc_lock:
                idx, rec, off, stored = self._allocate(key, size)
                eoff = lay.entry(idx)
                gen = L.entry_gen(buf, eoff)
                L.pack_entry(buf, eoff, L.EntryHead(off, stored, nbytes, L.tick(buf), time.time(), h, 0, gen, 0,
                                                    self.slot, rec, nblobs, len(kb), self.sid, L.WRITING, kind,
                                                    int(Level.MEMORY), 0))
                if array is not None:
                    L.pack_entry_array(buf, eoff, *array)
                L.set_entry_key(buf, eoff, kb)
            self._table.link(idx, b)
        return idx, off

    def _allocate(self, key: str, size: int) -> tuple[int, int, int, int]:
        """(entry, extent, offset, stored size) under the ALLOC lock, or StorageFullError."""
        buf = self._buf
        idx = self._table.new_entry()
        if idx < 0:
            raise StorageFullError(f"cannot place {key!r}: the object table holds its maximum of "
                                   f"{self._lay.max_objects} objects (raise max_objects= / SHMSTORE_MAX_OBJECTS "
                                   f"when creating the store)", key, Level.MEMORY)
        rec, off = self.node.alloc.alloc(size, idx + 1)
        if not rec:
            self._table.release_entry(idx)
            used, cap = L.used(buf, Level.MEMORY), self.node.capacity
            hint = "" if cap - used < size else ", in pieces too small"
            raise StorageFullError(
                f"cannot place {key!r} ({format_size(size)}) in memory: {format_size(cap - used)} free of "
                f"{format_size(cap)}{hint} (raise capacity= / SHMSTORE_CAPACITY, or allow Level.DISK)",
                key, Level.MEMORY, size, cap - used)
        stored = self.node.alloc.size_of(rec)
        L.set_used(buf, Level.MEMORY, L.used(buf, Level.MEMORY) + stored)
        L.set_nobjects(buf, L.nobjects(buf) + 1)
        return idx, rec, off, stored

    def writable(self, off: int, size: int) -> np.ndarray:
        """Writable uint8 view of ``size`` arena bytes at ``off`` (for the writer only)."""
        return np.ndarray((size,), np.uint8, buffer=self._arena, offset=off)

    def seal(self, idx: int) -> None:
        """Make a reserved entry visible."""
        with self.node.stripe_of(idx):
            eoff = self._lay.entry(idx)
            L.set_entry_writer(self._buf, eoff, -1)
            L.set_entry_state(self._buf, eoff, L.SEALED)

    def abort(self, idx: int) -> None:
        """Drop a reserved entry and give its space back."""
        with self.node.stripe_of(idx):
            self._table.unlink(idx, self._table.bucket_of(idx))
            self.node.release(idx)

    # ---- get --------------------------------------------------------------
    def lookup(self, key: str, kb: bytes, pin: bool) -> tuple[int, L.EntryHead]:
        """Find the sealed entry of ``key`` and (optionally) pin it for this process.

        Raises:
            ObjectNotFoundError: no sealed object has this key.
        """
        h, b, s = self._table.locate(self.sid, kb)
        buf, lay = self._buf, self._lay
        with self.node.stripes[s]:
            idx = self._table.find(h, b, self.sid, kb)
            if idx < 0 or L.entry_state(buf, lay.entry(idx)) != L.SEALED:
                raise ObjectNotFoundError(f"no object {key!r}" + (f" in session {self.session!r}" if self.session else ""), key)
            e = L.unpack_entry(buf, lay.entry(idx))
            if pin:
                self._pin_locked(idx)
                L.set_entry_atime(buf, lay.entry(idx), L.tick(buf))
        return idx, e

    def get(self, key: str, conditions: Any = None) -> Any:
        """The value of ``key``: zero-copy read-only views for arrays and bytes.

        Raises:
            ObjectNotFoundError: no sealed object has this key.
            InvalidArgumentError: ``conditions`` on a value that is not an array.
        """
        kb = encode_key(key)
        self._check()
        idx, e = self.lookup(key, kb, pin=True)
        array = L.unpack_entry_array(self._buf, self._lay.entry(idx)) if e.kind == L.KIND_NDARRAY else None
        obj = serialize.decode(e.kind, self.lease(idx, e.offset, e.nbytes), e.nbytes, array)
        return obj if conditions is None else apply_conditions(key, obj, conditions)

    def lease(self, idx: int, off: int, n: int) -> np.ndarray:
        """Read-only bytes of pinned entry ``idx``; the pin is released with the last view."""
        lease = np.ndarray.__new__(_Lease, (n,), np.uint8, self._arena, off)
        lease.flags.writeable = False
        lease._release = (self._release, idx)
        return lease

    # ---- pins -------------------------------------------------------------
    def _pin_locked(self, idx: int) -> None:
        n = self._pins.get(idx, 0)
        if not n:
            self._table.pin_shared(self.slot, idx)
        self._pins[idx] = n + 1

    def _release(self, idx: int) -> None:
        """Drop one local pin (from a finalizer, a reader or ``unpin``)."""
        if self._closed and not self._detach_when_unpinned:
            return
        if held():  # a finalizer fired inside one of our locked sections
            self._deferred.append(idx)
            return
        with self.node.stripe_of(idx):
            n = self._pins.get(idx, 0) - 1
            if n > 0:
                self._pins[idx] = n
            elif n == 0:
                del self._pins[idx]
                self.node.unpin(self.slot, idx)
        if self._detach_when_unpinned and not self._pins:
            self._detach()

    def _drain(self) -> None:
        while self._deferred:
            self._release(self._deferred.pop())

    def pin(self, key: str) -> None:
        """Pin ``key`` (counted): spill never moves it until as many ``unpin``.

        Raises:
            ObjectNotFoundError: no such object.
        """
        kb = encode_key(key)
        self._check()
        idx, _ = self.lookup(key, kb, pin=True)
        self._explicit.setdefault((self.sid, kb), [idx, 0])[1] += 1

    def unpin(self, key: str) -> None:
        """Undo one ``pin`` of ``key`` by this process.

        Raises:
            InvalidArgumentError: this process holds no pin on ``key``.
        """
        kb = encode_key(key)
        self._check()
        rec = self._explicit.get((self.sid, kb))
        if rec is None:
            raise InvalidArgumentError(f"{key!r} is not pinned by this process")
        rec[1] -= 1
        if rec[1] == 0:
            del self._explicit[(self.sid, kb)]
        self._release(rec[0])

    # ---- delete / query ---------------------------------------------------
    def delete(self, key: str, missing_ok: bool = False) -> None:
        """Hide ``key`` at once; its space is freed when the last pin goes.

        Raises:
            ObjectNotFoundError: no such object (unless ``missing_ok``).
        """
        kb = encode_key(key)
        self._check()
        h, b, s = self._table.locate(self.sid, kb)
        buf, lay = self._buf, self._lay
        with self.node.stripes[s]:
            idx = self._table.find(h, b, self.sid, kb)
            if idx < 0 or L.entry_state(buf, lay.entry(idx)) != L.SEALED:
                if missing_ok:
                    return
                raise ObjectNotFoundError(f"no object {key!r} to delete", key)
            self._table.unlink(idx, b)
            if L.entry_pins(buf, lay.entry(idx)):
                L.set_entry_state(buf, lay.entry(idx), L.DELETED)
            else:
                self.node.release(idx)

    def contains(self, key: str) -> bool:
        kb = encode_key(key)
        self._check()
        h, b, s = self._table.locate(self.sid, kb)
        with self.node.stripes[s]:
            idx = self._table.find(h, b, self.sid, kb)
            return idx >= 0 and L.entry_state(self._buf, self._lay.entry(idx)) == L.SEALED

    def info(self, key: str) -> ObjectInfo:
        """ObjectInfo of ``key``.

        Raises:
            ObjectNotFoundError: no such object.
        """
        kb = encode_key(key)
        self._check()
        idx, _ = self.lookup(key, kb, pin=False)
        return self._info(idx, key)

    def _info(self, idx: int, key: str, e: L.EntryHead | None = None) -> ObjectInfo:
        e = e or L.unpack_entry(self._buf, self._lay.entry(idx))
        return ObjectInfo(key, e.nbytes, Level(e.level), e.pins > 0, e.state == L.SEALED, e.nblobs,
                          serialize.KIND_NAMES[e.kind], e.size, e.pins, self.session_name(e.session), e.ctime)

    def list(self, level: Level | None = None, all_sessions: bool = False) -> list[ObjectInfo]:
        """Sealed objects of this session (or all), optionally on one level."""
        self._check()
        t = L.entry_table(self._buf, self._lay)
        mask = t["state"] == L.SEALED
        if not all_sessions:
            mask &= t["session"] == self.sid
        if level is not None:
            mask &= t["level"] == int(level)
        out = []
        for idx in np.flatnonzero(mask):
            eoff = self._lay.entry(int(idx))
            e = L.unpack_entry(self._buf, eoff)
            if e.state == L.SEALED:
                out.append(self._info(int(idx), L.entry_key(self._buf, eoff, e.keylen).decode(errors="replace"), e))
        return out

    def capacity(self) -> dict[Level, Capacity]:
        """Usage of the MEMORY level."""
        self._check()
        t = L.entry_table(self._buf, self._lay)
        mem = (t["state"] != L.FREE) & (t["level"] == int(Level.MEMORY))
        pinned = int(t["size"][mem & (t["pins"] > 0)].sum())
        used, total = L.used(self._buf, Level.MEMORY), self.node.capacity
        return {Level.MEMORY: Capacity(total, used, pinned, total - used, int(mem.sum()))}

    # ---- lifecycle --------------------------------------------------------
    def close(self) -> bool:
        """Release explicit pins and detach; idempotent.

        Returns:
            True if detached now, False if live views still pin objects (the
            slot is given back when the last one is garbage collected).
        """
        if self._closed:
            return not self._detach_when_unpinned
        if os.getpid() != self._pid:
            self._closed = True
            return True
        self._drain()
        for idx, count in list(self._explicit.values()):
            for _ in range(count):
                self._release(idx)
        self._explicit.clear()
        self._closed = True
        if self._pins:
            self._detach_when_unpinned = True
            return False
        self._detach()
        return True

    def _detach(self) -> None:
        self._detach_when_unpinned = False
        remaining = self.node.deregister(self.slot)
        self.on_detach(remaining)

    def on_detach(self, remaining: int) -> None:
        """Hook run after the slot is given back (the Store wakes the janitor)."""


def apply_conditions(key: str, obj: Any, conditions: Any) -> Any:
    """``obj[conditions]`` for arrays; an error for anything else."""
    if not isinstance(obj, np.ndarray):
        raise InvalidArgumentError(f"conditions apply to arrays; {key!r} holds a {type(obj).__name__}")
    try:
        return obj[conditions]
    except (IndexError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"bad conditions for {key!r} (shape {obj.shape}): {exc}") from None
