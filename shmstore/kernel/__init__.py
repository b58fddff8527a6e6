"""Moved: what was here lives on the floors it held (README "Layout"): ``shmstore.primitives`` (OS primitives),
``shmstore.meta`` (the shared records, table, allocator, locks, C table operations), ``shmstore.node`` (one
node store: its clients' supplies, repair, checks, the level protocols, values to bytes), ``shmstore.client``
(one process's verbs). These names stay importable from here."""
from ..client.kernel import Kernel
from ..meta.keys import encode_key
from ..node.nodestore import NodeStore

__all__ = ["Kernel", "NodeStore", "encode_key"]
