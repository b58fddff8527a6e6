"""The GPU level: one device allocation per GPU, shared by every process of the node through CUDA IPC.

How it works:

- **One arena per device**, made on first use by the node's spill process
  (one per node, spawned, long-lived): ``cudaMalloc`` of ``gpu_capacity``
  (default: half the device's free memory), its ``cudaIpcMemHandle_t``
  recorded in the metadata (``GPU_ARENA``), the arena's free space added
  to the store's allocator as a range of its own (offsets from
  ``(d + 1) << 44``). A client asks for it with a request (``REQ_GPU``) and
  waits, like a request for room.
- **Clients open the handle once** (``cudaIpcOpenMemHandle``) and cut
  objects from the arena with the same allocator, records and locks as the
  memory arena: the object table, pins, the janitor, crash repair and
  ``check()`` treat GPU objects like any other. Only copying bytes and
  making views needs CuPy and a device.
- ``get`` of a GPU object returns a CuPy array over the shared allocation
  (no copy; read-only by convention: CUDA has no read-only mappings, and a
  write changes the object under every reader). The array holds the
  object's pin, like a numpy view: spill never moves it meanwhile.
- Spill: GPU -> MEMORY -> DISK by the same spill process and rules.
- Zero-length objects never reach CUDA: no copy, no pointer; they come back
  as empty arrays.

The device memory belongs to the spill process: if that process dies, the
driver frees it, and the objects on it are lost. Its successor marks the
arena lost, drops those objects (logging how many) and makes the arena
again on the next use. MEMORY and DISK objects survive such a death; GPU
objects do not (CUDA gives no way to keep an allocation past its owner).

CuPy is imported lazily, in ``levels/device.py`` only (extra ``gpu``):
without it, or without a device, the level reports itself unavailable with
the reason, and every other level works. The metadata operations (freeing,
repair) never need it.

The level is built from the store's ``LevelHost`` and a way to ask the spill
process for an arena (``request_arena``); the spill process builds it
without one, and then makes and owns the arenas itself (``make_arena``).
"""
from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import StorageFullError
from ..kernel import layout as L
from ..kernel import serialize
from ..kernel.alloc import Allocator
from ..kernel.procs import pid_alive
from ..kernel.protocols import LevelHost, RequestArena
from ..kernel.table import EntryStolen, owns_entry
from ..kernel.views import pin_token
from ..units import format_size
from ..values import Level
from .device import cupy_or_reason, is_device_array, to_host
from .memory import abort_arena_move, check_arena_objects, unplace_extent

if TYPE_CHECKING:
    from ..kernel.attach import Attachment

__all__ = ["GpuLevel", "cupy_or_reason", "device_of", "is_device_array", "to_host", "pin_token", "DEFAULT_FRACTION"]

DEFAULT_FRACTION = 0.5  # of the device's free memory, for an arena whose size was not set


def device_of(offset: int) -> int:
    """The device ordinal of a GPU arena offset."""
    return (offset >> L.GPU_BASE_SHIFT) - 1


