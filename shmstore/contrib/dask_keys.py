"""Store keys of :mod:`shmstore.contrib.dask`: Dask keys encoded, and the prefix that names each worker.

A Dask key is a ``str``, an ``int``, a ``float`` or a tuple of keys
(``("sum-aggregate-3f2a", 0, 1)``). :func:`encode_key` writes one as its
``repr``, which :func:`decode_key` reads back with ``ast.literal_eval``
(literals only: no code runs). Each :class:`~shmstore.contrib.dask.ShmStoreData`
prefixes its keys with ``dask/<pid>.<start time>.<n>/``: the process that
owns them (its start time tells a reused pid apart) and which of its
mappings, so that any process can tell a dead worker's objects
(:func:`owner_alive`).
"""
from __future__ import annotations

import ast
import hashlib
import itertools
import os
from collections.abc import Hashable
from typing import Any

from ..errors import InvalidKeyError
from ..primitives.procs import pid_alive, proc_start_time

__all__ = ["PREFIX", "encode_key", "decode_key", "is_literal", "new_prefix", "store_key", "owner_of",
           "owner_alive", "BOOT_ID"]

PREFIX = "dask/"
MAX_KEY = 255  # bytes of a store key (shmstore.meta.keys)
_LITERALS = (str, bytes, int, float, bool, type(None))
_mappings = itertools.count()  # this process's mappings: one prefix each


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


BOOT_ID = _boot_id()  # tells this host from another behind the same address


def is_literal(key: Any) -> bool:
    """Whether ``key`` is made of ``str``, ``bytes``, ``int``, finite ``float``, ``bool``, ``None`` and tuples."""
    if type(key) is tuple:
        return all(is_literal(k) for k in key)
    if type(key) is float:
        return key == key and key not in (float("inf"), float("-inf"))  # repr 'nan', 'inf' is no literal
    return type(key) in _LITERALS


def encode_key(key: Hashable) -> str:
    """The text of a Dask key: its ``repr``; deterministic, and reversed by :func:`decode_key`.

    Raises:
        InvalidKeyError: ``key`` is not made of ``str``, ``bytes``, ``int``, finite ``float``, ``bool``, ``None``
            and tuples of them.
    """
    if not is_literal(key):
        raise InvalidKeyError(f"dask key {key!r} ({type(key).__name__}) is not a literal of str, bytes, int, "
                              f"float, bool, None and tuples of them")
    return repr(key)


def decode_key(text: str) -> Hashable:
    """The Dask key :func:`encode_key` made ``text`` of.

    Raises:
        InvalidKeyError: ``text`` is not such an encoding (nor is a digest of a long key: the
            :class:`~shmstore.contrib.dask.ShmStoreData` that stored it knows its key).
    """
    try:
        key = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
        raise InvalidKeyError(f"{text[:80]!r} is not an encoded dask key ({exc})") from None
    if not is_literal(key):
        raise InvalidKeyError(f"{text[:80]!r} is not an encoded dask key")
    return key  # type: ignore[no-any-return]


def new_prefix() -> str:
    """A prefix for a new mapping of this process: ``dask/<pid>.<start time>.<n>/``."""
    pid = os.getpid()
    return f"{PREFIX}{pid}.{proc_start_time(pid) or 0}.{next(_mappings)}/"


def store_key(prefix: str, key: Hashable, number: int) -> str:
    """The store key of Dask ``key`` under ``prefix``: its encoding; a digest of it where that would pass the
    store's 255 bytes; ``~number`` for a key that is no literal (its mapping remembers which key it is)."""
    if not is_literal(key):
        return f"{prefix}~{number}"
    text = repr(key)
    if len(prefix.encode()) + len(text.encode()) <= MAX_KEY:
        return prefix + text
    return prefix + "#" + hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


def owner_of(skey: str) -> str | None:
    """The owner (``<pid>.<start>.<n>``) of a store key made under :func:`new_prefix`, else None."""
    if not skey.startswith(PREFIX):
        return None
    owner = skey[len(PREFIX):].split("/", 1)[0]
    parts = owner.split(".")
    return owner if len(parts) == 3 and all(p.isdigit() for p in parts) else None


def owner_alive(owner: str) -> bool:
    """Whether the process of an owner :func:`owner_of` returned still runs (the same process, not a reused pid)."""
    pid, start = owner.split(".")[:2]
    return pid_alive(int(pid), int(start))
