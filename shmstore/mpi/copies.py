"""Changing the copies of a key across nodes: migrating it, replacing them (an overwrite), deleting every copy,
deleting one node's copy.

Every deletion names the copy it means (the object's creation time on its
node, as the directory lists it), so that a later object put under the key
meanwhile is never dropped (see ``directory.py``), with one exception made
on purpose: :func:`delete_all` also deletes this node's copy where the
directory does not list it (its fetcher died before registering it, or it
was put through a plain ``shmstore.connect()``), so that when a delete
returns, a ``put`` of the key on this node finds no old object.

A node that does not answer within ``peer_timeout`` (it died) does not stop
the others: :func:`delete_all` deletes every copy it can reach, this node's
first, and then raises the first error.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .. import errors
from . import wire as W
from .dirclient import DirectoryClient
from .fetch import Fetcher
from .links import Links

if TYPE_CHECKING:
    from ..client.kernel import Kernel

__all__ = ["Copies"]


class Copies:
    """The copies of keys across nodes, changed from this rank: over ``links``, asking the directory through
    ``dirs``, fetching into this node through ``fetcher``, deleting here through ``kernel``. Thread-safe."""

    def __init__(self, links: Links, dirs: DirectoryClient, fetcher: Fetcher, kernel: Kernel) -> None:
        self.links, self.dirs, self.fetcher, self.kernel = links, dirs, fetcher, kernel

    def migrate(self, key: str, dest: int, keep_source: bool, block: int) -> None:
        """Move (or with ``keep_source`` copy) ``key`` to node ``dest`` (see :meth:`Cluster.migrate`)."""
        copies = self.dirs.ask(W.DirCopies(key)).copies
        if not copies:
            raise errors.ObjectNotFoundError(f"no node has {key!r}", key)
        if dest not in [n for n, _ in copies]:
            src, src_version = copies[0]
            if dest == self.links.node:
                self.fetcher.fetch_one(key, src, None, block, source_version=src_version)
            # it registers the new copy; its own waits on the source end first, naming the source
            else:
                self.links.messenger.call(dest, W.Pull(key, src, block, src_version), patience=2.0)
        # the copies moved from, each unlisted before it goes (an overwrite since stays;
        if not keep_source:
            # a copy the directory cannot name stays too: never a later write dropped)
            for n, version in copies:
                if n != dest and version is not None and self.dirs.ask(W.DirDrop(key, n, version, keep=dest)):
                    self.delete_on(n, key, version)

    def delete_all(self, key: str) -> int:
        """Delete every copy of ``key`` the directory lists, and this node's copy even where it lists none:
        how many went.

        Raises:
            TransferError: a node did not answer (the first such error, after every other copy went).
        """
        token = self.fetcher.token()
        try:
            taken = self.dirs.ask(W.DirTake(key, token))
        except errors.TransferError:
            self.delete_here(key)
            raise
        gone = 0
        failed: errors.TransferError | None = None
        for node, version in sorted(taken.copies, key=lambda nc: nc[0] != self.links.node):  # this node's first
            try:
                gone += self.delete_on(node, key, version)
            except errors.TransferError as exc:  # a node that died: the others' copies still go
                failed = failed or exc
        gone += self.delete_here(key)
        try:
            gone += self.settle(key, token, taken.pending)
        except errors.TransferError as exc:
            failed = failed or exc
        if failed is not None:
            raise failed
        return gone

    def replace(self, key: str, nbytes: int, version: W.Version) -> None:
        """List this node's new object ``version`` (``nbytes``) as the only copy of ``key`` (an overwrite) and
        delete the old copies everywhere, each exactly, those that fetches in flight land too.

        Raises:
            TransferError: the key's home, or a node holding an old copy, did not answer (at the first).
        """
        token = self.fetcher.token()
        old = self.dirs.ask(W.DirReplace(key, self.links.node, nbytes, version, token))
        for node, copy in old.copies:
            self.delete_on(node, key, copy)
        self.settle(key, token, old.pending)

    def settle(self, key: str, token: int, pending: int) -> int:
        """Wait for the ``pending`` fetches of ``key`` in flight when this rank's delete or overwrite (named
        ``token``) took its entry, deleting each copy they landed (see ``wire.DirSettle``): how many went. A
        fetch that does not report within ``peer_timeout`` (its rank died or hangs) is left to its refusal.

        Raises:
            TransferError: the key's home, or a node holding such a copy, did not answer.
        """
        gone, nap = 0, 20e-6
        deadline = time.monotonic() + self.links.messenger.timeout
        while pending and time.monotonic() < deadline:
            time.sleep(nap)
            nap = min(nap * 2, 2e-3)
            landed, pending = self.dirs.ask(W.DirSettle(key, token))
            for node, version in landed:
                gone += self.delete_on(node, key, version)
        return gone

    def delete_here(self, key: str) -> int:
        """Delete this node's copy of ``key``, whichever object it is: 1 if there was one."""
        try:
            self.kernel.delete(key, False)
            return 1
        except errors.ObjectNotFoundError:
            return 0

    def delete_on(self, node: int, key: str, version: W.Version = None) -> bool:
        """Delete node ``node``'s copy of ``key`` (only the object ``version`` where given): True if it went.

        Raises:
            TransferError: ``node`` did not answer within ``peer_timeout``.
        """
        if node == self.links.node:
            try:
                self.kernel.delete(key, False, version)
                return True
            except errors.ObjectNotFoundError:
                return False
        return bool(self.links.messenger.call(node, W.Delete(key, version)))
