"""One process's client state on a node store, in one session: what a kernel's parts share."""
from __future__ import annotations

from typing import Any

from ..meta.fastpath import ClientOps
from ..node.nodestore import NodeStore
from ..node.protocols import PutContext
from ..node.supplies import ClientSupply

__all__ = ["ClientState"]


class ClientState:
    """A client slot of a node store and a session, with the addresses and objects its verbs use.

    Made and owned by a :class:`~shmstore.client.kernel.Kernel`, which shares it with the parts it owns
    (puts, pins, batches). A level never gets it: what a put hands a level is :attr:`put_context`.
    Never changes once the kernel is built (the C table operations' ``ctx``, the put context capsule, is
    set once by :class:`~shmstore.client.pins.Pins`, which makes it), so it is process-safe and
    thread-safe; it owns nothing it could unlink.
    """

    __slots__ = ("node", "slot", "sid", "session", "supply", "fast", "ops", "buf", "lay", "table", "stripes", "bmask",
                 "smask", "meta_addr", "stripe_addrs", "arena", "arena_addr", "ro", "prefault", "put_context")

    def __init__(self, node: NodeStore, slot: int, sid: int, session: str, supply: ClientSupply,
                 fast: Any) -> None:
        self.node, self.slot, self.sid, self.session, self.supply, self.fast = node, slot, sid, session, supply, fast
        lay = node.layout
        self.buf, self.lay, self.table, self.stripes = node.buf, lay, node.table, node.stripes
        self.bmask, self.smask = lay.nbuckets - 1, lay.nstripes - 1
        self.meta_addr = node.meta.address
        self.stripe_addrs = [lock.address for lock in node.stripes]
        self.arena, self.arena_addr, self.ro = node.arena_mm, node.arena.address, node.arena_ro
        self.prefault = node.prefault
        # the C table operations bound to this client (None: not built, or disabled)
        self.ops = None if fast is None else ClientOps(fast, self.meta_addr, lay, sid, slot, self.stripe_addrs,
                                                       self.arena_addr)
        self.put_context = PutContext(slot, supply, self.ops, node.prefault, node.stripes)
