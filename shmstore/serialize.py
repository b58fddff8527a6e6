"""Turning values into bytes in shared memory and back, without copies on read.

Three kinds:

- raw: ``bytes``, ``bytearray``, ``memoryview`` are stored as they are and
  come back as a read-only ``memoryview``;
- ndarray: a plain numpy array (no object or structured dtype, ndim <= 8)
  is stored as its bytes in C or Fortran order, its dtype and shape in the
  table, and comes back as a read-only view;
- pickle: anything else, with pickle protocol 5; every contiguous array
  inside (a state dict of 1,000 tensors) becomes an out-of-band blob, and
  comes back as a read-only view into the object's bytes.
"""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from .copying import copy_into, copy_many
from .errors import SerializationError
from .kernel import layout as L

__all__ = ["Encoded", "encode", "write", "decode", "as_u8", "KIND_NAMES"]

KIND_NAMES = {L.KIND_RAW: "bytes", L.KIND_NDARRAY: "ndarray", L.KIND_PICKLE: "pickle"}
_EMPTY = np.empty(0, np.uint8)


class Encoded:
    """A value ready to be written: its kind, stored size and parts."""

    __slots__ = ("kind", "size", "nbytes", "nblobs", "array", "_src", "_pickle", "_blobs", "_offsets")

    def __init__(self, kind: int, size: int, nbytes: int) -> None:
        self.kind = kind
        self.size = size          # bytes it occupies
        self.nbytes = nbytes      # what ObjectInfo.size reports
        self.nblobs = 0
        self.array: tuple[str, tuple[int, ...], str] | None = None
        self._src: Any = None
        self._pickle = b""
        self._blobs: list[np.ndarray] = []
        self._offsets: list[int] = []


def as_u8(buf: Any) -> np.ndarray:
    """A flat uint8 view of any bytes-like value (a copy only if it is not contiguous)."""
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return _EMPTY
    if not mv.contiguous:
        mv = memoryview(mv.tobytes())
    return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, np.uint8)


def _array_fast_path(obj: Any) -> bool:
    if type(obj) is not np.ndarray:
        return False
    dt = obj.dtype
    return not dt.hasobject and dt.names is None and dt.subdtype is None and obj.ndim <= L.MAX_NDIM and len(dt.str) <= 16


def encode(obj: Any) -> Encoded:
    """Prepare ``obj`` for storing.

    Raises:
        SerializationError: the value cannot be pickled.
    """
    if isinstance(obj, (bytes, bytearray, memoryview)):
        src = as_u8(obj)
        enc = Encoded(L.KIND_RAW, src.nbytes, src.nbytes)
        enc._src = src
        return enc
    if _array_fast_path(obj):
        order = "F" if obj.flags.f_contiguous and not obj.flags.c_contiguous else "C"
        enc = Encoded(L.KIND_NDARRAY, obj.nbytes, obj.nbytes)
        enc.array = (obj.dtype.str, obj.shape, order)
        enc._src = obj
        return enc
    return _encode_pickle(obj)


def _encode_pickle(obj: Any) -> Encoded:
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception as exc:  # pickle raises many types: PicklingError, TypeError, AttributeError...
        raise SerializationError(f"cannot pickle {type(obj).__name__}: {exc}") from exc
    blobs = [as_u8(b.raw()) for b in buffers]
    size, offsets = L.plan_object(len(data), [b.nbytes for b in blobs])
    enc = Encoded(L.KIND_PICKLE, size, size)
    enc.nblobs = len(blobs)
    enc._pickle, enc._blobs, enc._offsets = data, blobs, offsets
    return enc


def write(enc: Encoded, dst: np.ndarray) -> None:
    """Write ``enc`` into the writable uint8 array ``dst`` (at least ``enc.size`` long)."""
    if enc.kind == L.KIND_RAW:
        if enc.size:
            copy_into(dst[: enc.size], enc._src)
    elif enc.kind == L.KIND_NDARRAY:
        dtype, shape, order = enc.array  # type: ignore[misc]
        if enc.size:
            view = np.ndarray(shape, np.dtype(dtype), buffer=dst, order=order)
            copy_into(view, enc._src)
    else:
        _write_pickle(enc, dst)


def _write_pickle(enc: Encoded, dst: np.ndarray) -> None:
    blobs = enc._blobs
    L.pack_object_header(dst, 0, len(enc._pickle), [(o, b.nbytes) for o, b in zip(enc._offsets, blobs)])
    start = L.object_header_size(len(blobs))
    pairs = [(dst[start: start + len(enc._pickle)], np.frombuffer(enc._pickle, np.uint8))]
    pairs += [(dst[o: o + b.nbytes], b) for o, b in zip(enc._offsets, blobs) if b.nbytes]
    copy_many(pairs)


def decode(kind: int, base: np.ndarray, nbytes: int, array: tuple[str, tuple[int, ...], str] | None) -> Any:
    """Rebuild a value from its stored bytes ``base`` (a read-only uint8 view).

    Arrays in the result are views into ``base``; they keep it alive.

    Raises:
        SerializationError: the stored pickle does not load here.
    """
    if kind == L.KIND_RAW:
        return memoryview(base[:nbytes])
    if kind == L.KIND_NDARRAY:
        dtype, shape, order = array  # type: ignore[misc]
        return np.ndarray(shape, np.dtype(dtype), buffer=base, order=order)
    start, plen, blobs = L.unpack_object_header(base)
    try:
        return pickle.loads(base[start: start + plen], buffers=[base[o: o + n] for o, n in blobs])
    except Exception as exc:
        raise SerializationError(f"cannot unpickle stored value: {exc}") from exc
