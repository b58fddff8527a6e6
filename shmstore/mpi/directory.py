"""The location directory: which nodes hold a complete copy of a key, partitioned across nodes.

Every key has a home node, ``crc32(key) % nodes``, whose leader keeps that
key's entry in memory (a :class:`Directory`, served by the node's service).
A get miss asks the home once (``DIR_GET``) and then one holder
(``LOOKUP``): two round trips before bytes move, whatever the number of
nodes; ``locate`` is one round trip, ``delete`` one to the home plus one
per holder. Paths that make a copy register it (``Cluster.put``, a fetch
or pull, a migration, a remote writer: ``DIR_ADD``, answered, so a key is
locatable when ``put`` returns); paths that remove one unregister it
(``Cluster.delete`` takes the whole entry, a migration drops its source).

Ordering, so that concurrent operations never leave a copy the directory
misses (which ``delete`` would then miss too): a copy is registered after
it exists, and unregistered before it is deleted. A race can then only
leave an entry naming a node whose copy is gone, which heals as below.

What the directory cannot see: objects put or deleted through a plain
node-local ``shmstore.connect()`` (they are found on their own node only;
``Cluster.publish(keys)`` registers them), and copies removed behind its
back. Such an entry is stale, never harmful: a fetcher that finds a holder
without the object tells the home to drop it (``DIR_DROP``) and tries the
next holder. Entries live as long as the job: the directory is in the
leaders' memory, not in the stores (a job that dies takes it along).
"""
from __future__ import annotations

import threading
import zlib

__all__ = ["Directory", "home_of"]


def home_of(key: str, nnodes: int) -> int:
    """The index of ``key``'s home node (stable across ranks and runs)."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % nnodes


class Directory:
    """One node's share of the directory: key -> node indices holding a copy. Thread-safe."""

    def __init__(self) -> None:
        self._holders: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def add(self, key: str, node: int) -> None:
        with self._lock:
            holders = self._holders.setdefault(key, [])
            if node not in holders:
                holders.append(node)

    def drop(self, key: str, node: int) -> None:
        with self._lock:
            holders = self._holders.get(key)
            if holders is not None and node in holders:
                holders.remove(node)
                if not holders:
                    del self._holders[key]

    def get(self, key: str) -> list[int]:
        with self._lock:
            return list(self._holders.get(key, ()))

    def take(self, key: str) -> list[int]:
        """The holders of ``key``, forgetting the key (a delete of every copy)."""
        with self._lock:
            return self._holders.pop(key, [])

    def __len__(self) -> int:
        return len(self._holders)
