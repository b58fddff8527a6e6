"""``cupy.cuda.runtime`` stand-in: devices, device memory and CUDA IPC, over shared memory (see ../../README.md).

Device memory from :func:`malloc` is a ``memfd`` mapped into this process: its address is the device
pointer, and :func:`ipcGetMemHandle` names (pid, fd) so that :func:`ipcOpenMemHandle` in another process
maps the very same pages through ``/proc/<pid>/fd/<fd>``; the handle stops opening when its owner exits,
as a CUDA IPC handle does. Settings (environment): ``FAKECUDA_DEVICES`` (default 1), ``FAKECUDA_MEMORY``
(bytes per device, default 4 GiB), ``FAKECUDA_COMPUTE_MODE`` (default 0); ``CUDA_VISIBLE_DEVICES`` picks
and orders them as CUDA does.
"""
from __future__ import annotations

import ctypes
import os
import struct
import threading

__all__ = ["CUDARuntimeError", "getDeviceCount", "getDevice", "setDevice", "getDeviceProperties",
           "deviceGetPCIBusId", "memGetInfo", "malloc", "free", "ipcGetMemHandle", "ipcOpenMemHandle",
           "ipcCloseMemHandle", "deviceSynchronize", "cudaIpcMemLazyEnablePeerAccess", "calls"]

cudaIpcMemLazyEnablePeerAccess = 1
_HANDLE = struct.Struct("<8sqqqq")  # magic, pid, fd, size, physical device: 40 of CUDA's 64 bytes
_MAGIC = b"FAKECUDA"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_RW, _MAP_SHARED, _MAP_FAILED = 0x3, 0x1, ctypes.c_void_p(-1).value

# what tests may count: calls by name (deviceSynchronize, stream synchronize, ipcOpenMemHandle, ...)
calls: dict[str, int] = {}
_lock = threading.Lock()
_own: dict[int, tuple[int, int, int]] = {}  # ptr -> (fd, size, physical device) of malloc here
_opened: dict[int, tuple[int, bytes]] = {}  # ptr -> (size, handle) opened here
_local = threading.local()


class CUDARuntimeError(RuntimeError):
    """CuPy's runtime error: the same module name (what ``shmstore.levels.device`` looks for) and text."""

    __module__ = "cupy_backends.cuda.api.runtime"

    def __init__(self, name: str, text: str) -> None:
        super().__init__(f"{name}: {text}")
        self.status = name


def _count(name: str) -> None:
    with _lock:
        calls[name] = calls.get(name, 0) + 1


def _visible() -> list[int]:
    n = int(os.environ.get("FAKECUDA_DEVICES", "1"))
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return list(range(n))
    out = []
    for part in vis.split(","):  # CUDA stops at the first entry it cannot use
        if not part.strip().isdigit() or int(part) >= n:
            break
        out.append(int(part))
    return out


def _physical(ordinal: int) -> int:
    vis = _visible()
    if not 0 <= ordinal < len(vis):
        raise CUDARuntimeError("cudaErrorInvalidDevice", "invalid device ordinal")
    return vis[ordinal]


def _total() -> int:
    return int(os.environ.get("FAKECUDA_MEMORY", str(4 << 30)))


def getDeviceCount() -> int:
    n = len(_visible())
    if not n:
        raise CUDARuntimeError("cudaErrorNoDevice", "no CUDA-capable device is detected")
    return n


def getDevice() -> int:
    return getattr(_local, "device", 0)


def setDevice(device: int) -> None:
    _physical(device)
    _local.device = device


def getDeviceProperties(device: int) -> dict[str, object]:
    p = _physical(device)
    return {"name": b"FakeCUDA stand-in", "totalGlobalMem": _total(), "major": 9, "minor": 0,
            "computeMode": int(os.environ.get("FAKECUDA_COMPUTE_MODE", "0")), "uuid": bytes([p + 1]) * 16,
            "pciBusID": 0x1B + p, "pciDeviceID": 0, "pciDomainID": 0}


def deviceGetPCIBusId(device: int) -> str:
    return f"0000:{0x1B + _physical(device):02X}:00.0"


def _used(p: int) -> int:
    with _lock:
        return sum(size for _, size, d in _own.values() if d == p)


