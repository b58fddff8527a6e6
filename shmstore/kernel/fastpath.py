"""Loading the optional C fast path (``_fast.c``) of the kernel.

Set ``SHMSTORE_PURE_PYTHON=1`` to run the pure-Python kernel even where the
extension was built (the test suite runs both).
"""
from __future__ import annotations

from types import ModuleType

from ..config import pure_python
from . import layout as L

__all__ = ["load", "codes"]


class codes:
    """Return codes of the C calls, shared with ``_fast.c`` (its ``RC_*`` constants)."""

    MISSING = -1        # get_entry: no sealed entry has the key
    BUSY = -2           # the stripe lock is taken: go the Python way, which waits
    OWNER_DEAD = -3     # the lock's holder died: the caller holds it now, repairs and releases it
    BEING_WRITTEN = -4  # insert: the key is being written
    EXISTS = -5         # insert: the key exists
    STOLEN = -6         # insert: the entry is not reserved for this client any more


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
