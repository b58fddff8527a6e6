"""The immutable values describing storage: the ordered ``Level`` enum, ``ObjectInfo``, ``Capacity``.

At the bottom of the package beside ``errors.py``: the kernel, the levels and everything above them use
these values, and they use nothing but the errors."""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Union

from .errors import InvalidArgumentError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Level", "ObjectInfo", "Capacity", "parse_levels", "Conditions"]

# What ``get(key, conditions=...)`` takes: a numpy index of the stored array (an int, a slice, an index or mask
# array, or a tuple of those, Ellipsis and None included), applied without materialising the rest.
Conditions = Union[int, slice, "np.ndarray[Any, Any]", "tuple[Any, ...]"]


class Level(enum.IntEnum):
    """Where an object lives, ordered fast to slow: ``GPU < MEMORY < DISK``."""

    GPU = 0
    MEMORY = 1
    DISK = 2

    def __str__(self) -> str:
        return self.name.lower()


class ObjectInfo(NamedTuple):
    """What the table says about one sealed object (a snapshot).

    ``size`` is the object's logical size (bytes of a bytes-like value, the
    stored serialized size otherwise); ``stored`` what it occupies on its level.
    ``created`` (seconds since the epoch) is when the object was made on its
    node, read under its key's lock: for an overwrite, when it replaced the
    old object, so the object a key holds is always the one created last
    (what tells a node's objects under one key apart).
    """

    key: str
    size: int
    level: Level
    pinned: bool
    sealed: bool
    nblobs: int
    kind: str
    stored: int
    pins: int
    session: str
    created: float


class Capacity(NamedTuple):
    """Usage of one level (a snapshot). ``free = total - used``."""

    total: int
    used: int
    pinned: int
    free: int
    objects: int
    spillable: int = 0
    spilled: int = 0
    restored: int = 0


def parse_levels(levels: object, default: Sequence[Level]) -> tuple[Level, ...]:
    """Normalise a priority list of levels (``None`` gives ``default``).

    Raises:
        InvalidArgumentError: not a Level, a list of Levels, or empty.
    """
    if levels is None:
        return tuple(default)
    if isinstance(levels, (int, str)):  # a Level is an int
        items = [levels]
    else:
        try:
            items = list(levels)  # type: ignore[call-overload]
        except TypeError:
            raise InvalidArgumentError(f"levels must be a Level or a list of Levels, got {type(levels).__name__}: "
                                       f"{levels!r} (e.g. levels=[Level.MEMORY, Level.DISK])") from None
    out = []
    for item in items:
        try:
            if isinstance(item, bool) or not isinstance(item, (int, str)):
                raise ValueError(item)
            lv = Level[item.upper()] if isinstance(item, str) else Level(item)
        except (KeyError, ValueError):
            raise InvalidArgumentError(f"not a storage level: {item!r} "
                                       f"(use Level.MEMORY, Level.DISK or Level.GPU)") from None
        if lv not in out:
            out.append(lv)
    if not out:
        raise InvalidArgumentError("empty list of levels (give at least one Level)")
    return tuple(out)
