"""A CuPy stand-in for machines without a CUDA device (see ../README.md): arrays over "device" memory.

An :class:`ndarray` is a NumPy array over the memory its ``data`` pointer names, with CuPy's manners:
it refuses implicit conversion to NumPy (``np.asarray(a)`` raises ``TypeError``; use ``.get()``), mixes
with no NumPy array in arithmetic, gives reductions as 0-d arrays, and its memory is held by the
``MemoryPointer`` -> ``UnownedMemory`` -> owner chain as CuPy's is (views hold their base's pointer).
"""
from __future__ import annotations

import ctypes
import operator
from typing import Any

import numpy as np

from . import cuda, random  # noqa: F401  (cupy.random)
from .cuda import MemoryPointer, PoolMemory, UnownedMemory

__version__ = "14.2.0+fakecuda"
FAKE = True  # tests may say which CuPy ran them

bool_, int8, int16, int32, int64 = np.bool_, np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
float16, float32, float64, complex64, complex128 = np.float16, np.float32, np.float64, np.complex64, np.complex128
newaxis = None


def _over(ptr: int, nbytes: int) -> np.ndarray:
    """The bytes at device address ``ptr`` as a writable NumPy uint8 array (no copy)."""
    if not nbytes or not ptr:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class ndarray:
    """CuPy's ndarray: ``ndarray(shape, dtype, memptr, strides, order)`` over device memory."""

    __array_priority__ = 100.0
    __array_ufunc__ = None  # NumPy defers to us, and we refuse NumPy operands as CuPy does
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, shape: Any, dtype: Any = float, memptr: MemoryPointer | None = None,
                 strides: Any = None, order: str = "C") -> None:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if memptr is None:
            memptr = MemoryPointer(PoolMemory(n), 0)
        span = n if strides is None else (
            0 if not n else sum((s - 1) * abs(st) for s, st in zip(shape, strides)) + dtype.itemsize)
        raw = _over(memptr.ptr, span)
        a = np.ndarray(shape, dtype, buffer=raw, strides=strides, order=order) if n else np.empty(shape, dtype, order)
        self._init(a, memptr)

    @classmethod
    def _of(cls, a: np.ndarray, memptr: MemoryPointer) -> ndarray:
        obj = cls.__new__(cls)
        obj._init(a, memptr)
        return obj

    def _init(self, a: np.ndarray, memptr: MemoryPointer) -> None:
        self._a, self.data = a, memptr

    # ---- what it is -------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: self.transpose())

    @property
    def device(self) -> cuda.Device:
        return cuda.Device(self.data.device_id)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        a = self._a
        strides = None if a.flags.c_contiguous else a.strides
        return {"shape": a.shape, "typestr": a.dtype.str, "descr": a.dtype.descr, "data": (self.data.ptr, False),
                "strides": strides, "version": 3, "stream": 1}

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def __repr__(self) -> str:
        return "array(" + np.array2string(self._a, separator=", ") + ")"

    __str__ = __repr__

    # ---- to and from the host -------------------------------------------------------
    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None, blocking: bool = True) -> Any:
        if out is None:
            return np.array(self._a, order=order)
        if not isinstance(out, np.ndarray) or out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError("Shape mismatch" if isinstance(out, np.ndarray) else "Only numpy.ndarray can be "
                             "obtained from cupy.ndarray")
        out[...] = self._a
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        self._a[...] = arr

    def tolist(self) -> Any:
        return self._a.tolist()

    def item(self) -> Any:
        return self._a.item()

    # ---- results: a view shares this array's memory, anything else is new memory --------------
    def _wrap(self, r: Any) -> Any:
        if isinstance(r, np.ndarray):
            if r.size and np.may_share_memory(r, self._a):
                at = self.data.offset + r.ctypes.data - self._a.ctypes.data
                return ndarray._of(r, MemoryPointer(self.data.mem, at))
            return _new(r)
        if isinstance(r, np.generic):  # a reduction: CuPy gives a 0-d device array
            return _new(np.asarray(r))
        return r

    def __getitem__(self, idx: Any) -> Any:
        return self._wrap(self._a[_plain(idx)])

    def __setitem__(self, idx: Any, value: Any) -> None:
        self._a[_plain(idx)] = _plain(value)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Any:
        if not self.ndim:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self)))

    def __bool__(self) -> bool:
        return bool(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __complex__(self) -> complex:
        return complex(self._a)

    def view(self, dtype: Any = None) -> ndarray:
        return self._wrap(self._a.view(dtype))

    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        return self._wrap(self._a.reshape(*shape, order=order))

    def astype(self, dtype: Any, order: str = "K", copy: bool = True) -> ndarray:
        return self._wrap(self._a.astype(dtype, order=order, copy=copy))

    def copy(self, order: str = "C") -> ndarray:
        return _new(self._a.copy(order=order))

    def fill(self, value: Any) -> None:
        self._a.fill(value)


def _plain(x: Any) -> Any:
    """Operands as NumPy sees them: device arrays unwrapped, host arrays refused (as CuPy refuses them)."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray) and x.ndim:
        raise TypeError(f"Unsupported type {type(x)}")
    if isinstance(x, tuple):
        return tuple(_plain(i) for i in x)
    return x


def _new(a: np.ndarray) -> ndarray:
    """A device array holding NumPy array ``a``'s bytes (new memory)."""
    if not (a.flags.c_contiguous or a.flags.f_contiguous) or not a.flags.owndata and a.ndim == 0:
        a = np.array(a, order="C")
    return ndarray._of(a, MemoryPointer(PoolMemory(a.nbytes, a), 0))


def _method(name: str) -> Any:
    def call(self: ndarray, *args: Any, **kwargs: Any) -> Any:
        args = tuple(_plain(a) for a in args)
        return self._wrap(getattr(self._a, name)(*args, **{k: _plain(v) for k, v in kwargs.items()}))
    call.__name__ = name
    return call


for _name in ("sum", "prod", "all", "any", "min", "max", "mean", "std", "var", "argmax", "argmin", "cumsum",
              "ravel", "flatten", "transpose", "squeeze", "swapaxes", "dot", "clip", "repeat", "take", "nonzero",
              "round", "conj"):
    setattr(ndarray, _name, _method(_name))


def _binary(op: Any, reflected: bool = False) -> Any:
    def call(self: ndarray, other: Any) -> Any:
        o = _plain(other)
        return self._wrap(op(o, self._a) if reflected else op(self._a, o))
    return call


def _inplace(op: Any) -> Any:
    def call(self: ndarray, other: Any) -> ndarray:
        op(self._a, _plain(other))
        return self
    return call


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
                   ("pow", operator.pow), ("and", operator.and_), ("or", operator.or_), ("xor", operator.xor),
                   ("lshift", operator.lshift), ("rshift", operator.rshift), ("matmul", operator.matmul)):
    setattr(ndarray, f"__{_name}__", _binary(_op))
    setattr(ndarray, f"__r{_name}__", _binary(_op, reflected=True))
    setattr(ndarray, f"__i{_name}__", _inplace(getattr(operator, f"i{_name}")))
