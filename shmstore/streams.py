"""File-like access to objects: :class:`Writer` fills, :class:`Reader` streams.

A writer reserves the whole object up front (invisible until sealed) and is
sealed by ``close``; any error, or closing short of the declared size, drops
it and gives its space back. A reader pins the object while open, so spill
never moves it underneath and a delete waits for it.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, StoreClosedError
from .kernel import layout as L
from .kernel.kernel import Kernel, encode_key
from .serialize import as_u8
from .units import format_size

__all__ = ["Writer", "Reader"]


def _check_size(key: str, size: Any) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise InvalidArgumentError(f"size of {key!r} must be an int, got {type(size).__name__}")
    if size < 0:
        raise InvalidArgumentError(f"size of {key!r} must not be negative, got {size}")
    return int(size)


class Writer:
    """Writes exactly ``size`` bytes of a new raw object ``key``.

    Owns the reserved entry until ``close`` seals it or ``abort`` drops it.
    Not thread-safe.
    """

    _idx = -1
    closed = True

    def __init__(self, kernel: Kernel, key: str, size: int) -> None:
        kb = encode_key(key)
        self.key, self.size = key, _check_size(key, size)
        kernel._check()
        self._kernel = kernel
        self._idx, off, _, _, self._stripe = kernel.reserve(key, kb, L.KIND_RAW, self.size, self.size)
        try:
            kernel.node.ensure_populated(off, self.size, key)
        except BaseException:
            kernel.abort(self._idx)
            raise
        self._dst = kernel.writable(off, self.size)
        self._pos = 0
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(f"writer of {self.key!r} is closed")

    def write(self, data: Any) -> int:
        """Append ``data`` (bytes-like); returns its length.

        Raises:
            InvalidArgumentError: it would pass the declared size (nothing written).
        """
        self._check_open()
        src = as_u8(data)
        n = src.nbytes
        if self._pos + n > self.size:
            raise InvalidArgumentError(
                f"write of {format_size(n)} passes the end of {self.key!r}: {format_size(self._pos)} of "
                f"{format_size(self.size)} written (open the writer with a larger size)")
        if n:
            self._dst[self._pos: self._pos + n] = src
            self._pos += n
        return n

    @property
    def buffer(self) -> memoryview:
        """Writable memoryview of the bytes not written yet (fill it, then ``advance``)."""
        self._check_open()
        return memoryview(self._dst[self._pos:])

    def advance(self, n: int) -> None:
        """Count ``n`` bytes filled through :attr:`buffer` as written."""
        self._check_open()
        if n < 0 or self._pos + n > self.size:
            raise InvalidArgumentError(f"cannot advance {self.key!r} by {n}: {self.size - self._pos} B left")
        self._pos += n

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        """Seal the object; idempotent.

        Raises:
            InvalidArgumentError: fewer bytes than declared were written (the object is dropped).
        """
        if self.closed:
            return
        if self._pos != self.size:
            self.abort()
            raise InvalidArgumentError(
                f"writer of {self.key!r} closed after {format_size(self._pos)} of {format_size(self.size)}; "
                f"nothing was stored")
        self._dst = None
        self.closed = True
        self._kernel.seal(self._idx, self._stripe)

    def abort(self) -> None:
        """Drop the unsealed object and give its space back; idempotent."""
        if self.closed:
            return
        self._dst = None
        self.closed = True
        self._kernel.abort(self._idx)

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        try:
            self.abort()
        except Exception:
            pass


class Reader:
    """Streams the stored bytes of ``key`` (pinned while open).

    ``read``, ``readinto``, ``seek``, ``tell`` behave like a binary file.
    Not thread-safe.
    """

    closed = True
    _data: np.ndarray | None = None

    def __init__(self, kernel: Kernel, key: str) -> None:
        kb = encode_key(key)
        kernel._check()
        idx, e, _ = kernel.lookup(key, kb, True)
        self.key = key
        self._data = kernel.lease(idx, e[L.E_OFFSET], e[L.E_NBYTES], e[L.E_GEN]).view(np.ndarray)
        self.size = e[L.E_NBYTES]
        self._pos = 0
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(f"reader of {self.key!r} is closed")

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all that is left if ``n`` < 0); ``b""`` at the end."""
        self._check_open()
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        out = self._data[self._pos: end].tobytes()
        self._pos = max(self._pos, end)
        return out

    def readinto(self, buf: Any) -> int:
        """Fill ``buf`` from the current position; returns the bytes read."""
        self._check_open()
        dst = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
        n = max(0, min(dst.nbytes, self.size - self._pos))
        dst[:n] = self._data[self._pos: self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}.get(whence)
        if base is None or base + offset < 0:
            raise InvalidArgumentError(f"bad seek on {self.key!r}: offset {offset}, whence {whence}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        self._check_open()
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        """Unpin the object; idempotent."""
        self.closed = True
        self._data = None

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
