"""The GPU level: one device allocation per GPU, shared by every process of the node through CUDA IPC.

How it works:

- **One arena per device**, made on first use by the node's spill process
  (one per node, spawned, long-lived): ``cudaMalloc`` of ``gpu_capacity``
  (default: half the device's free memory), its ``cudaIpcMemHandle_t``
  recorded in the metadata (``GPU_ARENA`` slot ``s``), the arena's free
  space added to the store's allocator as a range of its own (offsets from
  ``(s + 1) << 44``). A slot names its device by a key that is the same in
  every process (``GPU_ARENA.uuid``, see ``gpumaps.py``), never by a CUDA
  ordinal, which depends on each process's ``CUDA_VISIBLE_DEVICES``; each
  process maps the key to its own ordinal. A client claims the slot of its
  current device and asks for the arena with a request (``REQ_GPU``) and
  waits, like a request for room.
- **Clients open the handle once per process** (``cudaIpcOpenMemHandle``,
  shared by every store of the process and refcounted: ``gpumaps.py``) and cut
  objects from the arena with the same allocator, records and locks as the
  memory arena: the object table, pins, the janitor, crash repair and
  ``check()`` treat GPU objects like any other. Only copying bytes and
  making views needs CuPy and a device.
- ``get`` of a GPU object returns a CuPy array over the shared allocation
  (no copy; read-only by convention: CUDA has no read-only mappings, and a
  write changes the object under every reader). The array holds the
  object's pin, like a numpy view: spill never moves it meanwhile; and it
  holds the mapping: ``close()`` of the store unmaps only after the last
  such array is gone. When the array is collected, the device is
  synchronised before the pin goes (work queued on the view finishes
  before its space can be reused).
- Copies run on the current stream (``*_async`` on
  ``cupy.cuda.get_current_stream()``, after the work already queued on it)
  and that stream is synchronised before the object is sealed.
- Spill: GPU -> MEMORY -> DISK by the same spill process and rules.
- Zero-length objects never reach CUDA: no copy, no pointer; they come back
  as empty arrays.

The device memory belongs to the spill process: if that process dies, the
driver frees it, and the objects on it are lost (CUDA keeps no allocation
past its owner; MEMORY and DISK objects survive). Its successor marks the
arena lost, drops those objects (logging how many) and makes the arena
again on the next use; a spill process that exits does the same itself
before it frees the memory. A client that finds its arena lost lets its
mapping go.

CuPy is imported lazily, in ``levels/device.py`` only (extra ``gpu``).
Without it, without a device, in a process forked after CUDA started, or on
a device in an exclusive compute mode, the level reports itself unavailable
with the reason, and every other level works; CUDA's errors become
``DeviceError`` naming the device, the object and what to do. The metadata
operations (freeing, repair) never need CuPy.

The level is built from the store's ``LevelHost`` and a way to ask the spill
process for an arena (``request_arena``); the spill process builds it
without one, and then makes and owns the arenas itself (``make_arena``).
A client waits for that request in ``prepare``, before a put takes its
stripe lock, never in ``place`` under it: a client taking every stripe
(``check``) and a spill process busy under one of its stripes waited on
that put until a lock timeout.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import DeviceError, ShmStoreError, StorageFullError
from ..meta import layout as L
from ..meta.alloc import Allocator
from ..meta.table import EntryStolen, owns_entry
from ..node import serialize
from ..node.protocols import LevelHost, PutContext, RequestArena
from ..node.views import pin_token
from ..primitives.procs import pid_alive
from ..units import format_size
from ..values import Level
from .device import (
    DeviceSink,
    allocate_shared,
    copy_into,
    cuda_errors,
    cupy_or_reason,
    device_free,
    device_problem,
    device_source,
    ipc_close,
    ipc_open,
    is_device_array,
    need_cupy,
    settle,
    to_host,
)
from .gpuarena import STATE_NAMES, Arena, allocator, drop_dead_arenas, find_slot, ready_arenas, slot_for, slot_of
from .gpumaps import DeviceIds, Mapping, MappingRegistry, view_owner
from .memory import abort_arena_move, check_arena_objects, unplace_extent

if TYPE_CHECKING:
    from ..meta.keyref import Contents, KeyRef, Reservation
    from ..node.serialize import Encoded

__all__ = ["GpuLevel", "cupy_or_reason", "device_of", "is_device_array", "to_host", "pin_token", "DEFAULT_FRACTION",
           "DEVICES", "MAPPINGS"]

DEFAULT_FRACTION = 0.5  # of the device's free memory, for an arena whose size was not set
# how long an exiting owner keeps its arenas' allocations for views other processes still hold (seconds)
VIEWS_GRACE = 10.0
log = logging.getLogger(__name__)
DEVICES = DeviceIds(device_source)  # this process's devices by key: one list per process
MAPPINGS = MappingRegistry(ipc_open, ipc_close)  # this process's arena mappings: one per arena, every store shares
# the arena slot of an offset (a slot, not an ordinal: see gpuarena.py)
device_of = slot_of


def _no_settle(ordinal: int) -> None:
    """Nothing to wait for: the level's own arrays (writes, moves) synchronise before they are dropped."""


