"""The level protocols, where a level's author looks for them; defined in :mod:`shmstore.node.protocols`
(below the levels, so that the kernel types its seams without importing any level)."""
from ..node.protocols import DeviceLevel, LevelHost, Levels, MovableLevel, RequestArena, Sink, StorageLevel

__all__ = ["LevelHost", "StorageLevel", "MovableLevel", "DeviceLevel", "Levels", "Sink", "RequestArena"]
