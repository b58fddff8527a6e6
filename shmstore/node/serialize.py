"""Turning values into bytes in shared memory and back, without copies on read.

Three kinds:

- raw: ``bytes``, ``bytearray``, ``memoryview`` are stored as they are and
  come back as a read-only ``memoryview``;
- ndarray: a plain numpy array (no object or structured dtype, ndim <= 8)
  is stored as its bytes in C or Fortran order, its dtype and shape in the
  table, and comes back as a read-only view;
- pickle: anything else, with pickle protocol 5; every contiguous array
  inside (a state dict of 1,000 tensors) becomes a blob, and comes back as
  a read-only view into the object's bytes. What plain pickle refuses
  (lambdas, closures, classes defined in a function or in ``__main__``)
  is pickled by cloudpickle, imported only then; plain ``pickle`` loads
  the result wherever cloudpickle is installed.

Torch CPU tensors (alone or in a state dict; torch is never imported here,
only recognised once the application has imported it) are stored the same
way, as their raw bytes plus dtype and shape, and come back as tensors over
the store's memory: zero-copy, over the arena's read-only mapping. torch has
no read-only tensors, so it lets an in-place write into one start; the
mapping faults it and the writing process dies with SIGSEGV, the object
unchanged for every reader (``clone()`` to change one). Device tensors,
sparse and quantized ones take torch's own pickling.
"""
from __future__ import annotations

import importlib
import io
import pickle
import struct
import sys
import warnings
from typing import Any

import numpy as np

from ..errors import SerializationError
from ..meta import layout as L
from ..primitives.copying import copy_blobs, copy_into
from .views import ARRAY_TYPES

__all__ = ["Encoded", "encode", "encode_pickle", "write", "parts", "decode", "as_u8", "KIND_NAMES",
           "plan_object", "pack_object_header", "unpack_object_header", "object_header_size"]

KIND_NAMES = {L.KIND_RAW: "bytes", L.KIND_NDARRAY: "ndarray", L.KIND_PICKLE: "pickle"}
_EMPTY = np.empty(0, np.uint8)


class Encoded:
    """A value ready to be written: its kind, stored size and parts."""

    __slots__ = ("kind", "size", "nbytes", "nblobs", "meta", "src", "array", "pickle", "blobs", "offsets", "device")

    def __init__(self, kind: int, size: int, nbytes: int, nblobs: int = 0, meta: bytes | None = None,
                 src: Any = None, array: tuple[Any, ...] | None = None) -> None:
        self.kind = kind
        self.size = size          # bytes it occupies
        self.nbytes = nbytes      # what ObjectInfo.size reports
        self.nblobs = nblobs
        self.meta = meta          # ENTRY_ARRAY bytes of an ndarray
        self.src = src
        self.array = array        # (dtype, shape, order) of an ndarray
        self.pickle: Any = b""  # bytes, or the pickler's buffer
        self.blobs: list[Any] = []  # arrays or memoryviews: anything exporting a buffer
        self.offsets: list[int] = []
        self.device = False  # src is a device array (``__cuda_array_interface__``)


_FAST_DTYPES: dict[np.dtype, str | None] = {}


def _fast_dtype(dt: np.dtype) -> str | None:
    """dtype.str if arrays of this dtype take the ndarray path, else None."""
    s = _FAST_DTYPES.get(dt, False)
    if s is False:
        ok = not dt.hasobject and dt.names is None and dt.subdtype is None and len(dt.str) <= 16
        s = _FAST_DTYPES[dt] = dt.str if ok else None
    return s  # type: ignore[return-value]


def as_u8(buf: Any) -> np.ndarray:
    """A flat uint8 view of any bytes-like value: its bytes as ``bytes(buf)`` has them (in C order), a copy only
    if they are not C-contiguous (a Fortran-ordered or strided view: ``memoryview.cast`` takes C order only).

    Raises:
        TypeError: not bytes-like. ValueError: a released memoryview.
    """
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return _EMPTY
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, np.uint8)


