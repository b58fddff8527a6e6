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

from .client.kernel import Kernel
from .client.puts import Incoming
from .errors import InvalidArgumentError, ShmStoreError, StoreClosedError
from .levels import Level
from .levels.device import is_device_array, to_host
from .meta import layout as L
from .meta.keyref import Contents
from .node.serialize import as_u8
from .units import format_size

__all__ = ["Writer", "Reader"]


def _check_size(key: str, size: Any) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise InvalidArgumentError(f"size of {key!r} must be an int, got {type(size).__name__}")
    if size < 0:
        raise InvalidArgumentError(f"size of {key!r} must not be negative, got {size}")
    return int(size)


class Writer:
    """Writes exactly ``size`` bytes of a new raw object ``key`` on ``level``.

    Owns the reserved entry until ``close`` seals it or ``abort`` drops it.
    On MEMORY it writes straight into the arena (``buffer`` gives a writable
    view to fill in place); on DISK into the object's spill file. Not
    thread-safe.
    """

    _in: Incoming | None = None
    _dst: np.ndarray | None = None
    closed = True

    def __init__(self, kernel: Kernel, key: str, size: int, level: int = L.LEVEL_MEMORY) -> None:
        self.key, self.size, self.level = key, _check_size(key, size), level
        ref = kernel.begin(key)
        self._kernel = kernel
        self._in = kernel.puts.ingest(ref, Contents(L.KIND_RAW, self.size, self.size), level, kernel.give_up)
        kernel.writers.add(self)
        self._dst = self._in.buffer()
        self._pos = 0
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(f"writer of {self.key!r} is closed (or its store was closed before it was "
                                   f"sealed: nothing was stored)")

    def write(self, data: Any) -> int:
        """Append ``data`` (bytes-like, or a device array: its bytes in memory order); returns its length.

        Raises:
            InvalidArgumentError: it would pass the declared size (nothing written).
            DeviceError: a device array, and no CuPy or device here, or CUDA refused the copy.
        """
        self._check_open()
        device = is_device_array(data)
        if device:
            src = data  # copied by a device level's sink as it is, else to the host first
            n = int(getattr(data, "nbytes", 0))
        else:
            try:
                src = as_u8(data)
            except TypeError:
                raise InvalidArgumentError(f"write to {self.key!r} takes bytes-like data (bytes, bytearray, "
                                           f"memoryview, a numpy array, a device array), got "
                                           f"{type(data).__name__}") from None
            n = src.nbytes
        if self._pos + n > self.size:
            raise InvalidArgumentError(
                f"write of {format_size(n)} passes the end of {self.key!r}: {format_size(self._pos)} of "
                f"{format_size(self.size)} written (open the writer with a larger size)")
        if n and self._dst is not None and device:
            to_host(self._dst[self._pos: self._pos + n], data)
        elif n and self._dst is not None:
            self._dst[self._pos: self._pos + n] = src
        elif n:
            # a host level's sink takes host bytes; a device level's (cuda_buffer) takes the device array
            if device and getattr(self._in.sink, "cuda_buffer", lambda: None)() is None:  # type: ignore[union-attr]
                src = np.empty(n, np.uint8)
                to_host(src, data)
            try:
                self._in.sink.write(src, self._pos)  # type: ignore[union-attr]
            except (OSError, ShmStoreError):  # the level's own error, naming its limit or path
                self.abort()
                raise
        self._pos += n
        return n

    @property
    def buffer(self) -> memoryview:
        """Writable memoryview of the bytes not written yet (MEMORY only; fill it, then ``advance``)."""
        self._check_open()
        if self._dst is None:
            raise InvalidArgumentError(f"{self.key!r} is written to {Level(self.level).name.lower()}: use write(), "
                                       f"not buffer")
        return self._dst[self._pos:].data

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
        try:
            self._in.seal()  # type: ignore[union-attr]
        except (OSError, ShmStoreError):  # the level's own error, naming its limit or path
            self.abort()
            raise
        self._dst = None
        self.closed = True
        self._kernel.writers.discard(self)

    def abort(self) -> None:
        """Drop the unsealed object and give its space back; idempotent."""
        self._drop(blocking=True)

    def _drop(self, blocking: bool) -> None:
        if self.closed:
            return
        self._dst = None
        self.closed = True
        self._kernel.writers.discard(self)
        # a forked child's copy of its parent's writer: the entry and its spill file are the parent's
        if self._in is not None and not self._kernel.forked:
            self._in.drop(blocking)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        """Dropped unsealed: the entry goes back without waiting for a store lock (the garbage collector runs
        this wherever it runs, maybe inside a locked section of this thread); if a lock it needs is
        taken, this process's next verb (or its close) does it."""
        try:
            self._drop(blocking=False)
        except (OSError, ShmStoreError):  # a finalizer never raises; close gives back what it could not
            pass


class Reader:
    """Streams the stored bytes of ``key`` (pinned while open).

    ``read``, ``readinto``, ``seek``, ``tell`` behave like a binary file.
    Not thread-safe.
    """

    closed = True
    _data: np.ndarray | None = None

    def __init__(self, kernel: Kernel, key: str) -> None:
        idx, e, _ = kernel.lookup(kernel.begin(key), True)
        self.key = key
        self._data = kernel.lease(idx, e).view(np.ndarray)
        self.size = e.nbytes
        self._pos = 0
        self.closed = False

    def _check_open(self) -> np.ndarray:
        """The stored bytes, unless the reader is closed."""
        if self.closed or self._data is None:
            raise StoreClosedError(f"reader of {self.key!r} is closed")
        return self._data

    def read(self, n: int | None = -1) -> bytes:
        """Up to ``n`` bytes (all that is left if ``n`` is -1 or None); ``b""`` at the end.

        Raises:
            InvalidArgumentError: ``n`` is not an int, or negative other than -1.
        """
        data = self._check_open()
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < -1):
            raise InvalidArgumentError(f"read of {self.key!r} takes a byte count >= 0, or -1 / None for all "
                                       f"that is left; got {n!r}")
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        out = data[self._pos: end].tobytes()
        self._pos = max(self._pos, end)
        return out

    def readinto(self, buf: Any) -> int:
        """Fill ``buf`` from the current position; returns the bytes read."""
        data = self._check_open()
        dst = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
        n: int = max(0, min(dst.nbytes, self.size - self._pos))
        dst[:n] = data[self._pos: self._pos + n]
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

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
