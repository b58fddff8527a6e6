"""Putting objects: reserve an invisible entry, copy outside any lock, seal.

A put first reserves its entry in state ``writing`` (invisible to get, and
owned by this client's slot) with its space - a cut of this client's chunk
for a small object, an extent of its own for a large one, or DISK quota -
then copies with no lock held, then seals under the stripe lock. A writer
that dies leaves a ``writing`` entry that the janitor drops; one that fails
drops it itself.
"""
from __future__ import annotations

import time
import zlib
from typing import Any, NamedTuple

import numpy as np

from ..errors import InvalidArgumentError, ObjectExistsError, ObjectLockedError, ShmStoreError, StorageFullError
from ..values import Level, ObjectInfo
from ..levels.memory import MemoryLevel
from . import layout as L
from . import serialize
from .attach import Attachment
from .table import find_entry
from .table import EntryStolen, owns_entry
from .fastpath import codes as _fast_codes
from .protocols import StorageLevel

__all__ = ["Puts"]

_U8 = np.dtype(np.uint8)
_MEMORY = int(Level.MEMORY)
_monotonic = time.monotonic
_crc32 = zlib.crc32
_EXISTS = "{!r} already exists (delete it first, pass overwrite=True, or use another key)"


class _Stored(NamedTuple):
    """An object's stored bytes for :meth:`Puts._fast_insert` to copy (what it reads of an Encoded)."""
    size: int
    src: bytes