def encode(obj: Any) -> Encoded:
    """Prepare ``obj`` for storing.

    Raises:
        SerializationError: the value cannot be pickled.
    """
    if type(obj) in ARRAY_TYPES and obj.ndim <= L.MAX_NDIM:
        dts = _fast_dtype(obj.dtype)
        if dts is not None:
            flags = obj.flags
            order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
            n = obj.nbytes
            return Encoded(L.KIND_NDARRAY, n, n, 0, L.array_meta(dts, obj.shape, order), obj,
                           (obj.dtype, obj.shape, order))
    if type(obj) is bytes:  # the common raw value: one numpy call
        src = np.frombuffer(obj, np.uint8) if obj else _EMPTY
        return Encoded(L.KIND_RAW, src.nbytes, src.nbytes, src=src)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        try:
            src = as_u8(obj)
        except (TypeError, ValueError, BufferError) as exc:  # a released memoryview, an exporter that refuses
            raise SerializationError(f"cannot store {type(obj).__name__}: {exc}") from exc
        return Encoded(L.KIND_RAW, src.nbytes, src.nbytes, src=src)
    if hasattr(obj, "__cuda_array_interface__"):
        enc = _encode_device(obj)
        if enc is not None:
            return enc
    return encode_pickle(obj)


def _encode_device(obj: Any) -> Encoded | None:
    """A device array (CuPy, a torch CUDA tensor, anything with ``__cuda_array_interface__``) as an ndarray
    value whose bytes stay on the device until a level copies them; None to pickle it instead."""
    cupy = sys.modules.get("cupy") or importlib.import_module("cupy")
    arr = cupy.asarray(obj)  # no copy: a view through the interface
    dts = _fast_dtype(arr.dtype)
    if dts is None or arr.ndim > L.MAX_NDIM:
        return None
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        arr = cupy.ascontiguousarray(arr)
    order = "F" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C"
    enc = Encoded(L.KIND_NDARRAY, arr.nbytes, arr.nbytes, 0, L.array_meta(dts, arr.shape, order), arr,
                  (arr.dtype, arr.shape, order))
    enc.device = True
    return enc


class _Pickler(pickle.Pickler):
    """Pickle protocol 5 that stores contiguous numpy arrays as raw blobs.

    Each array reduces to ``np.ndarray(shape, dtype, <out-of-band buffer>, 0,
    None, order)``: on load, numpy's own constructor builds it straight over
    the stored bytes, with no Python frame per array (a 1,000-array state
    dict loads in about 2 ms). ``reducer_override`` is not called for builtin
    containers and scalars, so pickling costs one Python call per array.
    """

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5, buffer_callback=self._buffer)
        self.blobs: list[memoryview] = []

    def _buffer(self, pb: pickle.PickleBuffer) -> None:
        try:
            self.blobs.append(pb.raw())
        except BufferError:  # a foreign non-contiguous buffer: copy it
            self.blobs.append(memoryview(memoryview(pb).tobytes()))

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) not in ARRAY_TYPES:
            return _reduce_tensor(obj) if type(obj) in _tensor_types() else NotImplemented
        if obj.ndim > L.MAX_NDIM or _fast_dtype(obj.dtype) is None:
            return _unexportable(obj)
        flags = obj.flags
        if flags.c_contiguous:
            order = "C"
        elif flags.f_contiguous:
            order = "F"
        else:
            return _unexportable(obj)  # numpy's own reduction, in band
        # datetime64 and timedelta64 export no buffer ("cannot include dtype 'M' in a buffer"): their bytes are
        # int64 ones, rebuilt as the same dtype over the stored bytes (no copy either way)
        data = obj.view(obj.dtype.str[0] + "i8") if obj.dtype.kind in "mM" else obj
        return np.ndarray, (obj.shape, obj.dtype, pickle.PickleBuffer(data), 0, None, order)


def _unexportable(obj: np.ndarray) -> Any:
    """NotImplemented (numpy's own reduction: out of band where it can) for an array numpy can export a buffer of;
    numpy's in-band reduction (its bytes copied into the stream) for one it cannot, whose own protocol-5
    reduction would fail: a structured dtype with a datetime64 field, a non-contiguous datetime64 array."""
    if obj.dtype.hasobject or obj.dtype.kind not in "mMV":
        return NotImplemented
    try:
        memoryview(obj)  # type: ignore[arg-type]  # numpy arrays are buffers; the stubs say otherwise
    except (ValueError, BufferError, TypeError):
        return obj.__reduce_ex__(4)
    return NotImplemented


_CLOUD: list[type] = []


