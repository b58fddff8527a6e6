"""Storage levels: MEMORY (the shm arena), DISK (the spill directory's files) and GPU (device memory).

``Level``, ``ObjectInfo``, ``Capacity`` and ``parse_levels`` live in :mod:`shmstore.values` (below the
kernel, which uses them) and are re-exported here, where the public API has always named them.
"""
from ..values import Capacity, Level, ObjectInfo, parse_levels

__all__ = ["Level", "ObjectInfo", "Capacity", "parse_levels"]
