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

from .copying import PARALLEL_MIN, copy_into, copy_many
from .errors import SerializationError
from .kernel import layout as L

__all__ = ["Encoded", "encode", "write", "decode", "as_u8", "KIND_NAMES"]

KIND_NAMES = {L.KIND_RAW: "bytes", L.KIND_NDARRAY: "ndarray", L.KIND_PICKLE: "pickle"}
_EMPTY = np.empty(0, np.uint8)


class Encoded:
    """A value ready to be written: its kind, stored size and parts."""

    __slots__ = ("kind", "size", "nbytes", "nblobs", "meta", "src", "array", "pickle", "blobs", "offsets")

    def __init__(self, kind: int, size: int, nbytes: int, nblobs: int = 0, meta: bytes | None = None,
                 src: Any = None, array: tuple | None = None) -> None:
        self.kind = kind
        self.size = size          # bytes it occupies
        self.nbytes = nbytes      # what ObjectInfo.size reports
        self.nblobs = nblobs
        self.meta = meta          # ENTRY_ARRAY bytes of an ndarray
        self.src = src
        self.array = array        # (dtype, shape, order) of an ndarray
        self.pickle = b""
        self.blobs: list[np.ndarray] = []
        self.offsets: list[int] = []


_FAST_DTYPES: dict[np.dtype, str | None] = {}


def _fast_dtype(dt: np.dtype) -> str | None:
    """dtype.str if arrays of this dtype take the ndarray path, else None."""
    s = _FAST_DTYPES.get(dt, False)
    if s is False:
        ok = not dt.hasobject and dt.names is None and dt.subdtype is None and len(dt.str) <= 16
        s = _FAST_DTYPES[dt] = dt.str if ok else None
    return s  # type: ignore[return-value]


def as_u8(buf: Any) -> np.ndarray:
    """A flat uint8 view of any bytes-like value (a copy only if it is not contiguous)."""
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return _EMPTY
    if not mv.contiguous:
        mv = memoryview(mv.tobytes())
    return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, np.uint8)


def encode(obj: Any) -> Encoded:
    """Prepare ``obj`` for storing.

    Raises:
        SerializationError: the value cannot be pickled.
    """
    if type(obj) is np.ndarray and obj.ndim <= L.MAX_NDIM:
        dts = _fast_dtype(obj.dtype)
        if dts is not None:
            flags = obj.flags
            order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
            n = obj.nbytes
            return Encoded(L.KIND_NDARRAY, n, n, 0, L.array_meta(dts, obj.shape, order), obj,
                           (obj.dtype, obj.shape, order))
    if isinstance(obj, (bytes, bytearray, memoryview)):
        src = as_u8(obj)
        return Encoded(L.KIND_RAW, src.nbytes, src.nbytes, src=src)
    return _encode_pickle(obj)


def _encode_pickle(obj: Any) -> Encoded:
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception as exc:  # pickle raises many types: PicklingError, TypeError, AttributeError...
        raise SerializationError(f"cannot pickle {type(obj).__name__}: {exc}") from exc
    blobs = [as_u8(b.raw()) for b in buffers]
    size, offsets = L.plan_object(len(data), [b.nbytes for b in blobs])
    enc = Encoded(L.KIND_PICKLE, size, size, len(blobs))
    enc.pickle, enc.blobs, enc.offsets = data, blobs, offsets
    return enc


def write(enc: Encoded, buf: Any, off: int) -> None:
    """Write ``enc`` into the writable buffer ``buf`` (the arena) at ``off``."""
    if not enc.size:
        return
    if enc.kind == L.KIND_NDARRAY:
        dtype, shape, order = enc.array  # type: ignore[misc]
        dst = np.ndarray(shape, dtype, buf, off, None, order)
        if enc.size < PARALLEL_MIN:
            np.copyto(dst, enc.src, casting="no")
        else:
            copy_into(dst, enc.src)
    elif enc.kind == L.KIND_RAW:
        copy_into(np.ndarray((enc.size,), np.uint8, buf, off), enc.src)
    else:
        _write_pickle(enc, np.ndarray((enc.size,), np.uint8, buf, off))


def _write_pickle(enc: Encoded, dst: np.ndarray) -> None:
    blobs = enc.blobs
    L.pack_object_header(dst, 0, len(enc.pickle), [(o, b.nbytes) for o, b in zip(enc.offsets, blobs)])
    start = L.object_header_size(len(blobs))
    pairs = [(dst[start: start + len(enc.pickle)], np.frombuffer(enc.pickle, np.uint8))]
    pairs += [(dst[o: o + b.nbytes], b) for o, b in zip(enc.offsets, blobs) if b.nbytes]
    copy_many(pairs)


def decode(kind: int, base: np.ndarray, nbytes: int) -> Any:
    """Rebuild a raw or pickled value from its stored bytes ``base`` (a read-only uint8 lease).

    Arrays in the result are views into ``base``; they keep it alive.
    (ndarray values are rebuilt by the kernel straight from the table.)

    Raises:
        SerializationError: the stored pickle does not load here.
    """
    if kind == L.KIND_RAW:
        return memoryview(base[:nbytes])
    raw = base.view(np.ndarray)  # plain slices whose base is the lease
    start, plen, blobs = L.unpack_object_header(raw)
    try:
        return pickle.loads(raw[start: start + plen], buffers=[raw[o: o + n] for o, n in blobs])
    except Exception as exc:
        raise SerializationError(f"cannot unpickle stored value: {exc}") from exc