for _name, _op in (("eq", operator.eq), ("ne", operator.ne), ("lt", operator.lt), ("le", operator.le),
                   ("gt", operator.gt), ("ge", operator.ge)):
    setattr(ndarray, f"__{_name}__", _binary(_op))
for _name, _op in (("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs), ("invert", operator.invert)):
    setattr(ndarray, f"__{_name}__", lambda self, _op=_op: self._wrap(_op(self._a)))


# ---- making arrays ------------------------------------------------------------------
def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(shape, dtype, order=order)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return _new(np.zeros(shape, dtype, order))


def ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return _new(np.ones(shape, dtype, order))


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    return _new(np.full(shape, fill_value, dtype, order))


def arange(*args: Any, **kwargs: Any) -> ndarray:
    return _new(np.arange(*args, **kwargs))


def empty_like(a: ndarray, dtype: Any = None) -> ndarray:
    return empty(a.shape, dtype or a.dtype)


def zeros_like(a: ndarray, dtype: Any = None) -> ndarray:
    return zeros(a.shape, dtype or a.dtype)


def ones_like(a: ndarray, dtype: Any = None) -> ndarray:
    return ones(a.shape, dtype or a.dtype)


def _from_interface(obj: Any) -> ndarray:
    """A device array over another library's device memory (``__cuda_array_interface__``), no copy."""
    cai = obj.__cuda_array_interface__
    dtype, shape, strides = np.dtype(cai["typestr"]), tuple(cai["shape"]), cai.get("strides")
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    mem = UnownedMemory(cai["data"][0], n, obj, getattr(getattr(obj, "device", None), "id", None))
    return ndarray(shape, dtype, MemoryPointer(mem, 0), strides=strides)


def asarray(a: Any, dtype: Any = None, order: str | None = None) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    if hasattr(a, "__cuda_array_interface__"):
        arr = _from_interface(a)
        return arr if dtype is None else arr.astype(dtype)
    return _new(np.array(a, dtype=dtype, order=order or "K"))  # from the host: copied up


def array(a: Any, dtype: Any = None, copy: bool = True, order: str = "K") -> ndarray:
    arr = asarray(a, dtype)
    return arr.copy(order="C" if order == "K" else order) if copy and arr is a else arr


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    a = asarray(a, dtype)
    return a if a.flags.c_contiguous else _new(np.ascontiguousarray(a._a))


def asfortranarray(a: Any, dtype: Any = None) -> ndarray:
    a = asarray(a, dtype)
    if a.flags.f_contiguous:
        return a
    return _new(np.asfortranarray(a._a))


def asnumpy(a: Any, stream: Any = None, order: str = "C", out: np.ndarray | None = None) -> np.ndarray:
    return a.get(order=order, out=out) if isinstance(a, ndarray) else np.asarray(a, order=order)


def array_equal(a: Any, b: Any) -> ndarray:
    return _new(np.asarray(np.array_equal(_plain(a), _plain(b))))


def allclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08) -> ndarray:
    return _new(np.asarray(np.allclose(_plain(a), _plain(b), rtol, atol)))


def get_array_module(*args: Any) -> Any:
    import sys
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np
