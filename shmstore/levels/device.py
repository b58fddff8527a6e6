"""CuPy, imported here only, lazily (extra ``gpu``), and the few host/device helpers every level uses.

Without CuPy, or without a device, or with ``SHMSTORE_NO_GPU`` set true,
:func:`cupy_or_reason` says why, the GPU level reports itself unavailable
with that reason, and every other level works; :func:`need_cupy` raises
:class:`~shmstore.errors.DeviceError` with it. A process forked after
CUDA was initialised here gets the same treatment (CUDA cannot be used in
a forked child): the reason names the ``spawn`` start method.

CUDA's own errors become :class:`~shmstore.errors.DeviceError` in
:func:`cuda_errors`, with the device, the object and what to do.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..config import no_gpu
from ..errors import DeviceError

__all__ = ["cupy_or_reason", "need_cupy", "is_device_array", "to_host", "copy_into", "DeviceSink", "cuda_errors",
           "describe_cuda_error", "compute_mode_problem", "device_problem", "device_source", "settle", "ipc_open",
           "ipc_close", "device_free", "allocate_shared", "flat_bytes"]

_CUPY: list[tuple[Any, str | None, int]] = []  # (the answer, the pid that asked), asked once per process
_MODES: dict[int, int] = {}  # ordinal -> compute mode, asked once per process

# cudaComputeMode: 0 default, 1 exclusive thread (gone since CUDA 8), 2 prohibited, 3 exclusive process
_COMPUTE_MODES = {1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}

# what to do about a CUDA error, by its name (runtime, driver, or CuPy's own class)
_HINTS = (
    (("cudaErrorInvalidDevice", "CUDA_ERROR_INVALID_DEVICE", "cudaErrorNoDevice", "CUDA_ERROR_NO_DEVICE"),
     "this process does not see that device: check CUDA_VISIBLE_DEVICES here and in the process that made "
     "the store"),
    (("cudaErrorMemoryAllocation", "CUDA_ERROR_OUT_OF_MEMORY", "OutOfMemoryError"),
     "device memory is full: lower gpu_capacity= / SHMSTORE_GPU_CAPACITY, free device memory, or allow "
     "Level.MEMORY"),
    (("cudaErrorDevicesUnavailable", "CUDA_ERROR_DEVICE_UNAVAILABLE", "cudaErrorDeviceUnavailable"),
     "the GPU is busy or in an exclusive compute mode: set it to DEFAULT (nvidia-smi -c DEFAULT), or use "
     "Level.MEMORY"),
    (("cudaErrorIllegalAddress", "CUDA_ERROR_ILLEGAL_ADDRESS", "cudaErrorLaunchFailure",
      "cudaErrorHardwareStackError", "cudaErrorIllegalInstruction", "cudaErrorMisalignedAddress"),
     "this process's CUDA context is no longer usable (a kernel touched memory it must not): restart the "
     "process; a view used after its store was destroyed does this"),
    (("cudaErrorInitializationError", "CUDA_ERROR_NOT_INITIALIZED", "cudaErrorInsufficientDriver",
      "cudaErrorCudartUnloading"),
     "CUDA cannot start here: check the driver (nvidia-smi), and that this process was not forked from "
     "one that used CUDA"),
    (("cudaErrorMapBufferObjectFailed", "cudaErrorInvalidResourceHandle", "CUDA_ERROR_ALREADY_MAPPED",
      "cudaErrorInvalidValue", "cudaErrorNotSupported", "cudaErrorOperatingSystem"),
     "cannot map the store's GPU arena from this process: CUDA IPC needs both processes on the same node, "
     "seeing the device, in one IPC namespace (containers: --ipc=host)"),
)


def cupy_or_reason() -> tuple[Any, str | None]:
    """(the cupy module, None), or (None, why the GPU level cannot be used here). Asked once per process."""
    if not _CUPY:
        _CUPY.append((*_probe(), os.getpid()))
    cupy, why, pid = _CUPY[0]
    if cupy is not None and pid != os.getpid():
        return None, (f"CUDA was initialised in process {pid}, which forked this one ({os.getpid()}): CUDA "
                      f"cannot be used after fork() (start workers with the 'spawn' or 'forkserver' method, "
                      f"e.g. multiprocessing.set_start_method('spawn'))")
    return cupy, why


def need_cupy(what: str, key: str | None = None) -> Any:
    """The cupy module, for a GPU operation described by ``what`` (``"read"``, ``"store"`` ...).

    Raises:
        DeviceError: CuPy or a device is missing here (the message says which, and what to install).
    """
    cupy, why = cupy_or_reason()
    if cupy is None:
        on = f" {key!r}" if key is not None else ""
        raise DeviceError(f"cannot {what}{on} on the GPU: {why}", key)
    return cupy


def _probe() -> tuple[Any, str | None]:
    if no_gpu():
        return None, "SHMSTORE_NO_GPU is set"
    stand_in = os.environ.get("SHMSTORE_FAKE_CUPY")
    # the tests' CuPy stand-in (tests/fakecuda), named by their conftest only where CuPy finds no device
    if stand_in and stand_in not in sys.path:
        sys.path.insert(0, stand_in)
    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        return None, "CuPy is not installed (pip install 'shmstore[gpu]')"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver
        return None, f"no usable CUDA device ({exc})"
    if n < 1:
        return None, "no CUDA device"
    return cupy, None


def describe_cuda_error(exc: BaseException, what: str, key: str | None, device: str) -> str:
    """The message of the :class:`DeviceError` a CUDA error ``exc`` becomes: what failed, on which device,
    for which object, the error, and what to do."""
    text = str(exc) or type(exc).__name__
    names = f"{type(exc).__name__} {text}"
    hint = next((h for keys, h in _HINTS if any(k in names for k in keys)), "see the CUDA error chained below")
    on = f" {key!r}" if key is not None else ""
    return f"cannot {what}{on} on {device}: {text} ({hint})"


def _is_cuda_error(exc: BaseException) -> bool:
    """True for CuPy's CUDA errors (CUDARuntimeError, CUDADriverError, OutOfMemoryError, ...)."""
    return type(exc).__module__.split(".")[0] in ("cupy", "cupy_backends")


