"""``cupy.cuda`` stand-in: Device, Stream (with capture), memory pointers (see ../../README.md)."""
from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from . import memory, runtime

__all__ = ["Device", "Stream", "get_current_stream", "UnownedMemory", "MemoryPointer", "alloc_pinned_memory",
           "runtime", "memory", "capturing", "is_available"]

_local = threading.local()


def is_available() -> bool:
    try:
        return runtime.getDeviceCount() > 0
    except runtime.CUDARuntimeError:
        return False


class Device:
    """A device by ordinal; ``with Device(d):`` makes it current for the block, as CuPy's."""

    def __init__(self, device: int | None = None) -> None:
        self.id = runtime.getDevice() if device is None else int(device)
        self._prev: list[int] = []

    def use(self) -> None:
        runtime.setDevice(self.id)

    def synchronize(self) -> None:
        runtime.deviceSynchronize()

    def __enter__(self) -> Device:
        self._prev.append(runtime.getDevice())
        runtime.setDevice(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        runtime.setDevice(self._prev.pop())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"

    @property
    def compute_capability(self) -> str:
        return "90"


class Graph:
    """What ``end_capture`` gives: launching it runs nothing (the stand-in queues no work)."""

    def launch(self, stream: Stream | None = None) -> None:
        pass


class Stream:
    """A stream: work is synchronous here, so ``synchronize`` only counts; capture is tracked, and a
    synchronise of a capturing stream is refused as CUDA refuses it."""

    null: Stream

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int = 0) -> None:
        self.is_null, self.non_blocking = null, non_blocking
        self.ptr = 0 if null else id(self)
        self.device_id = runtime.getDevice()
        self._capturing = self._invalidated = False
        self._prev: list[Stream] = []

    def synchronize(self) -> None:
        runtime._count("stream.synchronize")
        if self._capturing:
            self._invalidated = True
            raise runtime.CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                                           "operation not permitted when stream is capturing")

    def is_capturing(self) -> bool:
        return self._capturing

    def begin_capture(self, mode: Any = None) -> None:
        if self.is_null:
            raise runtime.CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                                           "operation not permitted when stream is capturing")
        self._capturing, self._invalidated = True, False
        _captures().append(self)

    def end_capture(self) -> Graph:
        """The captured graph; refused (cudaErrorStreamCaptureInvalidated) where a synchronise during the
        capture broke it, as CUDA refuses it."""
        self._capturing = False
        _captures().remove(self)
        if self._invalidated:
            raise runtime.CUDARuntimeError("cudaErrorStreamCaptureInvalidated",
                                           "operation failed due to a previous error during capture")
        return Graph()

    def use(self) -> Stream:
        _local.stream = self
        return self

    def __enter__(self) -> Stream:
        self._prev.append(get_current_stream())
        _local.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.stream = self._prev.pop()

    def __repr__(self) -> str:
        return f"<Stream {self.ptr:#x}>"


Stream.null = Stream(null=True)


def _captures() -> list[Stream]:
    if not hasattr(_local, "captures"):
        _local.captures = []
    return _local.captures


def capturing() -> bool:
    """True while a stream of this thread is capturing a graph."""
    return bool(_captures())


def invalidate_captures() -> bool:
    """What a device-wide synchronise does to the captures of this thread: breaks them; True if any."""
    for stream in _captures():
        stream._invalidated = True
    return capturing()


def get_current_stream(device_id: int | None = None) -> Stream:
    return getattr(_local, "stream", Stream.null)


class UnownedMemory:
    """Device memory someone else owns (``owner`` is kept alive as long as this is), as CuPy's."""

    def __init__(self, ptr: int, size: int, owner: Any, device_id: int | None = None) -> None:
        self.ptr, self.size, self._owner = int(ptr), int(size), owner
        self.device_id = runtime.getDevice() if device_id is None else int(device_id)


class PoolMemory:
    """Memory of arrays the stand-in allocates itself (CuPy's pool): host memory held here."""

    def __init__(self, size: int, keep: np.ndarray | None = None) -> None:
        self._buf = np.empty(max(size, 1), np.uint8) if keep is None else keep  # contiguous, either order
        self.ptr, self.size, self.device_id = int(self._buf.ctypes.data), int(size), runtime.getDevice()


class MemoryPointer:
    """A pointer into device memory ``mem`` at ``offset``; holds ``mem``."""

    def __init__(self, mem: Any, offset: int) -> None:
        self.mem, self.offset = mem, int(offset)
        self.ptr = mem.ptr + self.offset if mem.ptr else 0
        self.device_id = mem.device_id

    @property
    def device(self) -> Device:
        return Device(self.device_id)

    def __add__(self, n: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.offset + int(n))

    def _move(self, dst: int, src: int, size: int) -> None:
        if size:
            ctypes.memmove(dst, src, size)

    def copy_from_device_async(self, src: MemoryPointer, size: int, stream: Stream | None = None) -> None:
        self._move(self.ptr, src.ptr, size)

    def copy_from_host_async(self, mem: Any, size: int, stream: Stream | None = None) -> None:
        self._move(self.ptr, int(mem.value if isinstance(mem, ctypes.c_void_p) else mem), size)

    def copy_to_host_async(self, mem: Any, size: int, stream: Stream | None = None) -> None:
        self._move(int(mem.value if isinstance(mem, ctypes.c_void_p) else mem), self.ptr, size)

    copy_from_device = copy_from_device_async
    copy_from_host = copy_from_host_async
    copy_to_host = copy_to_host_async

    def memset_async(self, value: int, size: int, stream: Stream | None = None) -> None:
        if size:
            ctypes.memset(self.ptr, value, size)


def alloc_pinned_memory(size: int) -> bytearray:
    """Page-locked host memory in CuPy; plain host memory here (it takes the buffer protocol as CuPy's)."""
    return bytearray(size)