class Puts:
    """The put side of a :class:`~shmstore.kernel.Kernel`: reserve an entry, copy, seal.

    Owned by the kernel; shares its :class:`~shmstore.kernel.attach.Attachment`.
    Process-safe through the store's locks; thread-safe.
    """

    def __init__(self, at: Attachment) -> None:
        self.node, self.slot, self.sid, self.session = at.node, at.slot, at.sid, at.session
        self._cache, self._fast, self._prefault = at.cache, at.fast, at.prefault
        self._buf, self._lay, self._table, self._stripes = at.buf, at.lay, at.table, at.stripes
        self._bmask, self._smask = at.bmask, at.smask
        self._meta_addr, self._stripe_addrs = at.meta_addr, at.stripe_addrs
        self._arena, self._arena_addr = at.arena, at.arena_addr
        self._at = at
        memory = at.node.levels[Level.MEMORY]
        assert isinstance(memory, MemoryLevel)
        self._memory = memory

    def put(self, key: str, kb: bytes, obj: Any, level: int = _MEMORY, overwrite: bool = False) -> ObjectInfo:
        """Store ``obj`` under ``key`` (its checked bytes ``kb``) on ``level``.

        With ``overwrite``, an existing object of ``key`` is replaced
        atomically (see :meth:`replace`).

        Raises:
            ObjectExistsError: the key is present. ObjectLockedError: it is being written.
            StorageFullError: no room on the level, at once.
            SerializationError: bad input; nothing changes.
            InvalidArgumentError: the level is not available here.
        """
        enc = serialize.encode(obj)
        if level == _MEMORY:
            lv: StorageLevel = self._memory
            if not overwrite and self._fast is not None and enc.kind != L.KIND_PICKLE \
                    and enc.size <= self._cache.small_max and not enc.device:
                info = self._fast_put(key, kb, enc)
                if info is not None:
                    return info
        else:
            lv = self.level(key, level)
        (idx, off, stored, ctime, stripe), gen = self._reserve(key, kb, enc.kind, enc.size, enc.nbytes, enc.nblobs,
                                                               enc.meta, level, overwrite)
        try:
            lv.write(idx, gen, off, L.ENTRY_HEAD.get(self._buf, self._lay.entry(idx), "flags"), enc, key)
            if overwrite:
                self.replace(key, kb, idx, stripe)
            else:
                self.seal(idx, stripe)
        except BaseException:
            self.give_up(idx, gen)  # a no-op once sealed (an exception after the last step)
            raise
        return self._new_info(key, enc, Level(level), stored, ctime)

    def level(self, key: str, level: int) -> StorageLevel:
        """The level ``level`` of this store, if this process can use it.

        Raises:
            InvalidArgumentError: it is not available here (saying why).
        """
        lv = self.node.levels.get(Level(level))
        why = "it is not registered" if lv is None else lv.available()
        if lv is None or why:
            raise InvalidArgumentError(f"cannot place {key!r} on {Level(level).name}: {why} "
                                       f"(use Level.MEMORY or Level.DISK)")
        return lv

    def _fast_put(self, key: str, kb: bytes, enc: serialize.Encoded) -> ObjectInfo | None:
        """A small array or bytes value put in one C call: copied into a cut of this client's
        chunk, then its entry written already sealed and linked under the stripe lock.

        Returns None (nothing changed) to leave it to the general path: a strided
        array, no room, or a busy stripe lock.
        """
        if enc.kind == L.KIND_NDARRAY:
            flags = enc.src.flags
            if not (flags.c_contiguous or flags.f_contiguous):
                return None
        stored = L.align(max(enc.size, 1))
        h = _crc32(kb, self.sid)
        b = h & self._bmask
        while True:
            idx, gen = self._cache.take_entry(key)
            try:
                done = self._fast_reserve(key, kb, idx, gen, h, b, b & self._smask, enc.kind, stored, enc.nbytes,
                                          enc.nblobs, enc.meta, enc)
            except EntryStolen:
                continue
            if done is None:
                self._cache.entries.append((idx, gen))  # the general path takes an entry of its own
                return None
            return self._new_info(key, enc, Level.MEMORY, stored, done[3])

    def put_stored(self, key: str, kb: bytes, kind: int, nbytes: int, nblobs: int, meta: bytes | None,
                   data: bytes) -> float | None:
        """A small MEMORY object from its stored bytes ``data`` (a fetched copy), copied and sealed in one
        call of the C fast path (as :meth:`_fast_put`): its creation time (``ctime``).

        Returns None (nothing changed) where the general path (reserve,
        write, seal) must do it: no C extension, larger than a chunk's
        cut, empty, no room, a busy stripe lock.

        Raises:
            ObjectExistsError: the key is present. ObjectLockedError: it is being written.
        """
        if self._fast is None or not 0 < nbytes <= self._cache.small_max or len(data) != nbytes:
            return None
        stored = L.align(nbytes)
        h = _crc32(kb, self.sid)
        b = h & self._bmask
        raw = _Stored(nbytes, data)  # what the C call copies (no Encoded, no array: a fetch's hot path)
        while True:
            idx, gen = self._cache.take_entry(key)
            try:
                done = self._fast_reserve(key, kb, idx, gen, h, b, b & self._smask, kind, stored, nbytes, nblobs,
                                          meta, raw)
            except EntryStolen:
                continue
            if done is None:
                self._cache.entries.append((idx, gen))
                return None
            return float(done[3])

    def _new_info(self, key: str, enc: serialize.Encoded, level: Level, stored: int, ctime: float) -> ObjectInfo:
        """ObjectInfo of an object this process just sealed (nobody pins it yet)."""
        return ObjectInfo(key, enc.nbytes, level, False, True, enc.nblobs, serialize.KIND_NAMES[enc.kind],
                          stored, 0, self.session, ctime)

    def reserve(self, key: str, kb: bytes, kind: int, size: int, nbytes: int, nblobs: int = 0,
                meta: bytes | None = None, level: int = _MEMORY,
                shadow: bool = False) -> tuple[int, int, int, float, int]:
        """Create an invisible ``writing`` entry with ``size`` bytes on ``level`` (arena or disk quota).

        With ``shadow`` the entry is an overwrite's: in no chain and whatever
        the key holds now, until :meth:`replace` swaps it in.

        Returns:
            (entry index, arena offset, bytes taken, creation time, stripe).

        Raises:
            ObjectExistsError, ObjectLockedError, StorageFullError, InvalidArgumentError.
        """
        return self._reserve(key, kb, kind, size, nbytes, nblobs, meta, level, shadow)[0]

    def _reserve(self, key: str, kb: bytes, kind: int, size: int, nbytes: int, nblobs: int, meta: bytes | None,
                 level: int, shadow: bool) -> tuple[tuple[Any, ...], int]:
        """:meth:`reserve`, and the entry's generation (what :meth:`give_up` needs)."""
        if size < 0:
            raise InvalidArgumentError(f"size of {key!r} must not be negative, got {size}")
        if level != _MEMORY:
            self.level(key, level)
        stored = L.align(max(size, 1))  # extents are exact multiples of the alignment
        h = _crc32(kb, self.sid)
        b = h & self._bmask
        while True:
            idx, gen = self._cache.take_entry(key)
            try:
                if self._fast is not None and level == _MEMORY and not shadow:
                    done = self._fast_reserve(key, kb, idx, gen, h, b, b & self._smask, kind, stored, nbytes,
                                              nblobs, meta)
                    if done is not None:
                        return done, gen
                return self._reserve_locked(key, kb, idx, gen, h, b, kind, stored, nbytes, nblobs, meta, level,
                                            shadow), gen
            except EntryStolen:
                continue  # another client holds that entry now

    def _reserve_locked(self, key: str, kb: bytes, idx: int, gen: int, h: int, b: int, kind: int, stored: int,
                        nbytes: int, nblobs: int, meta: bytes | None, level: int,
                        shadow: bool = False) -> tuple[Any, ...]:
        """``reserve`` in Python under the stripe lock (the C path's fallback, and DISK)."""
        buf, lay, cache = self._buf, self._lay, self._cache
        stripe, eoff = b & self._smask, lay.entry(idx)
        rec = placed = 0
        placed_ok = False
        lv = None
        try:
            with self._stripes[stripe]:
                _, _, e = find_entry(buf, lay, b, h, self.sid, kb)
                if e is not None and not shadow:
                    if e[L.E_STATE] == L.WRITING:
                        raise ObjectLockedError(f"{key!r} is being written by another writer", key)
                    raise ObjectExistsError(_EXISTS.format(key), key)
                if not owns_entry(buf, eoff, self.slot, gen):
                    raise EntryStolen
                ctime = time.time()
                flags = L.FLAG_SHADOW if shadow else 0
                head = {"size": stored, "nbytes": nbytes, "atime": _monotonic(), "ctime": ctime, "hash": h,
                        "gen": gen, "writer": self.slot, "nblobs": nblobs, "keylen": len(kb), "session": self.sid,
                        "state": L.WRITING, "kind": kind, "level": level, "flags": flags}
                lv = self.node.levels[Level(level)]

                def write_entry(off: int, rec: int, flags_: int) -> None:
                    self._write_entry(eoff, dict(head, offset=off, extent=rec, flags=flags | flags_), meta, kb)
                off, rec, placed = lv.place(key, idx, gen, stored, self._at, write_entry)
                placed_ok = True
                L.add_stripe_stats(buf, lay.stripe_stats(stripe), level, stored, 1)
                if not shadow:
                    self._table.link(idx, b)
        except EntryStolen:
            raise
        except ShmStoreError:  # raised on purpose: nothing linked, the placed space (if any) named by nobody
            if placed_ok and lv is not None:
                lv.unplace(idx, rec, placed)
            cache.entries.append((idx, gen))  # still reserved for us
            raise
        except BaseException:  # from anywhere (asynchronous): see give_up
            self.give_up(idx, gen)
            raise
        return idx, off, stored, ctime, stripe

    def _write_entry(self, eoff: int, head: dict[str, Any], meta: bytes | None, kb: bytes) -> None:
        buf = self._buf
        L.ENTRY_HEAD.pack(buf, eoff, **head)
        if meta is not None:
            L.set_entry_array(buf, eoff, meta)
        L.set_entry_key(buf, eoff, kb)

    def _fast_reserve(self, key: str, kb: bytes, idx: int, gen: int, h: int, b: int, stripe: int, kind: int,
                      stored: int, nbytes: int, nblobs: int, meta: bytes | None,
                      enc: serialize.Encoded | _Stored | None = None) -> tuple[Any, ...] | None:
        """``reserve`` through the C fast path: place first, then one locked C call.

        With ``enc`` (a contiguous array or bytes value) its bytes are copied
        into the placed space first and the entry is made sealed: a whole put.

        Returns None (nothing changed) to leave it to the Python path: no room
        (so that path reports the right error), or the stripe lock was busy.

        Raises:
            EntryStolen: the entry is not ours any more (nothing changed).
        """
        cache = self._cache
        if stored <= cache.small_max:
            with cache.chunk_lock:  # until the entry names the chunk (see cache.py)
                rec, off = cache.carve(stored)
                if rec:
                    return self._fast_insert(key, kb, idx, gen, h, b, stripe, kind, stored, nbytes, nblobs, meta,
                                             enc, rec, off, L.FLAG_IN_CHUNK)
        try:
            rec, off = self._memory.alloc_extent(key, idx, gen, stored, self.slot)
        except StorageFullError:
            return None
        return self._fast_insert(key, kb, idx, gen, h, b, stripe, kind, stored, nbytes, nblobs, meta, enc, rec,
                                 off, 0)

    def _fast_insert(self, key: str, kb: bytes, idx: int, gen: int, h: int, b: int, stripe: int, kind: int,
                     stored: int, nbytes: int, nblobs: int, meta: bytes | None,
                     enc: serialize.Encoded | _Stored | None,
                     rec: int, off: int, flags: int) -> tuple[Any, ...] | None:
        lay = self._lay
        try:
            data = None
            if enc is not None:
                if off + enc.size > self._prefault.populated and not flags & L.FLAG_IN_CHUNK:
                    self._prefault.ensure(off, enc.size, key)
                data = enc.src
            ctime = time.time()
            rc = self._fast.insert(self._meta_addr, lay.buckets, lay.entries, b, h, self.sid, kb,
                                   self._stripe_addrs[stripe], idx, gen, self.slot, off, stored, nbytes, ctime,
                                   rec, nblobs, kind, flags, L.WRITING if data is None else L.SEALED, meta,
                                   self._meta_addr + lay.stripe_stats(stripe), _MEMORY, data,
                                   self._arena_addr + off)
        except BaseException:  # maybe after the C call did it all (asynchronous): see give_up
            self.give_up(idx, gen)  # an extent of its own is named by the entry and goes with it
            raise
        if rc == 0:
            return idx, off, stored, ctime, stripe
        self._memory.unplace(idx, rec, flags)
        if rc == _fast_codes.STOLEN:
            raise EntryStolen
        if rc == _fast_codes.OWNER_DEAD:  # we hold the lock now and must repair it first
            self._stripes[stripe].recover_held()
        if rc == _fast_codes.BEING_WRITTEN:
            self._cache.entries.append((idx, gen))
            raise ObjectLockedError(f"{key!r} is being written by another writer", key)
        if rc == _fast_codes.EXISTS:
            self._cache.entries.append((idx, gen))
            raise ObjectExistsError(_EXISTS.format(key), key)
        return None

    def writable(self, off: int, size: int) -> np.ndarray:
        """Writable uint8 view of ``size`` arena bytes at ``off`` (for the writer only)."""
        return np.ndarray((size,), _U8, self._arena, off)

    def seal(self, idx: int, stripe: int | None = None) -> None:
        """Make a reserved entry visible (the lock orders the data before the state)."""
        if stripe is None:
            stripe = self._table.stripe_of(idx)
        if self._fast is not None:
            state = self._meta_addr + L.entry_state_offset(self._lay.entry(idx))
            rc = self._fast.set_byte(self._stripe_addrs[stripe], state, L.SEALED)
            if rc == 0:
                return
            if rc == _fast_codes.OWNER_DEAD:
                self._stripes[stripe].recover_held()
        with self._stripes[stripe]:
            L.ENTRY_HEAD.set(self._buf, self._lay.entry(idx), "state", L.SEALED)  # ``writer`` matters only writing

    def replace(self, key: str, kb: bytes, idx: int, stripe: int) -> None:
        """Seal overwrite entry ``idx`` in place of whatever ``key`` holds, in one chain store.

        The old object is hidden and freed like a delete: views of it stay
        valid until dropped. A get never finds the key missing meanwhile; a
        process killed at any step leaves either object answering, never
        neither (see :meth:`Table.replace`).

        Raises:
            ObjectLockedError: a plain put of ``key`` is being written (ours is dropped).
        """
        buf, lay, table = self._buf, self._lay, self._table
        h = _crc32(kb, self.sid)
        b = h & self._bmask
        eoff = lay.entry(idx)
        with self._stripes[stripe]:
            old, _, e = find_entry(buf, lay, b, h, self.sid, kb)
            if e is not None and e[L.E_STATE] == L.WRITING:
                self.node.release(idx, cache=self._cache)
                raise ObjectLockedError(f"{key!r} is being written by another writer", key)
            L.ENTRY_HEAD.set(buf, eoff, "flags", L.ENTRY_HEAD.get(buf, eoff, "flags") & ~L.FLAG_SHADOW)
            L.ENTRY_HEAD.set(buf, eoff, "state", L.SEALED)
            if e is None:
                table.link(idx, b)
                return
            table.replace(old, idx, b)
            if e[L.E_STATE] == L.SEALED:  # (a deleted one still linked: a delete was killed half way)
                table.mark_deleted(old)
            if not table.pin_count(old) and not e[L.E_FLAGS] & L.FLAG_MOVING:  # else: last pin / mover
                self.node.release(old, cache=self._cache)

    def give_up(self, idx: int, gen: int, blocking: bool = True) -> bool:
        """Drop entry ``idx`` (generation ``gen``) of a put of this client cut short by an exception, whatever
        step it reached: reserved (back to this client's batch, or freed with the space it names), being
        written (out of its chain, freed), or neither (a repair or another client has it now: nothing to do).

        The exception may be asynchronous and come at any instruction, even right after a step the
        caller did not see finish (a C call's result it never stored): so this reads where the entry
        is instead of trusting the caller's notion.

        With ``blocking=False`` (a finalizer: a writer dropped unsealed, which the garbage collector may
        run inside a locked section of this very thread) it waits for no lock: where one it needs is
        taken, maybe by this thread, it changes nothing and returns False (the caller defers it to this
        process's next verb). Blocking there would wait for itself for the whole lock timeout, and
        then leave the entry half dropped.

        Returns:
            False where it changed nothing for want of a lock (``blocking=False`` only), else True.
        """
        lock = self.node.stripe_of(idx)
        if blocking:
            with lock:
                return self._give_up_locked(idx, gen, True)
        if not lock.acquire(blocking=False):
            return False
        try:  # as the context manager does, in this frame: nothing can come between the acquire and the try
            return self._give_up_locked(idx, gen, False)
        except BaseException as exc:
            lock.abandon(exc)
            raise
        finally:
            lock.release()

    def _give_up_locked(self, idx: int, gen: int, blocking: bool) -> bool:
        """:meth:`give_up` with the entry's stripe lock held."""
        buf, eoff, table = self._buf, self._lay.entry(idx), self._table
        e = L.entry_raw(buf, eoff)
        if e[L.E_GEN] != gen or e[L.E_WRITER] != self.slot or e[L.E_STATE] not in (L.RESERVED, L.WRITING):
            return True
        if e[L.E_STATE] == L.RESERVED and not e[L.E_EXTENT]:
            self._cache.entries.append((idx, gen))
            return True
        b = table.bucket_of(idx)
        linked = e[L.E_STATE] == L.WRITING and table.unlink(idx, b)
        try:
            done = self.node.release(idx, blocking, cache=self._cache)  # False: the ALLOC lock is taken
        except ShmStoreError:  # the ALLOC lock stayed taken for its timeout: raised on purpose, so the
            if linked:         # stripe's repair will not run, and the entry must be whole again
                table.link(idx, b)
            raise
        if not done and linked:
            table.link(idx, b)  # as it was (a chain's order means nothing)
        return done

    def abort(self, idx: int) -> None:
        """Drop a reserved entry and give its space back."""
        with self.node.stripe_of(idx):
            self._table.unlink(idx, self._table.bucket_of(idx))
            self.node.release(idx, cache=self._cache)

