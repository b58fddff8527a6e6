"""Loading the optional C fast path (``_fast.c``) of the kernel.

Set ``SHMSTORE_PURE_PYTHON=1`` to run the pure-Python kernel even where the
extension was built (the test suite runs both).
"""
from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

from ..config import pure_python
from . import layout as L

__all__ = ["load", "codes", "Found", "Small"]


class codes:
    """Return codes of the C calls, shared with ``_fast.c`` (its ``RC_*`` constants)."""

    MISSING = -1        # get_entry: no sealed entry has the key
    BUSY = -2           # the stripe lock is taken: go the Python way, which waits
    OWNER_DEAD = -3     # the lock's holder died: the caller holds it now, repairs and releases it
    BEING_WRITTEN = -4  # insert: the key is being written
    EXISTS = -5         # insert: the key exists
    STOLEN = -6         # insert: the entry is not reserved for this client any more
    NO_ENTRY = -7       # put_small: the client's reserved entries ran out
    NO_CUT = -8         # put_small: the client's chunk lacks room (or it has none)


class Found(NamedTuple):
    """The order of the tuple ``get_entry`` returns for a sealed entry (pinned and touched).

    The hot path unpacks it positionally, in this order; others may ``Found._make`` it.
    """

    idx: int     # entry index
    gen: int     # its generation
    offset: int  # of the object in its level
    level: int
    nbytes: int  # logical size
    kind: int
    eoff: int    # offset of the entry in the metadata segment


class Small(NamedTuple):
    """The order of the tuple ``read_small`` returns for a small object in memory (copied, not pinned)."""

    kind: int
    nbytes: int
    nblobs: int
    array: bytes | None  # the ENTRY_ARRAY bytes of an array, else None
    data: bytes          # the stored bytes


def load() -> ModuleType | None:
    """The configured ``_fast`` module, or None (not built, or disabled)."""
    if pure_python():
        return None
    try:
        from . import _fast  # type: ignore[attr-defined]  # built by setup.py where a compiler is
    except ImportError:
        return None
    _fast.configure(L.fast_path_layout())
    module: ModuleType = _fast
    return module
