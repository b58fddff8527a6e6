"""Loading the optional C fast path (``_fast.c``) of the kernel.

Set ``SHMSTORE_PURE_PYTHON=1`` to run the pure-Python kernel even where the
extension was built (the test suite runs both).
"""
from __future__ import annotations

import os
from types import ModuleType

from . import layout as L

__all__ = ["load"]


def load() -> ModuleType | None:
    """The configured ``_fast`` module, or None (not built, or disabled)."""
    if os.environ.get("SHMSTORE_PURE_PYTHON", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    try:
        from . import _fast
    except ImportError:
        return None
    _fast.configure(*L.fast_path_layout())
    return _fast
