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

Views: ``get`` pins the object (this process's pin byte, set under the
stripe lock) and returns a read-only :class:`~shmstore.SharedArray` for an
array, or values hanging off a :class:`~shmstore.node.views.Lease` over the
object's bytes; their finalizer unpins. A delete only hides a pinned object;
its space is reused once the last view is gone.
"""
from __future__ import annotations

import os
import reprlib
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np

from ..errors import (
    InvalidArgumentError,
    InvalidKeyError,
    ObjectNotFoundError,
    ShmStoreError,
    SpillError,
    StorageFullError,
    StoreClosedError,
)
from ..meta import fastpath
from ..meta import layout as L
from ..meta.fastpath import codes as _codes
from ..meta.keyref import KeyRef, key_ref
from ..meta.keys import encode_key
from ..meta.table import find_entry
from ..node import serialize
from ..node.janitor import release_all
from ..node.nodestore import NodeStore
from ..node.supplies import ClientSupply
from ..node.views import Lease, SharedArray, pin_token
from ..primitives.interrupts import guard as _guard_signals
from ..units import format_size
from ..values import Level, ObjectInfo
from .batches import Batches
from .pins import ATIME_GRAIN, Pins
from .puts import Puts
from .state import ClientState

__all__ = ["Kernel", "Exported", "Located", "encode_key", "NO_DEFAULT", "check_get_args"]

if TYPE_CHECKING:
    pass

_U8 = np.dtype(np.uint8)
_DTYPES: dict[bytes, np.dtype] = {}
_KERNELS: weakref.WeakSet[Kernel] = weakref.WeakSet()  # every open kernel of this process


def _after_fork_in_child() -> None:
    """In a forked child, every kernel it inherited is its parent's: see :meth:`Kernel._inherited`."""
    for k in list(_KERNELS):
        k._inherited()


os.register_at_fork(after_in_child=_after_fork_in_child)
_MEMORY = int(Level.MEMORY)
_RAW = L.KIND_RAW
NO_DEFAULT: Any = object()  # get's default: raise ObjectNotFoundError on a miss
_INDEX_TYPES = frozenset((slice, tuple, type(Ellipsis)))  # a default of these may be conditions by position
_MISS = object()   # _get_fast's answer for a key with no object
_ARRAY_CACHE = 65536  # (dtype, shape, order) of arrays this process got recently
_monotonic = time.monotonic
# a named tuple from a raw one in one C call (the lookup is on get's path)
_new = tuple.__new__
_fast: Any = fastpath.load()  # the C helper (no stubs), or None


def _dtype(raw: bytes) -> np.dtype:
    dt = _DTYPES.get(raw)
    if dt is None:
        dt = _DTYPES[raw] = np.dtype(raw.rstrip(b"\0").decode())
    return dt


class Exported(NamedTuple):
    """An object as :meth:`Kernel.export` hands it to another node: its kind, size, blob count and
    ENTRY_ARRAY bytes (arrays, else None), and either its stored bytes ``inline`` (small objects) or a
    ``lease`` over them (a host or device view holding the object's pin until dropped), else None."""
    kind: int
    nbytes: int
    nblobs: int
    array_meta: bytes | None
    inline: bytes | None
    lease: Any


class Located(NamedTuple):
    """A sealed entry as :meth:`Kernel.lookup` found it: its index, its ENTRY_HEAD and, for an array,
    (dtype, shape, order), else None."""
    idx: int
    entry: L.Entry
    array: tuple[Any, ...] | None


