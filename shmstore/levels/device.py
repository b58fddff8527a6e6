"""CuPy, imported here only, lazily (extra ``gpu``), and the few host/device helpers every level uses.

Without CuPy, or without a device, or with ``SHMSTORE_NO_GPU`` set true,
:func:`cupy_or_reason` says why, the GPU level reports itself unavailable
with that reason, and every other level works.
"""
from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from ..config import no_gpu

__all__ = ["cupy_or_reason", "is_device_array", "to_host"]

_CUPY: list[tuple[Any, str | None]] = []  # the answer, asked once per process


def cupy_or_reason() -> tuple[Any, str | None]:
    """(the cupy module, None), or (None, why the GPU level cannot be used here). Asked once per process."""
    if not _CUPY:
        _CUPY.append(_probe())
    return _CUPY[0]


def _probe() -> tuple[Any, str | None]:
    if no_gpu():
        return None, "SHMSTORE_NO_GPU is set"
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


def is_device_array(obj: Any) -> bool:
    """True for a device array: anything with ``__cuda_array_interface__`` (CuPy, torch CUDA tensors, Numba)."""
    return hasattr(obj, "__cuda_array_interface__")


def to_host(dst: np.ndarray, src: Any) -> None:
    """Copy ``src`` (device or host bytes) into the host uint8 array ``dst``; zero bytes touch nothing."""
    if not dst.nbytes:
        return
    if is_device_array(src):
        cupy, _ = cupy_or_reason()
        cupy.asarray(src).view(cupy.uint8).reshape(-1)[:dst.nbytes].get(out=dst)
        cupy.cuda.get_current_stream().synchronize()
    else:
        dst[...] = np.frombuffer(src, np.uint8, dst.nbytes)
