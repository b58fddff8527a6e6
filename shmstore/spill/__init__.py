"""The per-node spill process (``python -m shmstore.spill``): what it moves (policy), how (mover),
the requests clients send it, and its loop (process)."""
from .process import main

__all__ = ["main"]