@contextlib.contextmanager
def cuda_errors(what: str, key: str | None = None, device: int | None = None, name: str = "") -> Iterator[None]:
    """Turn the CUDA errors raised inside into :class:`DeviceError` (``raise ... from``): ``what`` failed
    for ``key`` on ``device`` (an ordinal; ``name`` its description, e.g. with the PCI bus id)."""
    try:
        yield
    except DeviceError:
        raise
    except Exception as exc:
        if not _is_cuda_error(exc):
            raise
        where = name or (f"GPU {device}" if device is not None else "the GPU")
        raise DeviceError(describe_cuda_error(exc, what, key, where), key, device) from exc


def compute_mode_problem(mode: int, name: str) -> str | None:
    """Why a device in compute mode ``mode`` cannot hold a shared arena (None: it can). One process
    (the spill process) holds the arena and every client maps it: a mode that lets one process at a time
    use the device locks the others out."""
    label = _COMPUTE_MODES.get(int(mode))
    if label is None:
        return None
    return (f"{name} is in compute mode {label}: the store's GPU arena needs the spill process and its "
            f"clients on the device at once (ask for DEFAULT mode, nvidia-smi -c DEFAULT, or use Level.MEMORY)")


def device_problem(ordinal: int, name: str) -> str | None:
    """Why this process cannot use device ``ordinal`` for the GPU level (None: it can); asked once."""
    cupy, why = cupy_or_reason()
    if cupy is None:
        return why
    if ordinal not in _MODES:
        with cuda_errors("read the compute mode", None, ordinal, name):
            _MODES[ordinal] = int(cupy.cuda.runtime.getDeviceProperties(ordinal).get("computeMode", 0))
    return compute_mode_problem(_MODES[ordinal], name)


def device_source() -> list[tuple[str, bytes]]:
    """(PCI bus id, UUID bytes) of each device this process sees, by ordinal (``gpumaps.DeviceIds``).

    Raises:
        DeviceError: no CuPy or no device here, or CUDA refused.
    """
    cupy = need_cupy("list the devices")
    rt = cupy.cuda.runtime
    with cuda_errors("list the devices"):
        return [(str(rt.deviceGetPCIBusId(d)), bytes(rt.getDeviceProperties(d).get("uuid", b"")))
                for d in range(rt.getDeviceCount())]


def settle(ordinal: int) -> None:
    """Wait until the work queued on the current stream of device ``ordinal`` finished: what the GPU level
    runs before it lets a view's pin go (``gpumaps.view_owner``).

    The current stream is the one the view's last use was queued on (the thread's, as CuPy and torch queue
    it; the legacy default stream also waits for the other blocking streams). Never a device-wide
    synchronise, which waits for all of the process's GPU work and breaks a CUDA graph being captured
    (``torch.compile`` "reduce-overhead"); while the stream captures, nothing it holds runs, and nothing
    is waited for.
    """
    cupy, _ = cupy_or_reason()
    if cupy is not None:
        with cupy.cuda.Device(ordinal):
            stream = cupy.cuda.get_current_stream()
            capturing = getattr(stream, "is_capturing", None)
            if capturing is not None and capturing():
                return
            stream.synchronize()


def allocate_shared(capacity: int, fraction: float, align: int, ordinal: int, name: str) -> tuple[int, int, bytes]:
    """A new allocation to share through CUDA IPC on device ``ordinal``: (its size, pointer, IPC handle).

    ``capacity`` bytes (0: ``fraction`` of the device's free memory), rounded down to ``align``. A
    ``cudaMalloc`` of its own: ``cudaIpcGetMemHandle`` needs the base of an allocation, never a pool's piece.

    Raises:
        DeviceError: CuPy is missing, or CUDA refused (device memory full ...).
    """
    cupy = need_cupy("make the GPU arena")
    rt = cupy.cuda.runtime
    with cuda_errors("allocate the GPU arena", None, ordinal, name), cupy.cuda.Device(ordinal):
        if not capacity:
            capacity = int(rt.memGetInfo()[0] * fraction)
        capacity &= ~(align - 1)
        ptr = rt.malloc(capacity)
        try:
            return capacity, ptr, bytes(rt.ipcGetMemHandle(ptr))
        except BaseException:
            rt.free(ptr)
            raise