def memGetInfo() -> tuple[int, int]:
    p = _physical(getDevice())
    return _total() - _used(p), _total()


def _map(fd: int, size: int) -> int:
    ptr = _libc.mmap(None, size, _PROT_RW, _MAP_SHARED, fd, 0)
    if ptr in (None, _MAP_FAILED):
        raise CUDARuntimeError("cudaErrorMemoryAllocation", f"out of memory (mmap: {os.strerror(ctypes.get_errno())})")
    return int(ptr)


def malloc(size: int) -> int:
    """Device memory of ``size`` bytes on the current device: a memfd, mapped here."""
    _count("malloc")
    p = _physical(getDevice())
    if size == 0:
        return 0
    if size > _total() - _used(p):
        raise CUDARuntimeError("cudaErrorMemoryAllocation", "out of memory")
    fd = os.memfd_create(f"fakecuda-dev{p}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        ptr = _map(fd, size)
    except BaseException:
        os.close(fd)
        raise
    with _lock:
        _own[ptr] = (fd, size, p)
    return ptr


def free(ptr: int) -> None:
    _count("free")
    if ptr == 0:
        return
    with _lock:
        got = _own.pop(ptr, None)
    if got is None:
        raise CUDARuntimeError("cudaErrorInvalidValue", "invalid argument")
    fd, size, _ = got
    _libc.munmap(ptr, size)
    os.close(fd)


def ipcGetMemHandle(ptr: int) -> bytes:
    """The 64-byte handle of allocation ``ptr`` (its base, as CUDA requires)."""
    with _lock:
        got = _own.get(ptr)
    if got is None:
        raise CUDARuntimeError("cudaErrorInvalidValue", "invalid argument")
    fd, size, p = got
    return _HANDLE.pack(_MAGIC, os.getpid(), fd, size, p).ljust(64, b"\0")


def ipcOpenMemHandle(handle: bytes, flags: int = cudaIpcMemLazyEnablePeerAccess) -> int:
    """Map another process's allocation here; refused for this process's own, twice for one handle, and
    once its owner is gone (CUDA's rules)."""
    _count("ipcOpenMemHandle")
    magic, pid, fd, size, p = _HANDLE.unpack(bytes(handle)[:_HANDLE.size])
    if magic != _MAGIC:
        raise CUDARuntimeError("cudaErrorInvalidValue", "invalid argument")
    if p not in _visible():
        raise CUDARuntimeError("cudaErrorInvalidDevice", "invalid device ordinal")
    if pid == os.getpid():
        raise CUDARuntimeError("cudaErrorInvalidContext", "invalid device context")
    with _lock:
        if any(h == bytes(handle) for _, h in _opened.values()):
            raise CUDARuntimeError("cudaErrorAlreadyMapped", "resource already mapped")
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:fakecuda-dev{p}"):
            raise OSError("not the allocation")
        ours = os.open(path, os.O_RDWR)
    except OSError:
        raise CUDARuntimeError("cudaErrorMapBufferObjectFailed", "mapping of buffer object failed") from None
    try:
        if os.fstat(ours).st_size != size:
            raise CUDARuntimeError("cudaErrorMapBufferObjectFailed", "mapping of buffer object failed")
        ptr = _map(ours, size)
    finally:
        os.close(ours)
    with _lock:
        _opened[ptr] = (size, bytes(handle))
    return ptr


def ipcCloseMemHandle(ptr: int) -> None:
    _count("ipcCloseMemHandle")
    with _lock:
        got = _opened.pop(ptr, None)
    if got is None:
        raise CUDARuntimeError("cudaErrorInvalidValue", "invalid argument")
    _libc.munmap(ptr, got[0])


def opened() -> int:
    """How many IPC mappings this process holds (for tests)."""
    with _lock:
        return len(_opened)


def deviceSynchronize() -> None:
    """Nothing is ever pending here; refused while a stream of this thread captures (as CUDA does: a
    device-wide synchronise would invalidate the capture)."""
    _count("deviceSynchronize")
    from . import invalidate_captures
    if invalidate_captures():
        raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing")


def runtimeGetVersion() -> int:
    """CUDA 13.0, as the GPU test machine's image has it."""
    return 13000


def driverGetVersion() -> int:
    return 13000
