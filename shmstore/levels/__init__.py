"""Storage levels: the ordered ``Level`` enum, the values describing objects and capacity, and each level's
own storage (``disk``: the spill directory's files)."""
from .base import Capacity, Level, ObjectInfo, parse_levels

__all__ = ["Level", "ObjectInfo", "Capacity", "parse_levels"]