class GpuLevel:
    """Device memory of the node's GPUs (see :class:`~shmstore.kernel.protocols.DeviceLevel`).

    Built from the store's :class:`~shmstore.kernel.protocols.LevelHost` and
    owned by it; owns this process's IPC mappings of the arenas, and in the
    process built without ``request_arena`` (the spill process) the arenas'
    device allocations themselves; ``close`` releases them. Process-safe
    through the store's locks; thread-safe.
    """

    level = Level.GPU
    spill_to: Level | None = Level.MEMORY
    setting = "gpu_capacity= / SHMSTORE_GPU_CAPACITY when creating the store"

    def __init__(self, host: LevelHost, request_arena: RequestArena | None = None) -> None:
        self.host = host
        self._request_arena = request_arena
        self._maps: dict[int, tuple[int, int, Any]] = {}  # device -> (epoch, base pointer, what to close)
        self._lock = threading.Lock()
        self.owner = request_arena is None  # this process makes and holds the allocations (the spill process)

    # ---- where -------------------------------------------------------------------
    def available(self) -> str | None:
        _, why = cupy_or_reason()
        return why

    def device(self) -> int:
        """This process's current CUDA device (0 without CuPy: metadata only)."""
        cupy, _ = cupy_or_reason()
        return int(cupy.cuda.Device().id) if cupy is not None else 0

    def total(self) -> int:
        g = L.unpack_gpu(self.host.buf, self.host.layout, self.device())
        return int(g.capacity) if g.state == L.GPU_READY else int(L.unpack_spill_state(self.host.buf).gpu_capacity)

    def watermarks(self) -> tuple[float, float]:
        s = L.unpack_spill_state(self.host.buf)
        return s.high, s.low

    def _arena(self, d: int) -> Allocator:
        """GPU arena ``d``'s allocator, asking the spill process to make the arena first if needed.

        Raises:
            StorageFullError: the spill process could not make it (device memory, no CUDA there).
        """
        alloc = self.host.gpu_alloc(d)
        if alloc is not None:
            return alloc
        if self._request_arena is None:
            self.make_arena(d)
        else:  # the one request a level sends: made by whoever uses the level first
            why = self._request_arena(d)
            if why is not None:
                raise StorageFullError(f"no GPU arena on device {d}: {why} (see {self.setting})", None, Level.GPU)
        alloc = self.host.gpu_alloc(d)
        if alloc is None:
            raise StorageFullError(f"no GPU arena on device {d} ({self.setting})", None, Level.GPU)
        return alloc

    # ---- the arena's owner (the spill process) ------------------------------------------
    def make_arena(self, d: int) -> None:
        """Allocate device ``d``'s arena and publish its IPC handle (spill process only).

        A lost arena (its previous owner died) is made again with the same
        size and bins: everything on it was freed when it was marked lost.
        """
        cupy, why = cupy_or_reason()
        if cupy is None:
            raise StorageFullError(f"the spill process cannot make a GPU arena: {why}", None, Level.GPU)
        buf, lay = self.host.buf, self.host.layout
        g = L.unpack_gpu(buf, lay, d)
        if g.state == L.GPU_READY and g.owner == os.getpid():
            return
        with cupy.cuda.Device(d):
            cap = g.capacity if g.state == L.GPU_LOST else L.unpack_spill_state(buf).gpu_capacity
            if not cap:
                cap = int(cupy.cuda.runtime.memGetInfo()[0] * DEFAULT_FRACTION)
            cap &= ~(L.ALIGN - 1)
            ptr = cupy.cuda.runtime.malloc(cap)
            handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(ptr))
        with self._lock:
            self._maps[d] = (g.epoch + 1, ptr, ("free", ptr))
        with self.host.alloc_lock:
            fresh = g.state != L.GPU_LOST
            L.set_gpu(buf, lay, d, device=d, base=L.gpu_base(d), capacity=cap, owner=os.getpid(), epoch=g.epoch + 1,
                      handle=handle, message=b"")
            if fresh:
                Allocator(buf, lay, cap, gpu=d).init_arena()
            L.set_gpu(buf, lay, d, state=L.GPU_READY)

    def release_arenas(self) -> None:
        """Free the device allocations this process owns (the spill process, at exit)."""
        cupy, _ = cupy_or_reason()
        with self._lock:
            maps, self._maps = self._maps, {}
        for _, _, (how, ptr) in maps.values():
            if cupy is not None:
                if how == "free":
                    cupy.cuda.runtime.free(ptr)
                else:
                    cupy.cuda.runtime.ipcCloseMemHandle(ptr)

    # ---- this process's mapping ---------------------------------------------------------
    def pointer(self, offset: int) -> int:
        """The device address of arena ``offset`` in this process (opening the arena's handle once)."""
        d = device_of(offset)
        g = L.unpack_gpu(self.host.buf, self.host.layout, d)
        if g.state != L.GPU_READY:
            raise OSError(f"GPU arena {d} is {('gone', 'being made', 'ready', 'failed', 'lost')[g.state]}")
        with self._lock:
            m = self._maps.get(d)
            if m is None or m[0] != g.epoch:
                cupy, why = cupy_or_reason()
                if cupy is None:
                    raise OSError(why)
                if m is not None and m[2][0] == "ipc":
                    cupy.cuda.runtime.ipcCloseMemHandle(m[1])
                with cupy.cuda.Device(d):
                    ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes(g.handle),
                                                            cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
                m = self._maps[d] = (g.epoch, ptr, ("ipc", ptr))
        return int(m[1]) + offset - L.gpu_base(d)

    def array(self, offset: int, nbytes: int, owner: Any = None, dtype: Any = np.uint8,
              shape: tuple[int, ...] | None = None, order: str = "C") -> Any:
        """A CuPy array over ``nbytes`` of the arena at ``offset`` (no copy); ``owner`` lives as long."""
        cupy, _ = cupy_or_reason()
        shape = (nbytes // np.dtype(dtype).itemsize,) if shape is None else shape
        if not nbytes:  # never a pointer for an empty object
            return cupy.empty(shape, dtype, order=order)
        d = device_of(offset)
        mem = cupy.cuda.UnownedMemory(self.pointer(offset), nbytes, owner, d)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0), order=order)

    # ---- space ---------------------------------------------------------------------
    def place(self, key: str, idx: int, gen: int, size: int, at: Attachment,
              write_entry: Callable[[int, int, int], None]) -> tuple[int, int, int]:
        d = self.device()
        arena = self._arena(d)
        node, eoff = self.host, self.host.layout.entry(idx)
        with node.alloc_lock:
            if not owns_entry(node.buf, eoff, at.slot, gen):
                raise EntryStolen
            rec, off = arena.alloc(size, idx + 1)
            if rec:
                L.ENTRY_HEAD.set(node.buf, eoff, "extent", rec)
        if not rec:
            raise self.full(key, size, d)
        write_entry(off, rec, 0)
        return off, rec, 0

    def full(self, key: str | None, size: int, d: int) -> StorageFullError:
        cap = self.total()
        used = self.host.used(L.LEVEL_GPU)
        return StorageFullError(
            f"cannot place {key!r} ({format_size(size)}) on GPU {d}: {format_size(cap - used)} free of "
            f"{format_size(cap)} (raise {self.setting}, or allow Level.MEMORY)", key, Level.GPU, size, cap - used)

    def unplace(self, idx: int, extent: int, flags: int) -> None:
        unplace_extent(self.host, idx, extent)

    def drop(self, idx: int, e: L.Entry) -> None:
        pass

    def free_locked(self, idx: int, e: L.Entry) -> None:
        if e.extent:  # records are shared: the allocator frees it into its own arena's bins
            self.host.alloc.free_owned(e.extent, idx + 1)

    def largest_free(self) -> int:
        alloc = self.host.gpu_alloc(self.device())
        if alloc is None:
            return 0
        with self.host.alloc_lock:
            return max((size for _, size in alloc.free_extents()), default=0)

    # ---- bytes ---------------------------------------------------------------------
    def write(self, idx: int, gen: int, offset: int, flags: int, enc: serialize.Encoded, key: str) -> None:
        if not enc.size:
            return
        cupy, _ = cupy_or_reason()
        dst = self.array(offset, enc.size)
        c_order = enc.array is None or enc.array[2] == "C"
        if enc.kind == L.KIND_NDARRAY and is_device_array(enc.src):
            src = cupy.asarray(enc.src)
            src = cupy.ascontiguousarray(src) if c_order else cupy.asfortranarray(src)
            dst.data.copy_from_device(src.data, enc.size)
        elif enc.kind == L.KIND_NDARRAY:
            src = np.ascontiguousarray(enc.src) if c_order else np.asfortranarray(enc.src)
            dst.data.copy_from_host(src.ctypes.data, enc.size)
        else:
            host = np.empty(enc.size, np.uint8)
            serialize.write(enc, host, 0)
            dst.data.copy_from_host(host.ctypes.data, enc.size)
        cupy.cuda.get_current_stream().synchronize()

    def sink(self, idx: int, gen: int, offset: int, size: int, key: str) -> DeviceSink:
        return DeviceSink(self.array(offset, size))

    def view(self, idx: int, gen: int, offset: int, nbytes: int) -> tuple[Any, int]:
        return self.array(offset, nbytes), 0

    def value(self, e: L.Entry, array: tuple[Any, ...] | None, token: Any) -> Any:
        """The value of GPU entry ``e``: a CuPy array over the arena (``array`` = dtype, shape, order), raw
        bytes as a uint8 CuPy array; a pickled value comes back to the host. ``token`` holds the pin."""
        n, off = e.nbytes, e.offset
        if array is not None:
            return self.array(off, n, token, array[0], tuple(array[1]), array[2])
        data = self.array(off, e.size if e.kind == L.KIND_PICKLE else n, token)
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
        d = self.device()
        arena = self._arena(d)
        node, eoff = self.host, self.host.layout.entry(idx)
        with node.alloc_lock:
            rec, off = arena.alloc(size, idx + 1)
            if rec:
                L.ENTRY_HEAD.set(node.buf, eoff, "target_extent", rec)
                return off, rec
        raise self.full(None, size, d)

    def write_move(self, idx: int, gen: int, offset: int, src: Any, size: int,
                   progress: Callable[[int], None]) -> None:
        if not size:
            return
        cupy, _ = cupy_or_reason()
        dst = self.array(offset, size)
        if is_device_array(src):
            dst.data.copy_from_device(cupy.asarray(src).data, size)
        else:
            host = np.frombuffer(src, np.uint8, size)
            dst.data.copy_from_host(host.ctypes.data, size)
        cupy.cuda.get_current_stream().synchronize()
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
        drop the objects that lived there; returns how many objects were lost.

        Their space goes back to the lost arena's bins, which the next owner
        reuses when it makes the arena again (same size, new IPC handle).
        """
        host = self.host
        buf, lay, table = host.buf, host.layout, host.table
        lost = 0
        for d in range(L.MAX_GPUS):
            g = L.unpack_gpu(buf, lay, d)
            if g.state != L.GPU_READY or pid_alive(g.owner):
                continue
            with host.alloc_lock:
                L.set_gpu(buf, lay, d, state=L.GPU_LOST)
            t = L.entry_table(buf, lay)
            lo, hi = L.gpu_base(d), L.gpu_base(d) + int(g.capacity)
            on = (t["level"] == self.level) & (t["offset"] >= lo) & (t["offset"] < hi)
            for idx in np.flatnonzero(on & (t["state"] == L.SEALED)).tolist():
                with host.stripe_of(idx):
                    e = L.entry(buf, lay.entry(idx))
                    if e.state != L.SEALED or e.level != self.level:
                        continue
                    table.mark_deleted(idx)  # hidden first, then out of its chain (see repair.py)
                    table.unlink(idx, table.bucket_of(idx))
                    host.free_if_unpinned(idx)
                    lost += 1
        return lost

    def close(self) -> None:
        if self.owner:
            self.release_arenas()
            return
        cupy, _ = cupy_or_reason()
        with self._lock:
            maps, self._maps = self._maps, {}
        if cupy is not None:
            for _, ptr, _how in maps.values():
                try:
                    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
                except Exception:  # a finalizer-time close never raises
                    pass


class DeviceSink:
    """A writer's target on the GPU: a device array over the object's bytes."""

    def __init__(self, dst: Any) -> None:
        self._dst: Any = dst

    def write(self, data: Any, pos: int) -> None:
        if self._dst is None or not len(data):
            return
        cupy, _ = cupy_or_reason()
        piece = self._dst[pos: pos + len(data)]
        if is_device_array(data):
            piece[...] = cupy.asarray(data).view(cupy.uint8).reshape(-1)
        else:
            host = np.ascontiguousarray(np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data)
            piece.data.copy_from_host(host.ctypes.data, host.nbytes)
        cupy.cuda.get_current_stream().synchronize()

    def buffer(self) -> Any:
        return None  # a writer streams host bytes; an incoming transfer asks cuda_buffer()

    def cuda_buffer(self) -> Any:
        """The device array to receive into (CUDA-aware MPI)."""
        return self._dst

    def close(self) -> None:
        self._dst = None

    def abort(self) -> None:
        self._dst = None
