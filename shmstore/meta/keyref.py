"""Named values a put carries down: the key's reference, what an entry will hold, a reservation.

They replace the loose ``key, kb, h, b, stripe, kind, stored, nbytes,
nblobs, meta`` arguments the put side passed by hand. Each is made once
(a :class:`KeyRef` by ``Kernel.begin``, a :class:`Reservation` by
``Puts.reserve`` or a level's shortcut) and read by name after.
"""
from __future__ import annotations

import zlib
from typing import Any, NamedTuple

from ..errors import ObjectExistsError, ObjectLockedError
from .layout import STRIPE_SHIFT as _SHIFT

__all__ = ["KeyRef", "key_ref", "Contents", "Reservation", "exists_error", "being_written_error"]

_crc32 = zlib.crc32
# a NamedTuple without its Python __new__: key_ref is on every verb's path
_new = tuple.__new__


class KeyRef(NamedTuple):
    """A checked key and where it lives in one session's table; immutable.

    ``h`` is the CRC-32 of ``kb`` seeded with the session id, ``bucket`` its
    hash chain and ``stripe`` the lock that guards the chain.
    """

    key: str
    kb: bytes
    h: int
    bucket: int
    stripe: int


def key_ref(key: str, kb: bytes, sid: int, bmask: int, smask: int) -> KeyRef:
    """The :class:`KeyRef` of ``key`` (its UTF-8 bytes ``kb``) in session ``sid`` of a table with
    ``bmask + 1`` buckets and ``smask + 1`` stripes: the one place that hashes a key."""
    h = _crc32(kb, sid)
    b = h & bmask
    ref: KeyRef = _new(KeyRef, (key, kb, h, b, (b >> _SHIFT) & smask))
    return ref


class Contents(NamedTuple):
    """What an entry will hold (the fields of a :class:`~shmstore.node.serialize.Encoded` the
    entry records): its kind, the bytes it occupies (``size``), the size ``ObjectInfo`` reports
    (``nbytes``), blob count, ENTRY_ARRAY bytes of an array, and optionally the stored bytes
    themselves (``src``, a fetched copy: a level's shortcut may copy them and seal at once)."""

    kind: int
    size: int
    nbytes: int
    nblobs: int = 0
    meta: bytes | None = None
    src: Any = None
    device: bool = False  # src is a device array


class Reservation(NamedTuple):
    """An entry reserved for a put (state ``writing``, or already sealed by a shortcut): its index and
    generation, where its bytes go on its level, the bytes taken, its creation time
    (``ObjectInfo.created``) and its stripe."""

    idx: int
    gen: int
    offset: int
    stored: int
    ctime: float
    stripe: int


def exists_error(key: str) -> ObjectExistsError:
    return ObjectExistsError(f"{key!r} already exists (delete it first, pass overwrite=True, or use another key)", key)


def being_written_error(key: str) -> ObjectLockedError:
    return ObjectLockedError(f"{key!r} is being written by another writer", key)