def ipc_open(handle: bytes, ordinal: int) -> int:
    """Open another process's allocation (``cudaIpcOpenMemHandle``) on device ``ordinal``; its address."""
    cupy = need_cupy("map the GPU arena")
    with cupy.cuda.Device(ordinal):
        return int(cupy.cuda.runtime.ipcOpenMemHandle(bytes(handle), cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess))


def ipc_close(ptr: int) -> None:
    """Unmap an allocation :func:`ipc_open` opened."""
    cupy, _ = cupy_or_reason()
    if cupy is not None:
        cupy.cuda.runtime.ipcCloseMemHandle(ptr)


def device_free(ptr: int) -> None:
    """Free an allocation this process made (an arena it owns)."""
    cupy, _ = cupy_or_reason()
    if cupy is not None:
        cupy.cuda.runtime.free(ptr)


def is_device_array(obj: Any) -> bool:
    """True for a device array: anything with ``__cuda_array_interface__`` (CuPy, torch CUDA tensors, Numba)."""
    return hasattr(obj, "__cuda_array_interface__")


def to_host(dst: np.ndarray, src: Any) -> None:
    """Copy ``src`` (device or host bytes) into the host uint8 array ``dst``; zero bytes touch nothing.

    Raises:
        DeviceError: CuPy is missing here, or CUDA refused the copy.
    """
    if not dst.nbytes:
        return
    if is_device_array(src):
        cupy = need_cupy("copy to the host")
        with cuda_errors("copy to the host"):
            arr = flat_bytes(cupy, src)
            # the current stream of the array's device: after the work queued on it there
            with arr.device:
                stream = cupy.cuda.get_current_stream()
                arr[:dst.nbytes].get(stream=stream, out=dst)
                stream.synchronize()
    else:
        dst[...] = np.frombuffer(src, np.uint8, dst.nbytes)


def flat_bytes(cupy: Any, src: Any) -> Any:
    """The bytes of device array ``src`` in memory order, as a flat uint8 device array: no copy where it is
    contiguous in either order (an F-ordered array's bytes as they lie, which ``view(uint8)`` refuses for
    ndim > 1), a C-ordered copy where it is not contiguous."""
    arr = cupy.asarray(src)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        arr = cupy.ascontiguousarray(arr)
    return cupy.ndarray((arr.nbytes,), cupy.uint8, arr.data)


def copy_into(dst: Any, src: Any, nbytes: int, what: str, key: str | None = None) -> None:
    """Copy ``nbytes`` of ``src`` (a contiguous device array, or host bytes) into the device array ``dst``,
    on the current stream of ``dst``'s device (after the work already queued there: a user's stream, or
    the per-thread default stream), and synchronise that stream: the bytes have landed on return.

    Raises:
        DeviceError: CuPy is missing here, or CUDA refused the copy.
    """
    if not nbytes:
        return
    cupy = need_cupy(what, key)
    with cuda_errors(what, key, dst.device.id), dst.device:
        stream = cupy.cuda.get_current_stream()
        if is_device_array(src):
            dst.data.copy_from_device_async(cupy.asarray(src).data, nbytes, stream)
        else:
            host = src if isinstance(src, np.ndarray) else np.frombuffer(src, np.uint8, nbytes)
            dst.data.copy_from_host_async(host.ctypes.data, nbytes, stream)
        stream.synchronize()  # the source may go once this returns


class DeviceSink:
    """A writer's target on the GPU: a device array over an object's bytes, filled on the current stream.

    Owned by the writer (or incoming transfer) it was made for; not thread-safe.
    """

    def __init__(self, dst: Any, key: str | None = None) -> None:
        self._dst: Any = dst
        self._key = key

    def write(self, data: Any, pos: int) -> None:
        """Copy ``data`` (device or host bytes) in at ``pos``; synchronised before it returns.

        Raises:
            DeviceError: CuPy is missing here, or CUDA refused the copy.
        """
        if self._dst is None or not len(data):
            return
        if is_device_array(data):
            cupy = need_cupy("store", self._key)
            with cuda_errors("store", self._key, self._dst.device.id):
                data = flat_bytes(cupy, data)
        elif not isinstance(data, np.ndarray):
            data = np.frombuffer(data, np.uint8)
        else:
            data = np.ascontiguousarray(data)
        copy_into(self._dst[pos: pos + data.nbytes], data, data.nbytes, "store", self._key)

    def buffer(self) -> Any:
        return None  # a writer streams host bytes; an incoming transfer asks cuda_buffer()

    def cuda_buffer(self) -> Any:
        """The device array to receive into (CUDA-aware MPI)."""
        return self._dst

    def close(self) -> None:
        self._dst = None

    def abort(self) -> None:
        self._dst = None
