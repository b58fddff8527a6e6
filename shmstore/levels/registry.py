"""Every storage level, registered in one place, and the one function that opens them on a store.

A new level is a module with a class satisfying the protocols of
:mod:`shmstore.node.protocols` (built from a ``LevelHost``), plus one line
in :data:`LEVELS` (in :data:`DEVICE_LEVELS` for a level whose values are device
arrays, built with a way to ask for its arenas: a ``DeviceLevel``);
``tests/levels/test_conformance.py`` runs the conformance suite over
every registered level that is available here. The built-in levels are
plain imports, so that readers and tools see the dependency.
"""
from __future__ import annotations

from typing import Callable

from ..node.protocols import DeviceLevel, LevelHost, Levels, MovableLevel, RequestArena
from ..values import Level
from .disk import DiskLevel
from .gpu import GpuLevel
from .memory import MemoryLevel

__all__ = ["LEVELS", "DEVICE_LEVELS", "open_levels"]

LEVELS: dict[Level, Callable[[LevelHost], MovableLevel]] = {  # built from the store alone
    Level.MEMORY: MemoryLevel,
    Level.DISK: DiskLevel,
}
DEVICE_LEVELS: dict[Level, Callable[[LevelHost, RequestArena | None], DeviceLevel]] = {  # and a way to get arenas
    Level.GPU: GpuLevel,
}


def open_levels(host: LevelHost, request: Callable[[Level, int], str | None] | None = None) -> Levels:
    """One instance of every registered level on the node store ``host``, as this process reaches it.

    Args:
        host: the store's metadata (a :class:`~shmstore.node.nodestore.NodeStore`).
        request: how a client asks the spill process to make a device level's arena on device ``d``
            (``request(level, d)``: None once made, else why not); None in the process that makes and
            owns the arenas itself (the spill process, a test on a bare store).

    Returns:
        The levels (fast to slow), and which of them are device levels; hand them to
        ``NodeStore.use_levels``.
    """
    devices = {level: make(host, None if request is None else _for_level(request, level))
               for level, make in DEVICE_LEVELS.items()}
    levels: dict[Level, MovableLevel] = {level: make(host) for level, make in LEVELS.items()}
    levels.update(devices)
    return Levels(dict(sorted(levels.items())), devices)


def _for_level(request: Callable[[Level, int], str | None], level: Level) -> RequestArena:
    def request_arena(d: int) -> str | None:
        return request(level, d)
    return request_arena
