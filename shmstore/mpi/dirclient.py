"""A rank's way to the location directory: each request to its key's home node, or to this rank's own share.

The directory is partitioned across nodes (``directory.py``): a key's entry
lives with the leader of its home node. :class:`DirectoryClient` sends a
directory request there, and where the home is this rank's own node and this
rank keeps its share (the node's leader), answers it here without a message.
"""
from __future__ import annotations

from typing import Any

from .directory import Directory, home_of
from .links import Links

__all__ = ["DirectoryClient"]


class DirectoryClient:
    """Directory requests of this rank over ``links``; ``local``: this node's share of the directory where this
    rank keeps it (the node's leader, whose service answers the other ranks from it), else None. Thread-safe.
    """

    def __init__(self, links: Links, local: Directory | None) -> None:
        self.links = links
        self.local = local

    def home(self, key: str) -> int:
        """The index of ``key``'s home node."""
        return home_of(key, len(self.links.nodes))

    def ask(self, msg: Any, post: bool = False, any_source: bool = False) -> Any:
        """A request to the home node of ``msg``'s key (or of its first key: all must share the home); see
        :meth:`ask_at`."""
        key = msg.key if hasattr(msg, "key") else msg.keys[0]
        return self.ask_at(self.home(key), msg, post, any_source=any_source)

    def ask_at(self, home: int, msg: Any, post: bool = False, linger: float = 0.0, any_source: bool = False) -> Any:
        """A directory request to node ``home``; answered by this rank's own share where it keeps it (no
        message), else by a call (or with ``post`` a message without a reply: None; ``linger``: see
        :meth:`Messenger.call`; ``any_source``: the answer may come from another node, a forwarded
        ``DirSourceSmall``).

        Raises:
            TransferError: ``home`` did not answer within ``peer_timeout``.
        """
        if home == self.links.node and self.local is not None:
            return self.local.ask(msg)
        if post:
            self.links.messenger.post(home, msg)
            return None
        return self.links.messenger.call(home, msg, linger=linger, any_source=any_source)

    def by_home(self, keys: list[str]) -> dict[int, list[str]]:
        """``keys`` grouped by home node (in order within each)."""
        out: dict[int, list[str]] = {}
        nnodes = len(self.links.nodes)
        for k in keys:
            out.setdefault(home_of(k, nnodes), []).append(k)
        return out
