"""One node's metadata in shared memory: segments, locks, table, allocator."""
from .kernel import Kernel, encode_key
from .node import NodeStore

__all__ = ["Kernel", "NodeStore", "encode_key"]