class GpuLevel:
    """Device memory of the node's GPUs (see :class:`~shmstore.node.protocols.DeviceLevel`).

    Built from the store's :class:`~shmstore.node.protocols.LevelHost` and
    owned by it; holds references to this process's mappings of the arenas
    (``MAPPINGS``, shared by every store of the process), and in the process
    built without ``request_arena`` (the spill process) the arenas' device
    allocations themselves. ``close`` lets its references go: a mapping is
    unmapped, an owned allocation freed, once no array handed out uses it.
    Process-safe through the store's locks; thread-safe.
    """

    level = Level.GPU
    spill_to: Level | None = Level.MEMORY
    setting = "gpu_capacity= / SHMSTORE_GPU_CAPACITY when creating the store"

    def __init__(self, host: LevelHost, request_arena: RequestArena | None = None) -> None:
        self.host = host
        self._request_arena = request_arena
        self._maps: dict[int, tuple[int, Mapping]] = {}  # slot -> (epoch, this level's reference)
        self._lock = threading.Lock()
        self.owner = request_arena is None  # this process makes and holds the allocations (the spill process)
        # the arena the mover's next move onto this level goes to (-1: this level chooses)
        self._aim = -1
        buf = host.buf
        self._store: Hashable = (bytes(L.HEAD.get(buf, "name")), L.HEAD.get(buf, "created"),
                                 L.HEAD.get(buf, "creator_pid"))

    # ---- where -------------------------------------------------------------------
    def available(self) -> str | None:
        cupy, why = cupy_or_reason()
        if cupy is None:
            return why
        try:
            d = self.device()
            return device_problem(d, DEVICES.name_of(d))
        except DeviceError as exc:
            return str(exc)

    def device(self) -> int:
        """This process's current CUDA device (0 without CuPy: metadata only)."""
        cupy, _ = cupy_or_reason()
        return int(cupy.cuda.Device().id) if cupy is not None else 0

    def _slot(self, claim: bool) -> int:
        """The arena slot of this process's current device (claimed if ``claim``); -1 where it has none."""
        if cupy_or_reason()[0] is None:
            return -1
        key = DEVICES.key_of(self.device())
        return slot_for(self.host, key, self.setting) if claim else find_slot(self.host, key)

    def local_arena(self) -> int:
        return self._slot(claim=True)

    def aim(self, slot: int) -> None:
        self._aim = slot if 0 <= slot < L.MAX_GPUS else -1

    def total(self) -> int:
        slot = self._slot(claim=False)
        g = L.unpack_gpu(self.host.buf, self.host.layout, slot) if slot >= 0 else None
        if g is not None and g.state == L.GPU_READY:
            return int(g.capacity)
        return int(L.unpack_spill_state(self.host.buf).gpu_capacity)

    def watermarks(self) -> tuple[float, float]:
        s = L.unpack_spill_state(self.host.buf)
        return s.high, s.low

    def arenas(self) -> list[Arena]:
        """Every ready arena (slot, lo, hi, capacity): what the relief pass weighs one by one."""
        return ready_arenas(self.host)

    def _arena(self, slot: int) -> Allocator:
        """Arena ``slot``'s allocator, asking the spill process to make the arena first if needed.

        Raises:
            StorageFullError: the spill process could not make it (device memory, no CUDA there).
        """
        alloc = allocator(self.host, slot)
        if alloc is not None:
            return alloc
        if self._request_arena is None:
            self.make_arena(slot)
        else:  # the one request a level sends: made by whoever uses the level first
            why = self._request_arena(slot)
            if why is not None:
                raise StorageFullError(f"no GPU arena for {self._name()}: {why} (see {self.setting})", None,
                                       Level.GPU)
        alloc = allocator(self.host, slot)
        if alloc is None:
            raise StorageFullError(f"no GPU arena for {self._name()} ({self.setting})", None, Level.GPU)
        return alloc

    def _name(self, ordinal: int | None = None) -> str:
        d = self.device() if ordinal is None else ordinal
        return DEVICES.name_of(d) if cupy_or_reason()[0] is not None else f"GPU {d}"

    # ---- the arena's owner (the spill process) ------------------------------------------
    def make_arena(self, d: int) -> None:
        """Allocate arena slot ``d`` on the device it names and publish its IPC handle (spill process only).

        A lost arena (its previous owner died) is made again with the same
        size and bins: everything on it was freed when it was marked lost.

        Raises:
            StorageFullError: no CuPy or no such device here, the device cannot be shared, no device memory.
        """
        need_cupy("make the arena")
        buf, lay = self.host.buf, self.host.layout
        g = L.unpack_gpu(buf, lay, d)
        if g.state == L.GPU_READY and g.owner == os.getpid():
            return
        ordinal = DEVICES.ordinal_of(bytes(g.uuid))
        if ordinal is None:
            raise StorageFullError(
                f"the spill process (pid {os.getpid()}) does not see the device of GPU arena {d} (its "
                f"CUDA_VISIBLE_DEVICES is {os.environ.get('CUDA_VISIBLE_DEVICES')!r}): start the store from a "
                f"process that sees every GPU the node's clients use", None, Level.GPU)
        problem = device_problem(ordinal, DEVICES.name_of(ordinal))
        if problem:
            raise StorageFullError(problem, None, Level.GPU)
        cap = g.capacity if g.state == L.GPU_LOST else L.unpack_spill_state(buf).gpu_capacity
        try:
            cap, ptr, handle = allocate_shared(cap, DEFAULT_FRACTION, L.ALIGN, ordinal, DEVICES.name_of(ordinal))
        # the protocol's word for "cannot be made here"; the CUDA error chained
        except DeviceError as exc:
            raise StorageFullError(str(exc), None, Level.GPU) from exc
        epoch = g.epoch + 1
        m = MAPPINGS.adopt((self._store, d, bytes(g.uuid), epoch), ptr, ordinal, device_free)
        with self._lock:
            old, self._maps[d] = self._maps.get(d), (epoch, m)
        if old is not None:
            old[1].release()
        with self.host.alloc_lock:
            fresh = g.state != L.GPU_LOST
            L.set_gpu(buf, lay, d, device=ordinal, base=L.gpu_base(d), capacity=cap, owner=os.getpid(), epoch=epoch,
                      handle=handle, message=b"")
            if fresh:
                Allocator(buf, lay, cap, gpu=d).init_arena()
            L.set_gpu(buf, lay, d, state=L.GPU_READY)

    def release_arenas(self) -> int:
        """The owner's exit (the spill process): mark every arena this process holds lost and drop its
        objects, then let the allocations go (freed once no array of this process uses them). Marking
        first, so that no record says ready for memory that is gone; returns how many objects went."""
        lost = 0
        try:
            if L.HEAD.get(self.host.buf, "state") == L.STATE_READY:  # a store being removed: nobody reads it
                lost = drop_dead_arenas(self.host, self.level, only_mine=True)
        except (ShmStoreError, OSError):  # a lock that timed out at exit: the successor's drop_lost does it
            pass
        finally:
            self._wait_for_views(VIEWS_GRACE)
            self._let_go()
        return lost

    def _wait_for_views(self, timeout: float) -> None:
        """Before freeing its allocations, the owner waits (at most ``timeout`` seconds) until no other live
        client process holds a view of them (CLIENT ``gpu_views``): CUDA leaves a free of memory that
        another process maps undefined. The arenas are marked lost first, so no new view comes."""
        with self._lock:
            mask = sum(1 << d for d in self._maps)
        deadline = time.monotonic() + timeout
        while mask:
            holders = self._viewers(mask)
            if not holders:
                return
            if time.monotonic() > deadline:
                log.warning("GPU arenas %s freed while processes %s still hold views of them (they waited %.0f s; "
                            "those views are invalid now)", sorted(d for d in self._maps if mask >> d & 1),
                            holders, timeout)
                return
            time.sleep(0.02)

    def _viewers(self, mask: int) -> list[int]:
        """The pids of live client processes other than this one holding views of the arenas in ``mask``."""
        try:
            t = L.client_table(self.host.buf, self.host.layout)
            rows = [(int(t["pid"][s]), int(t["start"][s])) for s in
                    ((t["state"] == 1) & (t["gpu_views"] & mask != 0)).nonzero()[0]]
        except (ValueError, TypeError):  # the metadata is unmapped
            return []
        return sorted({pid for pid, start in rows if pid != os.getpid() and pid_alive(pid, start)})

    def _note_views(self, slot: int, held: bool) -> None:
        """Record in this process's client slots of the store whether it holds views of arena ``slot``
        (only this process writes its own slots; the arena's owner reads them before freeing it)."""
        t = L.client_table(self.host.buf, self.host.layout)
        bit = 1 << slot
        for s in ((t["pid"] == os.getpid()) & (t["state"] == 1)).nonzero()[0]:
            views = int(t["gpu_views"][s])
            t["gpu_views"][s] = views | bit if held else views & ~bit

    def forget_mappings(self) -> None:
        """Let this level's own references to the arenas' mappings go; every view keeps its own, so the
        last view to go unmaps. What a store's ``close()`` does while views still pin objects (its detach
        waits for them); the owner (the spill process) keeps its allocations until it releases them."""
        if not self.owner:
            self._let_go()

    def _let_go(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for _, m in maps.values():
            m.release()

    # ---- this process's mapping ---------------------------------------------------------
    def _mapping(self, slot: int, key: str | None = None) -> Mapping:
        """This process's mapping of arena ``slot`` (opened once per process and epoch), with one reference
        taken for the caller (who releases it): a ``close`` on another thread cannot unmap it meanwhile.

        Raises:
            OSError: the arena is not ready (lost with its spill process: this level lets its mapping go).
            DeviceError: CuPy is missing, this process does not see the device, or CUDA refused.
        """
        g = L.unpack_gpu(self.host.buf, self.host.layout, slot)
        with self._lock:
            held = self._maps.get(slot)
            if held is not None and held[0] == g.epoch and g.state == L.GPU_READY:
                held[1].retain()
                return held[1]
            if held is not None:
                del self._maps[slot]
        if held is not None:
            held[1].release()
        if g.state != L.GPU_READY:
            raise OSError(f"GPU arena {slot} is {STATE_NAMES[g.state]}")
        need_cupy("read", key)
        ordinal = DEVICES.ordinal_of(bytes(g.uuid))
        if ordinal is None:
            raise DeviceError(f"this process does not see the device of GPU arena {slot}, which holds {key!r} "
                              f"(check CUDA_VISIBLE_DEVICES: the object lives on a GPU this process cannot reach)", key)
        problem = device_problem(ordinal, DEVICES.name_of(ordinal))
        if problem:
            raise DeviceError(problem, key, ordinal)
        with cuda_errors("map the GPU arena holding", key, ordinal, DEVICES.name_of(ordinal)):
            m = MAPPINGS.open((self._store, slot, bytes(g.uuid), g.epoch), bytes(g.handle), ordinal)
        m.retain()  # the caller's; the one open gave is this level's
        if not self.owner:  # the owner's own allocation has no owner to keep it
            m.watch(id(self), lambda held: self._note_views(slot, held))
        with self._lock:
            old, self._maps[slot] = self._maps.get(slot), (g.epoch, m)
        if old is not None:
            old[1].release()
        return m

    def array(self, offset: int, nbytes: int, owner: Any = None, dtype: Any = np.uint8,
              shape: tuple[int, ...] | None = None, order: str = "C", key: str | None = None) -> Any:
        """A CuPy array over ``nbytes`` of the arena at ``offset`` (no copy). Its memory owner holds the
        arena's mapping and ``owner`` (the pin), and synchronises the device before letting the pin go.

        Raises:
            OSError: the arena is not ready. DeviceError: no CuPy here, or CUDA refused.
        """
        shape = (nbytes // np.dtype(dtype).itemsize,) if shape is None else shape
        if not nbytes:  # never a pointer for an empty object
            return need_cupy("read", key).empty(shape, dtype, order=order)
        slot = slot_of(offset)
        m = self._mapping(slot, key)  # first: a lost arena says so, with or without CuPy here
        try:
            cupy = need_cupy("read", key)
            holder = view_owner(owner, m, settle if owner is not None else _no_settle)  # its own reference
        finally:
            m.release()
        mem = cupy.cuda.UnownedMemory(m.ptr + offset - L.gpu_base(slot), nbytes, holder, m.ordinal)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0), order=order)

    # ---- space ---------------------------------------------------------------------
    def try_put(self, client: PutContext, ref: KeyRef, what: Encoded | Contents,
                give_up: Callable[[int, int], object], held: bool = False, seal: bool = True,
                entry: tuple[int, int] | None = None) -> Reservation | None:
        # no shortcut: a put on the GPU goes the general way (a device copy, a stream sync)
        return None

    def remove_files(self) -> int:
        return 0  # nothing outside device memory and the metadata

    def prepare(self, key: str) -> None:
        """This device's arena, made by the spill process (waited for) where it is not yet: before the
        stripe lock, which :meth:`place` then takes no longer than its allocation."""
        slot = self._slot(claim=True)
        if slot < 0:
            need_cupy("store", key)
        self._arena(slot)

    def place(self, key: str, idx: int, gen: int, size: int, client: PutContext,
              write_entry: Callable[[int, int, int], None]) -> tuple[int, int, int]:
        slot = self._slot(claim=True)
        if slot < 0:
            need_cupy("store", key)
        arena = allocator(self.host, slot)
        if arena is None and self.owner:  # the spill process makes it itself, waiting on nobody
            arena = self._arena(slot)
        if arena is None:  # prepare() had it made, and it was lost since (its spill process died)
            raise StorageFullError(f"no GPU arena for {self._name()}: it was lost after this put had it made "
                                   f"(its spill process died); the next put on the level has it made again",
                                   key, Level.GPU, size)
        node, eoff = self.host, self.host.layout.entry(idx)
        with node.alloc_lock:
            if not owns_entry(node.buf, eoff, client.slot, gen):
                raise EntryStolen
            rec, off = arena.alloc(size, idx + 1)
            if rec:
                L.ENTRY_HEAD.set(node.buf, eoff, "extent", rec)
        if not rec:
            raise self.full(key, size, slot)
        write_entry(off, rec, 0)
        return off, rec, 0

    def full(self, key: str | None, size: int, slot: int) -> StorageFullError:
        g = L.unpack_gpu(self.host.buf, self.host.layout, slot)
        cap = int(g.capacity)
        used = cap - self.largest_free_in(slot)
        return StorageFullError(
            f"cannot place {key!r} ({format_size(size)}) on {self._name()}: {format_size(cap - used)} free of "
            f"{format_size(cap)} (raise {self.setting}, or allow Level.MEMORY)", key, Level.GPU, size, cap - used)

    def unplace(self, idx: int, extent: int, flags: int) -> None:
        unplace_extent(self.host, idx, extent)

    def drop(self, idx: int, e: L.Entry) -> None:
        pass

    def free_locked(self, idx: int, e: L.Entry) -> None:
        if e.extent:  # records are shared: the allocator frees it into its own arena's bins
            self.host.alloc.free_owned(e.extent, idx + 1)

    def largest_free(self) -> int:
        """The largest object a place here can take now: on this process's device's arena, or, where that
        arena is not made yet, what it will hold once the first place makes it (as :meth:`total` answers)."""
        if cupy_or_reason()[0] is None:
            return 0
        slot = self._slot(claim=False)
        if slot >= 0 and allocator(self.host, slot) is not None:
            return self.largest_free_in(slot)
        return self.total()

    def largest_free_in(self, slot: int) -> int:
        alloc = allocator(self.host, slot) if slot >= 0 else None
        if alloc is None:
            return 0
        with self.host.alloc_lock:
            return max((size for _, size in alloc.free_extents()), default=0)

    # ---- bytes ---------------------------------------------------------------------
    def write(self, idx: int, gen: int, offset: int, flags: int, enc: serialize.Encoded, key: str) -> None:
        """Copy the value in on the current stream, and synchronise it before the entry is sealed.

        Raises:
            DeviceError: CuPy is missing here, or CUDA refused the copy.
        """
        if not enc.size:
            return
        cupy = need_cupy("store", key)
        dst = self.array(offset, enc.size, key=key)
        c_order = enc.array is None or enc.array[2] == "C"
        if enc.kind == L.KIND_NDARRAY and is_device_array(enc.src):
            with cuda_errors("store", key, dst.device.id):
                src = cupy.asarray(enc.src)
                src = cupy.ascontiguousarray(src) if c_order else cupy.asfortranarray(src)
        elif enc.kind == L.KIND_NDARRAY:
            src = np.ascontiguousarray(enc.src) if c_order else np.asfortranarray(enc.src)
        else:
            src = np.empty(enc.size, np.uint8)
            serialize.write(enc, src, 0)
        copy_into(dst, src, enc.size, "store", key)  # synchronised: the entry is sealed after

    def sink(self, idx: int, gen: int, offset: int, size: int, key: str) -> DeviceSink:
        return DeviceSink(self.array(offset, size, key=key), key)

    def view(self, idx: int, gen: int, offset: int, nbytes: int) -> tuple[Any, int]:
        return self.array(offset, nbytes), 0

    def value(self, e: L.Entry, array: tuple[Any, ...] | None, token: Any, key: str | None = None) -> Any:
        """The value of GPU entry ``e``: a CuPy array over the arena (``array`` = dtype, shape, order), raw
        bytes as a uint8 CuPy array; a pickled value comes back to the host. ``token`` holds the pin."""
        n, off = e.nbytes, e.offset
        if array is not None:
            return self.array(off, n, token, array[0], tuple(array[1]), array[2], key)
        data = self.array(off, e.size if e.kind == L.KIND_PICKLE else n, token, key=key)
        if e.kind == L.KIND_RAW:
            return data
        host = np.empty(data.size, np.uint8)
        to_host(host, data)
        host.flags.writeable = False
        return serialize.decode(e.kind, host, n)

    def export(self, e: L.Entry, token: Any) -> Any:
        return self.array(e.offset, e.nbytes, token)

    def host_bytes(self, arr: Any) -> bytes:
        host = np.empty(arr.nbytes, np.uint8)
        to_host(host, arr)
        return host.tobytes()

    # ---- moves onto this level -----------------------------------------------------------
    def charge_move_locked(self, idx: int, e: L.Entry) -> None:
        pass

    def space_for_move(self, idx: int, size: int) -> tuple[int, int]:
        """Room on the arena the move was aimed at (the asking client's device's), else on this process's
        current device's, else on the ready arena with the most room."""
        slot = self._aim if self._aim >= 0 else self._slot(claim=True)
        if slot < 0:
            need_cupy("move an object")
        tried = [slot] + sorted((a.slot for a in ready_arenas(self.host) if a.slot != slot),
                                key=self.largest_free_in, reverse=True)
        node, eoff = self.host, self.host.layout.entry(idx)
        for s in tried:
            arena = self._arena(s) if s == slot else allocator(self.host, s)
            if arena is None:
                continue
            with node.alloc_lock:
                rec, off = arena.alloc(size, idx + 1)
                if rec:
                    L.ENTRY_HEAD.set(node.buf, eoff, "target_extent", rec)
                    return off, rec
        raise self.full(None, size, slot)

    def write_move(self, idx: int, gen: int, offset: int, src: Any, size: int,
                   progress: Callable[[int], None]) -> None:
        """Copy a move's bytes in on the arena's device and its current stream, synchronised before return.

        Raises:
            DeviceError: CUDA refused (the mover gives the move up: the object stays where it was).
        """
        if not size:
            return
        copy_into(self.array(offset, size), src, size, "move an object")
        progress(size)

    def abort_move(self, idx: int, e: L.Entry) -> None:
        abort_arena_move(self.host, idx)

    # ---- checks and recovery ---------------------------------------------------------
    def check(self, t: np.ndarray) -> list[str]:
        return check_arena_objects(self.host, self.level, t, "on the GPU")  # the tiling is the allocator's

    def recount_locked(self, t: np.ndarray) -> None:
        pass  # no counter of its own: the allocator is rebuilt by the ALLOC repair

    def remove_orphans(self) -> int:
        return 0

    def drop_lost(self) -> int:
        """Mark the arenas whose owner (a dead spill process) took the device memory with it as lost, and
        drop the objects that lived there; returns how many objects were lost."""
        return drop_dead_arenas(self.host, self.level)

    def close(self) -> None:
        if self.owner:
            self.release_arenas()
        else:
            self._let_go()