class Kernel:
    """One client's verbs on one node store and session; never waits.

    Owns its client slot (given back by ``close``), its pins (:class:`Pins`)
    and its put side (:class:`Puts`), but not the node store's segments.
    Process-safe through the store's locks; thread-safe. Not usable in a
    child after ``fork``: connect again there.
    """

    _closed = True
    _detached = True

    def __init__(self, node: NodeStore, slot: int, session: str,
                 on_detach: Callable[[int], None] | None = None) -> None:
        self.node = node
        self._on_detach = on_detach
        self.slot = slot
        self.session = session
        self._supply = ClientSupply(node, slot)
        self.sid = _session_id(node, session)
        self._state = state = ClientState(node, slot, self.sid, session, self._supply, _fast)
        self.pins = Pins(state, self._detach)
        self.puts = Puts(state)
        self.batches = Batches(state, self.puts, self.pins, self._not_found)
        self._pins = self.pins.counts  # the hot paths read these directly
        self._deferred = self.pins.deferred
        self._release = self.pins.release
        self._ctx = self.pins.ctx
        self._buf, self._lay, self._table, self._stripes = state.buf, state.lay, state.table, state.stripes
        self._bmask, self._smask, self._ro, self._fast = state.bmask, state.smask, state.ro, _fast
        self._arrays: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._devices = node.devices  # the levels whose values are device arrays (get branches on them)
        self.writers: weakref.WeakSet[Any] = weakref.WeakSet()  # open Writers, aborted by close()
        # True in a child forked after this kernel was made: it is the parent's (the Store reconnects); a plain
        # attribute, set at the fork (_inherited), as every verb looks at it
        self.forked = False
        self._closed = self._detached = False
        _KERNELS.add(self)

    def retire_chunk(self) -> bool:
        """Give up this client's current chunk for small objects (freed where empty): a large object found
        no room in memory (see ``ClientSupply.retire_current``). True if there was one."""
        if self._closed or self.forked:
            return False
        return self._supply.retire_current()

    def _inherited(self) -> None:
        """Run in a forked child (at the fork): the slot, its pins and its writers' entries are the parent's,
        released by the parent only. The child's copies of views, readers and writers let go of nothing
        (a child dropping its copy of a view cleared the parent's pin byte: the parent's view was left
        unpinned, free to be deleted or moved under it)."""
        self.forked = True
        self.pins.closed = True
        self.pins.deferred.clear()
        self.puts.inherited = True

    # ---- the put side: Puts does the work (writers and transfers use ``kernel.puts``) -------------
    def put(self, key: str, obj: Any, level: Level = Level.MEMORY, overwrite: bool = False) -> ObjectInfo:
        """Store ``obj`` under ``key`` on ``level``, at once or not at all.

        With ``overwrite``, an object already under ``key`` is replaced
        atomically: a get finds the old object until the new one is sealed,
        the new one after, never neither; views of the old one stay valid
        until dropped.

        Raises:
            ObjectExistsError: the key is present (and not ``overwrite``).
            ObjectLockedError: it is being written.
            StorageFullError: no room on the level, at once.
            SerializationError, InvalidKeyError: bad input; nothing changes.
        """
        return self.puts.put(self.begin(key), obj, level, overwrite)

    def give_up(self, idx: int, gen: int, blocking: bool = True) -> None:
        """Drop this client's unsealed entry ``idx`` of generation ``gen`` (a no-op if it is not that any
        more). With ``blocking=False`` (a finalizer: it may run inside a locked section of this very
        thread) it waits for no lock, and what it could not do this process's next verb does."""
        if not self.puts.give_up(idx, gen, blocking):
            self._deferred.append((idx, gen))

    # ---- sessions and checks ----------------------------------------------
    def session_name(self, sid: int) -> str:
        return self.session if sid == self.sid else (L.unpack_session(self._buf, self._lay.session(sid)) or "")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the constructor never finished)."""
        return self._closed

    def check_open(self) -> None:
        """Raise :class:`StoreClosedError` where this connection cannot be used (closed, or opened before
        ``fork()``); frees the pins whose views died meanwhile."""
        if self._closed:
            raise StoreClosedError("store is closed (connect() again)")
        if self.forked:
            raise StoreClosedError("store was opened before fork(); connect() again in the child")
        self.pins.free_deferred(self.puts.give_up)

    def begin(self, key: str) -> KeyRef:
        """The key's reference in this session (its bytes, hash, bucket and stripe), after the checks every
        verb makes (cheap when all is well): what a verb, a writer or a transfer starts with.

        Raises:
            InvalidKeyError: not a valid key. StoreClosedError: the store is closed, or this is a forked child.
        """
        # a signal from here on waits for the verb to finish (see interrupts.py)
        _guard_signals()
        kb = encode_key(key)
        if self._closed or self._deferred or self.forked:
            self.check_open()
        return key_ref(key, kb, self.sid, self._bmask, self._smask)

    def _not_found(self, key: str, what: str = "", hint: bool = True) -> ObjectNotFoundError:
        """The miss of ``key``, naming the sessions that do hold it (looked up here, unless not ``hint``: a
        raising miss pays for it, about 5 us with one other session, never a hit or a get with a default)."""
        where = f" in session {self.session!r}" if self.session else ""
        return ObjectNotFoundError(f"no object {key!r}{what}{where}{self._held_hint(key) if hint else ''}", key)

    def sessions_holding(self, key: str) -> list[str]:
        """The other sessions of this store holding a sealed object under ``key`` (one chain walk per session
        in use, each under its stripe lock: the price of a miss, never of a hit)."""
        try:
            kb = encode_key(key)
        except InvalidArgumentError:
            return []
        out = []
        for sid, name in L.sessions_in_use(self._buf, self._lay):
            if sid == self.sid:
                continue
            ref = key_ref(key, kb, sid, self._bmask, self._smask)
            with self._stripes[ref.stripe]:
                _, eoff, raw = find_entry(self._buf, self._lay, ref.bucket, ref.h, sid, kb)
                if raw is not None and raw[L.E_STATE] == L.SEALED:
                    out.append(name)
        return out

    def _held_hint(self, key: str) -> str:
        try:
            held = self.sessions_holding(key)
        except ShmStoreError:  # a hint never turns a miss into another error (a lock timeout)
            return ""
        if not held:
            return ""
        names = ", ".join(repr(n) for n in held[:8]) + (", ..." if len(held) > 8 else "")
        return (f" (session{'s' if len(held) > 1 else ''} {names} hold{'' if len(held) > 1 else 's'} it: "
                f"connect(session={held[0]!r}) to read it)")

    # ---- get --------------------------------------------------------------
    def lookup(self, ref: KeyRef, pin: bool) -> Located:
        """Find the sealed entry of ``ref``'s key (see :meth:`begin`); pin it for this process if ``pin``.

        Raises:
            ObjectNotFoundError: no sealed object has this key.
        """
        buf, key, stripe = self._buf, ref.key, ref.stripe
        # C: lock, walk, pin, touch, unlock; the pin keeps the entry still after
        if pin and _fast is not None:
            r = _fast.get_entry(self._ctx, key)
            if type(r) is tuple:
                return self._pinned(r[0], r[6], L.entry_raw(buf, r[6]))
            if r == _codes.MISSING:
                raise self._not_found(key)
        with self._stripes[stripe]:
            idx, eoff, raw = find_entry(buf, self._lay, ref.bucket, ref.h, self.sid, ref.kb)
            e: L.Entry | None = None if raw is None else _new(L.Entry, raw)
            if e is not None and e.state == L.SEALED:
                if not pin:
                    return _new(Located, (idx, e, self._array(idx, eoff, e.kind, e.gen)))
                self.pins.up(idx)
            else:
                e = None
        if e is None:
            raise self._not_found(key)  # outside the lock: it looks at the other sessions' stripes
        return self._pinned(idx, eoff, e)

    def _pinned(self, idx: int, eoff: int, e: tuple[Any, ...]) -> Located:
        """The rest of a pinning lookup, without the lock: the pin keeps the entry as it is."""
        entry: L.Entry = _new(L.Entry, e)
        now = _monotonic()
        if now - entry.atime > ATIME_GRAIN:  # LRU needs no finer clock than this
            L.ENTRY_HEAD.set(self._buf, eoff, "atime", now)
        return _new(Located, (idx, entry, self._array(idx, eoff, entry.kind, entry.gen)))

    def _array(self, idx: int, eoff: int, kind: int, gen: int) -> tuple[Any, ...] | None:
        """(dtype, shape, order) of an ndarray entry, else None."""
        if kind != L.KIND_NDARRAY:
            return None
        # objects never change once sealed: (index, generation) names this array for good
        array = self._arrays.get((idx, gen))
        if array is None:
            a = L.entry_array_raw(self._buf, eoff)
            array = (_dtype(a[0]), a[3:3 + a[1]], "F" if a[2] else "C")
            if len(self._arrays) >= _ARRAY_CACHE:
                self._arrays.clear()
            self._arrays[(idx, gen)] = array
        return array

    def get(self, key: str, default: Any = NO_DEFAULT, *misuse: Any, conditions: Any = None) -> Any:
        """The value of ``key``: zero-copy read-only views for arrays and bytes; ``default`` where there is
        none, if given (dict semantics: ``get(key, default)``; a cluster's get passes one, for which a miss is
        the start of a fetch, not an error). ``conditions`` is keyword-only (see :func:`check_get_args`).

        Raises:
            ObjectNotFoundError: no sealed object has this key (and no ``default``).
            InvalidArgumentError: ``conditions`` on a value that is not an array; a third positional argument,
                or a ``default`` that is an index (``conditions`` passed by position, as before they were
                keyword-only).
        """
        if misuse or (default is not NO_DEFAULT and type(default) in _INDEX_TYPES):
            check_get_args(key, default, misuse)
        _guard_signals()
        if _fast is not None and type(key) is str and not self._closed and not self._deferred \
                and not self.forked:
            obj = self._get_fast(key)  # the hot path: a small array in memory
            if obj is _MISS:
                if default is NO_DEFAULT:
                    raise self._not_found(key)
                return default
            if obj is not None:
                return obj if conditions is None else apply_conditions(key, obj, conditions)
        ref = self.begin(key)
        try:
            idx, e, array = self.lookup(ref, True)
        except ObjectNotFoundError:
            if default is NO_DEFAULT:
                raise
            return default
        if e.level in self._devices:
            obj = self._device_value(idx, e, array)
        elif array is not None:
            obj = self.lease(idx, e, array)  # the array itself holds the pin: one numpy object
        else:
            obj = serialize.decode(e.kind, self.lease(idx, e), e.nbytes)
        return obj if conditions is None else apply_conditions(key, obj, conditions)

    def _device_value(self, idx: int, e: L.Entry, array: tuple[Any, ...] | None) -> Any:
        """The value of an object on a device level (pinned by the caller): a device array over the shared
        allocation, whose memory owner holds the pin."""
        level = self._devices[Level(e.level)]
        token = pin_token(self._release, idx, e.gen)  # dropped on failure: its finalizer unpins
        key = L.entry_key(self._buf, self._lay.entry(idx), e.keylen).decode(errors="replace")  # for messages
        try:
            return level.value(e, array, token, key)
        except OSError as exc:  # its arena is gone (lost with the spill process that held it)
            raise SpillError(f"cannot read {key!r} on {level.level}: {exc}", key) from exc

    def _get_fast(self, key: str) -> Any:
        """``get`` of an array or raw bytes in memory through the C fast path: one C call finds, pins and
        touches the entry (the steps of lookup and _pinned); ``_MISS`` where the key has no
        object; None for anything else, which then goes the general way."""
        r = _fast.get_entry(self._ctx, key)
        if type(r) is not tuple:
            if r == _codes.MISSING:
                return _MISS
            return None
        idx, gen, off, level, nbytes, kind, eoff = r
        try:
            if kind == _RAW and level == _MEMORY and nbytes:  # raw bytes: a read-only memoryview, as decode makes
                lease = np.ndarray.__new__(Lease, (nbytes,), _U8, self._ro, off)
                view = lease.data
            else:
                lease = None
                array = self._arrays.get((idx, gen)) or self._array(idx, eoff, kind, gen)
                if array is None or level != _MEMORY or not nbytes:
                    self._release(idx, gen)  # not the hot case: undo the pin, go the general way
                    return None
                obj = np.ndarray.__new__(SharedArray, array[1], array[0], self._ro, off, None, array[2])
        except BaseException:  # a damaged record: the pin goes with the error (see lease)
            self._release(idx, gen)
            raise
        if lease is not None:
            lease._release = (self._release, idx, gen)  # (set last: from here on the view's death releases)
            return view
        obj._release = (self._release, idx, gen)
        return obj

    def lease(self, idx: int, e: L.Entry, array: tuple[Any, ...] | None = None) -> np.ndarray:
        """Read-only view of entry ``idx`` (pinned by the caller) that unpins with its last view.

        Its bytes as a :class:`Lease`, or with ``array = (dtype, shape,
        order)`` the stored array as a :class:`SharedArray`. A DISK object is
        mapped from its file: a slice reads only the pages it touches; a device
        object (an open reader of one) is copied to the host. If the view
        cannot be made, the pin is given back, whatever the error.

        Raises:
            SpillError: the object's file cannot be mapped, or is shorter than the object.
        """
        n, gen = e.nbytes, e.gen
        view: Lease | SharedArray
        try:
            buf, off = self._lease_buffer(idx, e)
            if array is None:
                view = np.ndarray.__new__(Lease, (n,), _U8, buf, off)
            else:
                view = np.ndarray.__new__(SharedArray, array[1], array[0], buf, off, None, array[2])
        # whatever it was (a damaged record, a device error, Ctrl-C): no view holds the pin
        except BaseException:
            self._release(idx, gen)
            raise
        view._release = (self._release, idx, gen)
        return view

    def _lease_buffer(self, idx: int, e: L.Entry) -> tuple[Any, int]:
        """(buffer, offset) of the bytes of pinned entry ``idx``, for numpy: the arena, a mapping of a spill file,
        or a host copy of a device object (numpy cannot read device memory: CuPy refuses the buffer protocol)."""
        n = e.nbytes
        if e.level == _MEMORY or n == 0:
            return self._ro, e.offset if n else 0
        level = Level(e.level)
        device = self._devices.get(level)
        try:
            buf, off = self.node.levels[level].view(idx, e.gen, e.offset, n)
        except OSError as exc:
            raise SpillError(f"cannot read {self._key_of(idx, e)!r} ({format_size(n)}, entry {idx}) on {level}: "
                             f"{exc}") from exc
        except ValueError as exc:  # a file's mapping: "mmap length is greater than file size"
            if device is not None:
                raise
            raise SpillError(f"cannot read {self._key_of(idx, e)!r} ({format_size(n)}, entry {idx}) on {level}: "
                             f"its file is shorter ({exc}): it was truncated or replaced, the object is lost "
                             f"(delete it)") from exc
        if device is not None:  # an open reader of a device object: it reads a host copy
            return device.host_bytes(buf[off: off + n]), 0
        return buf, off

    def _key_of(self, idx: int, e: L.Entry) -> str:
        """The key of pinned entry ``idx`` (for messages)."""
        return L.entry_key(self._buf, self._lay.entry(idx), e.keylen).decode(errors="replace")

    def read_small(self, key: str, max_bytes: int) -> tuple[int, int, int, bytes | None, bytes] | None:
        """(kind, nbytes, nblobs, ENTRY_ARRAY bytes of an array else None, the stored bytes) of a MEMORY
        object of at most ``max_bytes``, copied in one C call under its stripe lock (no pin, no lease: what a
        node service sends for a remote read of a small object); None where the general way must do it
        (larger, on another level, no C extension, a busy lock).

        Raises:
            ObjectNotFoundError: no sealed object has this key.
        """
        if _fast is None or type(key) is not str or self._closed or self._deferred or self.forked \
                or not hasattr(_fast, "read_small"):
            return None
        r = _fast.read_small(self._ctx, key, max_bytes, self._state.arena_addr, _MEMORY, L.KIND_NDARRAY,
                             L.ENTRY_ARRAY.struct.size)
        if type(r) is tuple:
            return r
        if r == _codes.MISSING:
            raise self._not_found(key, hint=False)  # a node service's lookup for another node: no one reads it
        return None

    def copy_pinned(self, idx: int, e: L.Entry) -> bytes:
        """The bytes of entry ``idx`` (pinned by the caller, in MEMORY), copied out; the pin is dropped: a
        small object sent inside a message, without a lease to build and collect."""
        try:
            off, n = e.offset, e.nbytes
            return bytes(self._ro[off: off + n]) if n else b""
        finally:
            self._release(idx, e.gen)

    # ---- export: an object as another node receives it ---------------------
    def export(self, key: str, inline_max: int) -> Exported:
        """``key`` as a node service sends it to another node: the stored bytes themselves where there are at
        most ``inline_max`` of them (copied out, nothing left pinned), else a lease over them (host or device
        memory, pinned until the lease is dropped) to send as frames.

        Raises:
            ObjectNotFoundError: no sealed object has this key.
        """
        small = self.read_small(key, inline_max)  # the usual case: one C call, no pin
        if small is not None:
            kind, nbytes, nblobs, array, data = small
            return Exported(kind, nbytes, nblobs, array, data, None)
        idx, e, _ = self.lookup(self.begin(key), True)
        kind, nbytes, nblobs = e.kind, e.nbytes, e.nblobs
        array = L.entry_array_bytes(self._buf, self._lay.entry(idx)) if kind == L.KIND_NDARRAY else None
        if nbytes <= inline_max and e.level == _MEMORY:  # the usual small case
            return Exported(kind, nbytes, nblobs, array, self.copy_pinned(idx, e), None)
        device = self._devices.get(Level(e.level))
        if device is not None:  # a device array holding the pin; small ones come to the host
            lease = device.export(e, pin_token(self._release, idx, e.gen))
            if nbytes <= inline_max:
                return Exported(kind, nbytes, nblobs, array, device.host_bytes(lease), None)
            return Exported(kind, nbytes, nblobs, array, None, lease)
        lease = self.lease(idx, e)
        if nbytes <= inline_max:  # small, on another level: copied out of the lease
            return Exported(kind, nbytes, nblobs, array, bytes(lease.tobytes()), None)
        return Exported(kind, nbytes, nblobs, array, None, lease)

    # ---- batches: each stripe's lock taken once per step, not once per key (see batches.py) --------
    def put_many(self, items: Sequence[tuple[str, Any]], level: Level = Level.MEMORY,
                 overwrite: bool = False) -> list[ObjectInfo]:
        """Store each (key, value) of ``items`` (distinct keys) on ``level``: all of them, or none.

        Raises:
            ObjectExistsError, ObjectLockedError, StorageFullError (no room for the whole batch, at once),
            SerializationError, InvalidKeyError: naming the key; nothing is stored.
        """
        refs = [self.begin(key) for key, _ in items]
        return self.batches.put_many(refs, [obj for _, obj in items], level, overwrite)

    def get_many(self, keys: Sequence[str]) -> list[Any]:
        """The values of ``keys``, as :meth:`get` returns them, looked up under one hold of each stripe lock.

        Raises:
            ObjectNotFoundError: a key has no object (the first missing one); nothing stays pinned.
        """
        found = self.batches.lookup_many([self.begin(key) for key in keys])
        out: list[Any] = []
        try:
            for idx, eoff, e in found:
                located = self._pinned(idx, eoff, e)
                out.append(self._value(*located))
        except BaseException:
            for idx, _, e in found[len(out) + 1:]:  # not made into values: unpinned here
                self._release(idx, e.gen)
            raise
        return out

    def _value(self, idx: int, e: L.Entry, array: tuple[Any, ...] | None) -> Any:
        """The value of pinned entry ``idx``, holding the pin (as :meth:`get` makes it)."""
        if e.level in self._devices:
            return self._device_value(idx, e, array)
        if array is not None:
            return self.lease(idx, e, array)  # the array itself holds the pin: one numpy object
        return serialize.decode(e.kind, self.lease(idx, e), e.nbytes)

    def delete_many(self, keys: Sequence[str], missing_ok: bool = False) -> list[str]:
        """Delete every key of ``keys`` under one hold of each stripe lock; the keys deleted.

        Raises:
            ObjectNotFoundError: a key has no object (unless ``missing_ok``): the batch stops there, the keys
                deleted before it listed in ``exc.done``.
        """
        return self.batches.delete_many([self.begin(key) for key in keys], missing_ok)

    # ---- delete / query ---------------------------------------------------
    def delete(self, key: str, missing_ok: bool = False, version: float | None = None) -> None:
        """Hide ``key`` at once; its space is freed when the last pin goes. With ``version`` (the object's
        creation time, ``ObjectInfo.created``: what tells one object under a key from the next on a node) only
        that very object: a newer one under the key stays (like a missing key, it counts as missing).

        Raises:
            ObjectNotFoundError: no such object (unless ``missing_ok``).
        """
        if version is None and _fast is not None and type(key) is str and not self._closed and not self._deferred \
                and not self.forked:
            r = _fast.delete(self._ctx, key)  # the steps below in one C call, where they are the common ones
            if type(r) is tuple:
                self._supply.entries.append(r)  # (as node.release does for an entry cut from a chunk)
                return
            if r == 1:
                return
            if r == _codes.MISSING:
                if missing_ok:
                    return
                raise self._not_found(key, " to delete")
        ref = self.begin(key)
        b = ref.bucket
        with self._stripes[ref.stripe]:
            idx, eoff, found = find_entry(self._buf, self._lay, b, ref.h, self.sid, ref.kb)
            e = None if found is None else L.entry(self._buf, eoff)
            missing = e is None or e.state != L.SEALED or (version is not None and version != e.ctime)
            if e is not None and not missing:
                # hidden first, then out of its chain: killed in between, it is a deleted entry in a
                # chain, which the stripe's repair unlinks; never a sealed entry out of every chain
                self._table.mark_deleted(idx)
                self._table.unlink(idx, b)
                if not self._table.pin_count(idx) and not e.flags & L.FLAG_MOVING:  # else: last pin / mover
                    self.node.release(idx, supply=self._supply)
        if missing and not missing_ok:
            raise self._not_found(key, " to delete")  # outside the lock: it looks at the other sessions' stripes

    def contains(self, key: str) -> bool:
        """Whether ``key`` has a sealed object in this session: False for anything that cannot be a key (``123``,
        ``""``), as ``123 in {}`` is (issue 30 item 11: it raised InvalidKeyError).

        Raises:
            StoreClosedError: the store is closed, or this is a forked child.
        """
        if _fast is not None and type(key) is str and not self._closed and not self._deferred \
                and not self.forked and hasattr(_fast, "has"):
            r = _fast.has(self._ctx, key)  # one C call, no pin: what a fetch asks first
            if r == 1 or r == 0:
                return bool(r)
        try:
            ref = self.begin(key)
        except InvalidKeyError:
            if self._closed or self.forked:
                self.check_open()  # a closed store says so, whatever the key
            return False
        with self._stripes[ref.stripe]:
            _, eoff, found = find_entry(self._buf, self._lay, ref.bucket, ref.h, self.sid, ref.kb)
            return found is not None and L.entry(self._buf, eoff).state == L.SEALED

    def info(self, key: str) -> ObjectInfo:
        """ObjectInfo of ``key``.

        Raises:
            ObjectNotFoundError: no such object.
        """
        idx, e, _ = self.lookup(self.begin(key), False)
        return self._info(key, e, self._table.pin_count(idx))

    def _info(self, key: str, e: L.Entry, pins: int) -> ObjectInfo:
        return ObjectInfo(key, e.nbytes, Level(e.level), pins > 0, e.state == L.SEALED, e.nblobs,
                          serialize.KIND_NAMES[e.kind], e.size, pins, self.session_name(e.session), e.ctime)

    def list(self, level: Level | None = None, all_sessions: bool = False, hidden: bool = False) -> list[ObjectInfo]:
        """Sealed objects of this session (or all), optionally on one level. Keys that begin with ``"\\x00"``
        (a checkpoint's copies: ``shmstore.persist.plans.hidden``) are left out unless ``hidden``; with it,
        only they are listed."""
        self.check_open()
        t = L.entry_table(self._buf, self._lay)
        mask = t["state"] == L.SEALED
        if not all_sessions:
            mask &= t["session"] == self.sid
        if level is not None:
            mask &= t["level"] == int(level)
        pins = self._table.pin_counts(len(t))
        out = []
        for idx in np.flatnonzero(mask):
            eoff = self._lay.entry(int(idx))
            e = L.entry(self._buf, eoff)
            if e.state == L.SEALED:
                raw = L.entry_key(self._buf, eoff, e.keylen)
                if raw.startswith(b"\x00") != hidden:
                    continue
                out.append(self._info(raw.decode(errors="replace"), e, int(pins[idx])))
        return out

    # ---- pins ------------------------------------------------------------------
    def pin(self, key: str) -> None:
        """Pin ``key`` (counted): spill never moves it until as many ``unpin``.

        Raises:
            ObjectNotFoundError: no such object.
        """
        ref = self.begin(key)
        idx, e, _ = self.lookup(ref, True)
        self.pins.add_explicit(ref.kb, idx, e.gen)

    def unpin(self, key: str) -> None:
        """Undo one ``pin`` of ``key`` by this process.

        Raises:
            InvalidArgumentError: this process holds no pin on ``key``.
        """
        held = self.pins.drop_explicit(self.begin(key).kb)
        if held is None:
            raise InvalidArgumentError(f"{key!r} is not pinned by this process")
        self.pins.release(*held)

    # ---- lifecycle --------------------------------------------------------
    def close(self) -> bool:
        """Release explicit pins and detach; idempotent.

        Returns:
            True if detached now, False if live views still pin objects (the
            slot is given back when the last one is garbage collected).
        """
        if self._closed:
            return self._detached
        self._closed = True
        if self.forked:
            self._detached = True  # the parent owns the slot
            return True
        for writer in list(self.writers):  # unsealed: dropped, as after any error
            writer.abort()
        self.pins.release_explicit()
        if self.pins.counts:
            self.pins.detach_when_idle = True
            return False
        self._detach()
        return True

    def _detach(self) -> None:
        self._detached = True
        self._supply.forget()
        release_all(self.node, self.slot)  # all this slot holds, as for a dead client (see release_all)
        self.pins.close()
        remaining = self.node.deregister(self.slot)
        if self._on_detach is not None:  # the Store closes its mappings
            self._on_detach(remaining)


def _session_id(node: NodeStore, name: str) -> int:
    """The id of session ``name`` in ``node`` (registered if new)."""
    buf, lay = node.buf, node.layout
    with node.admin:
        free = -1
        for sid in range(L.MAX_SESSIONS):
            have = L.unpack_session(buf, lay.session(sid))
            if have == name:
                return sid
            if have is None and free < 0:
                free = sid
        if free < 0:
            raise StorageFullError(f"store has all {L.MAX_SESSIONS} sessions in use (reuse session names)")
        L.pack_session(buf, lay.session(free), name)
        return free


def check_get_args(key: str, default: Any, misuse: tuple[Any, ...]) -> None:
    """Refuse what a get's positional arguments meant before ``conditions`` and ``levels`` became keyword-only:
    a third positional argument, or a second one that is an index (a slice, ``...``, or a tuple holding one),
    which ``get(key, (slice(0, 10),))`` passed as ``conditions`` and would now silently be the default.

    Raises:
        InvalidArgumentError: either of those.
    """
    if not misuse and not _is_index(default):
        return
    given = ", ".join(reprlib.repr(a) for a in (default, *misuse))
    raise InvalidArgumentError(f"get({key!r}, {given}): conditions= and levels= are keyword-only; for a default "
                               f"use default= (get(key, default) returns default only where key is missing)")


def _is_index(value: Any) -> bool:
    if type(value) is tuple:
        return any(type(v) is slice or v is Ellipsis for v in value)
    return type(value) is slice or value is Ellipsis


def apply_conditions(key: str, obj: Any, conditions: Any) -> Any:
    """``obj[conditions]`` for arrays; an error for anything else."""
    if not isinstance(obj, np.ndarray) and not hasattr(obj, "__cuda_array_interface__"):
        raise InvalidArgumentError(f"conditions apply to arrays; {key!r} holds a {type(obj).__name__}")
    try:
        return obj[conditions]
    except (IndexError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"bad conditions for {key!r} (shape {obj.shape}): {exc}") from None
