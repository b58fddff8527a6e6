"""Loading the optional C fast path (``_fast.c``): the table operations in C, and one client's binding of them.

Set ``SHMSTORE_PURE_PYTHON=1`` to run the pure-Python paths even where the
extension was built (the test suite runs both).
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

from ..config import pure_python
from . import layout as L
from .keyref import KeyRef

__all__ = ["load", "codes", "Found", "Small", "ClientOps", "ABI"]

ABI = 3  # the _fast.c this code calls (its module constant ABI)


class codes:
    """Return codes of the C calls, shared with ``_fast.c`` (its ``RC_*`` constants)."""

    MISSING = -1        # get_entry: no sealed entry has the key
    BUSY = -2           # the stripe lock is taken: go the Python way, which waits
    OWNER_DEAD = -3     # the lock's holder died: repaired and released in the call (nothing done): the Python way
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


class ClientOps:
    """The C table operations as one client calls them: bound to its slot and session and to the addresses
    they need, with named arguments (the C calls take them by position). Made by the client
    (``client/state.py``) where the extension is loaded; immutable but for :attr:`ctx`, set once by the
    client's pins where the build has ``put_small``. Thread-safe (the C calls lock what they touch)."""

    __slots__ = ("fast", "meta_addr", "lay", "sid", "slot", "stripe_addrs", "arena_addr", "ctx")

    def __init__(self, fast: Any, meta_addr: int, lay: L.Layout, sid: int, slot: int, stripe_addrs: Sequence[int],
                 arena_addr: int) -> None:
        self.fast, self.meta_addr, self.lay, self.sid, self.slot = fast, meta_addr, lay, sid, slot
        self.stripe_addrs, self.arena_addr = list(stripe_addrs), arena_addr
        # the put_small context (see client/pins.py), None where the build has none
        self.ctx: Any = None

    def insert(self, ref: KeyRef, held: tuple[int, int], space: tuple[int, int, int, int], what: Any,
               state: int, locked: bool) -> tuple[int, float]:
        """Write entry ``held`` = (index, generation) for ``what`` (a ``Contents`` or ``Encoded``) in ``space`` =
        (offset, extent, flags, bytes taken) of the arena, copy ``what.src`` there if it has one, and link it
        in the key's chain in ``state`` (writing or sealed), under the key's stripe lock (``locked``: the
        caller holds it). Returns the C call's code (0: done) and the creation time it wrote."""
        (idx, gen), (off, rec, flags, stored), lay, ctime = held, space, self.lay, time.time()
        rc, ctime = self.fast.insert(self.meta_addr, lay.buckets, lay.entries, ref.bucket, ref.h, self.sid, ref.kb,
                                     self.stripe_addrs[ref.stripe], idx, gen, self.slot, off, stored, what.nbytes,
                                     ctime, rec, what.nblobs, what.kind, flags, state, what.meta,
                                     self.meta_addr + lay.stripe_stats(ref.stripe), L.LEVEL_MEMORY, what.src,
                                     self.arena_addr + off, locked)
        return int(rc), ctime

    def put_small(self, ref: KeyRef, what: Any, entries: list[tuple[int, int]], cut: Any) -> Any:
        """A whole small put in one C call (see ``_fast.c``): the tuple of a Reservation, or a code."""
        return self.fast.put_small(self.ctx, ref.kb, ref.h, what.src, what.meta, what.kind, what.nbytes,
                                   what.nblobs, entries, cut)


def load() -> ModuleType | None:
    """The configured ``_fast`` module, or None (not built, or disabled)."""
    if pure_python():
        return None
    try:
        from . import _fast  # type: ignore[attr-defined]  # built by setup.py where a compiler is
    except ImportError:
        return None
    if getattr(_fast, "ABI", None) != ABI:  # built from an older _fast.c: its calls answer otherwise
        warnings.warn(f"shmstore: the C fast path ({_fast.__file__}) was built from an older source and is not "
                      f"used (rebuild it: pip install -e . or python setup.py build_ext --inplace)", stacklevel=2)
        return None
    _fast.configure(L.fast_path_layout())
    module: ModuleType = _fast
    return module
