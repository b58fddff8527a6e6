"""Views into the store handed to users, and what keeps the stored object pinned.

Whatever ``get`` returns that points into shared memory (or into a spill
file) hangs off one object whose finalizer unpins the stored object, so the
object cannot be deleted for good, spilled or reused while any view of it
lives. numpy keeps that object alive as the ``base`` of every view derived
from it (a derived view never skips over an ndarray subclass).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np

from ..primitives.interrupts import finalizer

__all__ = ["SharedArray", "Lease", "ARRAY_TYPES", "PinToken", "pin_token"]


# run by the garbage collector anywhere: a Ctrl-C deferred inside it waits for the code it interrupted
@finalizer
def _release(self: np.ndarray) -> None:
    release = getattr(self, "_release", None)
    if release is not None:
        try:
            release[0](release[1], release[2])
        except Exception:  # finalizers must not raise; at worst the janitor unpins
            pass


class Lease(np.ndarray):
    """Read-only bytes of one stored object (raw bytes and pickled values hang off it), over a read-only mapping
    as a :class:`SharedArray` is (or over an immutable ``bytes`` copy of a device object, for its reader):
    nothing built on it can be made writable."""

    _release: tuple[Any, ...] | None  # (function, index, generation): what unpins it, set by the kernel

    __del__ = _release


class SharedArray(np.ndarray):
    """A read-only array stored in shmstore: an ndarray subclass, like ``np.memmap``.

    ``get`` returns it for stored numpy arrays: a zero-copy view whose
    lifetime (with that of any view taken from it) pins the stored object.
    Its memory is a read-only mapping (the arena's ``PROT_READ`` one, or a
    spill file's), so numpy refuses ``setflags(write=True)`` on it and on
    every view derived from it; a write that ignores the flag faults.
    Results of arithmetic on it are plain ndarrays; pickling it pickles a
    plain array.
    """

    _release: tuple[Any, ...] | None  # as Lease._release

    __del__ = _release

    def __array_wrap__(self, arr: Any, context: Any = None, return_scalar: bool = False) -> Any:
        if isinstance(arr, SharedArray) and arr is not self:
            arr = arr.view(np.ndarray)
        if return_scalar and isinstance(arr, np.ndarray) and arr.ndim == 0:
            return arr[()]
        return arr

    def __reduce__(self) -> Any:
        return self.view(np.ndarray).__reduce__()


ARRAY_TYPES = (np.ndarray, SharedArray)  # stored as arrays (plain ndarray subclasses are not)


class PinToken:
    """Holds one pin of an object while a device array over it lives (the array's memory owner): the
    device levels' counterpart of :class:`Lease`."""

    __slots__ = ("__weakref__",)


def pin_token(release: Callable[[int, int], None], idx: int, gen: int) -> PinToken:
    """A token whose collection releases the pin ``(idx, gen)``."""
    token = PinToken()
    weakref.finalize(token, _release_pin, release, idx, gen)
    return token


# run by the garbage collector anywhere: a Ctrl-C deferred inside it waits for the code it interrupted
@finalizer
def _release_pin(release: Callable[[int, int], None], idx: int, gen: int) -> None:
    release(idx, gen)
