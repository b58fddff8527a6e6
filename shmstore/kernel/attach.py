"""One process's attachment to a node store, in one session: what a kernel's parts share."""
from __future__ import annotations

from typing import Any

from .cache import ClientCache
from .node import NodeStore

__all__ = ["Attachment"]


class Attachment:
    """A client slot of a node store and a session, with the addresses and objects its verbs use.

    Made and owned by a :class:`~shmstore.kernel.Kernel`, which shares it with
    the parts it owns (puts, pins). Never changes once the kernel is built (``ctx``, the C fast path's
    context capsule, is set once by :class:`~shmstore.kernel.pins.Pins`, which makes it), so it is
    process-safe and thread-safe; it owns nothing it could unlink.
    """

    __slots__ = ("node", "slot", "sid", "session", "cache", "fast", "buf", "lay", "table", "stripes", "bmask",
                 "smask", "meta_addr", "stripe_addrs", "arena", "arena_addr", "ro", "prefault",
                 "ctx")

    def __init__(self, node: NodeStore, slot: int, sid: int, session: str, cache: ClientCache,
                 fast: Any) -> None:
        self.node, self.slot, self.sid, self.session, self.cache, self.fast = node, slot, sid, session, cache, fast
        lay = node.layout
        self.buf, self.lay, self.table, self.stripes = node.buf, lay, node.table, node.stripes
        self.bmask, self.smask = lay.nbuckets - 1, lay.nstripes - 1
        self.meta_addr = node.meta.address
        self.stripe_addrs = [lock.address for lock in node.stripes]
        self.arena, self.arena_addr, self.ro = node.arena_mm, node.arena.address, node.arena_ro
        self.prefault = node.prefault
        self.ctx: Any = None  # set by Pins where the C fast path has put_small (else None)
