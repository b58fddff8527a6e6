"""Every storage level, registered in one place.

A new level is a module with a class satisfying
:class:`~shmstore.levels.protocol.StorageLevel` plus one line in
:data:`LEVELS`; ``tests/test_levels.py`` runs the conformance suite over
every registered level that is available here.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import Level

if TYPE_CHECKING:
    from .protocol import StorageLevel

__all__ = ["LEVELS", "open_levels"]

LEVELS: dict[Level, str] = {
    Level.GPU: "shmstore.levels.gpu:GpuLevel",
    Level.MEMORY: "shmstore.levels.memory:MemoryLevel",
    Level.DISK: "shmstore.levels.disk:DiskLevel",
}


def open_levels(node: Any) -> dict[Level, "StorageLevel"]:
    """One instance of every registered level for the node store ``node`` (this process's)."""
    out: dict[Level, StorageLevel] = {}
    for level, where in LEVELS.items():
        module, cls = where.split(":")
        out[level] = getattr(importlib.import_module(module), cls)(node)
    return out