def _cloud_pickler(exc: Exception, obj: Any) -> type:
    """:class:`_Pickler` over cloudpickle's Pickler (arrays still blobs), defined on first use.

    Raises:
        SerializationError: cloudpickle is not installed (naming ``exc``, plain pickle's refusal).
    """
    if _CLOUD:
        return _CLOUD[0]
    try:
        cloudpickle = importlib.import_module("cloudpickle")
    except ImportError:
        raise SerializationError(f"cannot pickle {type(obj).__name__}: {exc} (pip install cloudpickle to store "
                                 f"lambdas, closures and local classes)") from exc

    class _CloudPickler(_Pickler, cloudpickle.Pickler):  # type: ignore[misc,name-defined]
        """Arrays and tensors as blobs (``_Pickler``), functions and classes by value (cloudpickle)."""

        def reducer_override(self, obj: Any) -> Any:
            r = _Pickler.reducer_override(self, obj)
            return cloudpickle.Pickler.reducer_override(self, obj) if r is NotImplemented else r

    _CLOUD.append(_CloudPickler)
    return _CloudPickler


_TENSOR_TYPES: list[tuple[type, ...]] = []


def _tensor_types() -> tuple[type, ...]:
    """torch.Tensor and torch.nn.Parameter once the application has imported torch, else ()."""
    if _TENSOR_TYPES:
        return _TENSOR_TYPES[0]
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "nn"):  # not imported (or half way through importing)
        return ()
    _TENSOR_TYPES.append((torch.Tensor, torch.nn.Parameter))
    return _TENSOR_TYPES[0]


def _reduce_tensor(t: Any) -> Any:
    """A CPU strided tensor as (its bytes as a uint8 array, dtype, shape): a blob, rebuilt over the store."""
    torch = sys.modules["torch"]
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_nested:
        return NotImplemented  # torch's own pickling, in band
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    dtype = str(t.dtype).rsplit(".", 1)[1]
    return _tensor, (raw, dtype, tuple(t.shape), bool(t.requires_grad), type(t) is not torch.Tensor)


def _tensor(raw: np.ndarray, dtype: str, shape: tuple[int, ...], requires_grad: bool, parameter: bool) -> Any:
    """Rebuild a tensor over ``raw`` (a read-only view into the store: no copy)."""
    torch = importlib.import_module("torch")  # it pickled a tensor: torch is there (typed Any: an optional dep)
    with warnings.catch_warnings():  # torch warns that the array is read-only: it is, by design
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(raw) if raw.size else torch.empty(0, dtype=torch.uint8)
    t = t.view(getattr(torch, dtype)).reshape(shape)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def encode_pickle(obj: Any) -> Encoded:
    """``obj`` pickled (protocol 5, arrays as blobs); with cloudpickle where plain pickle refuses it.

    Lambdas, closures, functions and classes defined in ``__main__`` or
    inside a function cannot be pickled by reference; cloudpickle pickles
    them by value (imported only then). Its output is ordinary pickle
    data: any process with cloudpickle installed loads it with plain
    ``pickle`` (the stored stream imports what it needs).

    Raises:
        SerializationError: neither pickle nor cloudpickle can pickle it.
    """
    f = io.BytesIO()
    p: _Pickler = _Pickler(f)
    try:
        p.dump(obj)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:  # "can't pickle local object", a lambda...
        f = io.BytesIO()
        p = _cloud_pickler(exc, obj)(f)
        try:
            p.dump(obj)
        except Exception as exc2:
            raise SerializationError(f"cannot pickle {type(obj).__name__}: {exc} (cloudpickle: {exc2})") from exc
    except Exception as exc:  # pickle raises many types; these no other pickler would take either
        raise SerializationError(f"cannot pickle {type(obj).__name__}: {exc}") from exc
    data = f.getbuffer()
    size, offsets = plan_object(len(data), [b.nbytes for b in p.blobs])
    enc = Encoded(L.KIND_PICKLE, size, size, len(p.blobs))
    enc.pickle, enc.blobs, enc.offsets = data, p.blobs, offsets
    return enc


def write(enc: Encoded, buf: Any, off: int) -> None:
    """Write ``enc`` into the writable buffer ``buf`` (the arena) at ``off``."""
    if not enc.size:
        return
    if enc.kind == L.KIND_NDARRAY:
        dtype, shape, order = enc.array  # type: ignore[misc]
        if enc.device:  # down from the device: one copy into place
            enc.src.get(out=np.ndarray(shape, dtype, buf, off, None, order))
            return
        copy_into(np.ndarray(shape, dtype, buf, off, None, order), enc.src)
    elif enc.kind == L.KIND_RAW:
        copy_into(np.ndarray((enc.size,), np.uint8, buf, off), enc.src)
    else:
        _write_pickle(enc, np.ndarray((enc.size,), np.uint8, buf, off))


