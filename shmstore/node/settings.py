"""The settings a node store was created with, and which of a connection's differ from them.

A store's capacity, object and client limits, spill directory, DISK and GPU
capacities, watermarks and persistence are fixed when it is created (they
are in its metadata); a later ``connect()`` that asks for others gets the
store as it is. :func:`ignored_settings` lists what such a connection asked
for in vain, so the Store can warn (or, with ``strict=True``, refuse).
"""
from __future__ import annotations

import os
from typing import Any, Callable

from ..config import Config
from ..meta import layout as L
from ..units import format_size
from .nodestore import NodeStore

__all__ = ["CREATION_SETTINGS", "created_with", "ignored_settings"]


def _size(value: Any) -> str:
    return format_size(value)


def _auto_size(value: Any) -> str:
    return "auto" if not value else format_size(value)


def _plain(value: Any) -> str:
    return repr(value)


# setting -> how its values are shown; the settings a store keeps from its creation
_SHOWN: dict[str, Callable[[Any], str]] = {
    "capacity": _size, "spill_dir": _plain, "disk_capacity": _size, "gpu_capacity": _auto_size,
    "max_objects": _plain, "max_clients": _plain, "high_watermark": _plain, "low_watermark": _plain,
    "persist": _plain,
}
CREATION_SETTINGS = frozenset(_SHOWN)


def created_with(node: NodeStore) -> dict[str, Any]:
    """The creation-time settings of ``node`` as its metadata records them (sizes in bytes, the spill
    directory absolute, ``gpu_capacity`` 0 where it was left to the device)."""
    h, spill = node.header, L.unpack_spill_state(node.buf)
    return {
        "capacity": h.capacity, "spill_dir": L.spill_dir(node.buf), "disk_capacity": spill.disk_capacity,
        "gpu_capacity": spill.gpu_capacity, "max_objects": node.layout.max_objects,
        "max_clients": node.layout.max_clients, "high_watermark": spill.high, "low_watermark": spill.low,
        "persist": bool(h.flags & L.FLAG_PERSIST),
    }


def _asked(cfg: Config, name: str) -> Any:
    """``cfg``'s value of setting ``name`` as creating a store would record it."""
    if name == "capacity":
        return L.page_align(cfg.capacity)
    if name == "spill_dir":
        return os.path.abspath(cfg.spill_dir)
    if name == "gpu_capacity":
        return cfg.gpu_capacity or 0
    return getattr(cfg, name)


def ignored_settings(node: NodeStore, cfg: Config, names: frozenset[str]) -> list[str]:
    """What a connection asked for in vain: for each creation-time setting among ``names`` (those the caller
    passed, as keywords or ``SHMSTORE_*`` variables) whose value differs from the store's, a phrase
    ``capacity=1.0 GiB (the store has 256.0 MiB)``; empty where they all match (or none was passed)."""
    have = created_with(node)
    out = []
    for name in sorted(names & CREATION_SETTINGS):
        asked = _asked(cfg, name)
        if asked != have[name]:
            show = _SHOWN[name]
            out.append(f"{name}={show(asked)} (the store has {show(have[name])})")
    return out