def parts(enc: Encoded) -> list[tuple[int, Any]]:
    """The stored bytes of ``enc`` as ``(offset, bytes)`` pieces, for writing a file."""
    if not enc.size:
        return []
    if enc.kind == L.KIND_RAW:
        return [(0, memoryview(enc.src))]
    if enc.kind == L.KIND_NDARRAY:
        dtype, shape, order = enc.array  # type: ignore[misc]
        src = enc.src.get(order=order) if enc.device else enc.src
        if not (src.flags.c_contiguous if order == "C" else src.flags.f_contiguous):
            src = np.array(src, order=order)
        return [(0, pickle.PickleBuffer(src).raw())]
    header = bytearray(object_header_size(len(enc.blobs)))
    pack_object_header(header, 0, len(enc.pickle), [(o, b.nbytes) for o, b in zip(enc.offsets, enc.blobs)])
    out = [(0, memoryview(header)), (len(header), memoryview(enc.pickle))]
    return out + [(o, b) for o, b in zip(enc.offsets, enc.blobs) if b.nbytes]


def _write_pickle(enc: Encoded, dst: np.ndarray) -> None:
    blobs = enc.blobs
    pack_object_header(dst.data, 0, len(enc.pickle), [(o, b.nbytes) for o, b in zip(enc.offsets, blobs)])
    items = [(object_header_size(len(blobs)), enc.pickle)]
    items += [(o, b) for o, b in zip(enc.offsets, blobs) if b.nbytes]
    copy_blobs(dst, items)


def decode(kind: int, base: np.ndarray, nbytes: int) -> Any:
    """Rebuild a raw or pickled value from its stored bytes ``base`` (a read-only uint8 lease).

    Arrays in the result are views into ``base``; they keep it alive.
    (ndarray values are rebuilt by the kernel straight from the table.)

    Raises:
        SerializationError: the stored pickle does not load here.
    """
    if kind == L.KIND_RAW:
        return base[:nbytes].data
    start, plen, blobs = unpack_object_header(base)
    mv = base.data  # arrays built on slices of it keep ``base`` (the lease) as their base
    try:
        return pickle.loads(mv[start: start + plen], buffers=[mv[o: o + n] for o, n in blobs])
    except Exception as exc:
        raise SerializationError(f"cannot unpickle stored value: {exc}") from exc


# ---- the pickled-object format: OBJECT_HEADER, BLOB records, the pickle, the blobs ---------------------

def object_header_size(nblobs: int) -> int:
    return L.OBJECT_HEADER.size + nblobs * L.BLOB.size


def plan_object(pickle_len: int, blob_lens: list[int]) -> tuple[int, list[int]]:
    """Total size and blob offsets of a pickled object with these parts."""
    pos = L.align(object_header_size(len(blob_lens)) + pickle_len)
    offsets = []
    for n in blob_lens:
        offsets.append(pos)
        pos = L.align(pos + n)
    return max(pos, L.ALIGN), offsets


def pack_object_header(buf: Any, off: int, pickle_len: int, blobs: list[tuple[int, int]]) -> None:
    """Write the header of a pickled object: ``blobs`` are (offset, length) in pickle order."""
    L.OBJECT_HEADER.pack(buf, off, nblobs=len(blobs), pickle_len=pickle_len)
    if blobs:  # BLOB records, back to back: one store
        flat = [v for b in blobs for v in b]
        at = off + L.OBJECT_HEADER.size
        buf[at: at + L.BLOB.size * len(blobs)] = struct.pack(f"<{len(flat)}Q", *flat)


def unpack_object_header(buf: Any, off: int = 0) -> tuple[int, int, list[tuple[int, int]]]:
    """(pickle start, pickle length, [(blob offset, blob length)]) relative to ``off``."""
    h = L.OBJECT_HEADER.unpack(buf, off)
    flat = struct.unpack_from(f"<{2 * h.nblobs}Q", buf, off + L.OBJECT_HEADER.size)
    return object_header_size(h.nblobs), h.pickle_len, list(zip(flat[0::2], flat[1::2]))
