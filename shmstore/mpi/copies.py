"""Changing the copies of a key across nodes: migrating it, deleting every copy, deleting one node's copy.

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

from typing import Any

from .. import errors
from . import wire as W

__all__ = ["migrate", "delete_all", "delete_on", "delete_here"]


def migrate(c: Any, key: str, dest: int, keep_source: bool) -> None:
    """Move (or with ``keep_source`` copy) ``key`` to node ``dest`` for cluster ``c`` (see
    :meth:`Cluster.migrate`)."""
    copies = c._dir(W.DirCopies(key))
    holders = [n for n, _ in copies]
    if not holders:
        raise errors.ObjectNotFoundError(f"no node has {key!r}", key)
    if dest not in holders:
        src, src_copy = copies[0]
        if dest == c.node_index:
            c._fetcher.fetch_one(key, src, None, c.block_size, source_copy=src_copy)
        else:  # it registers the new copy; its own waits on the source end first, naming the source
            c._msg.call(dest, W.Pull(key, src, c.block_size, src_copy), patience=2.0)
    if not keep_source:  # the copies moved from, each unlisted before it goes (an overwrite since stays;
        for n, copy in copies:  # a copy the directory cannot name stays too: never a later write dropped)
            if n != dest and copy is not None and c._dir(W.DirDrop(key, n, copy, keep=dest)):
                delete_on(c, n, key, copy)


def delete_all(c: Any, key: str) -> int:
    """Delete every copy of ``key`` the directory lists, and this node's copy even where it lists none: how
    many went.

    Raises:
        TransferError: a node did not answer (the first such error, after every other copy went).
    """
    try:
        listed = c._dir(W.DirTake(key))
    except errors.TransferError:
        delete_here(c, key)
        raise
    gone = 0
    failed: errors.TransferError | None = None
    for node, copy in sorted(listed, key=lambda nc: nc[0] != c.node_index):  # this node's copy first
        try:
            gone += delete_on(c, node, key, copy)
        except errors.TransferError as exc:  # a node that died: the others' copies still go
            failed = failed or exc
    gone += delete_here(c, key)
    if failed is not None:
        raise failed
    return gone


def delete_here(c: Any, key: str) -> int:
    """Delete this node's copy of ``key``, whichever object it is: 1 if there was one."""
    try:
        c.store.kernel.delete(key, False)
        return 1
    except errors.ObjectNotFoundError:
        return 0


def delete_on(c: Any, node: int, key: str, copy: float | None = None) -> bool:
    """Delete node ``node``'s copy of ``key`` (only the object ``copy`` where given): True if it went.

    Raises:
        TransferError: ``node`` did not answer within ``peer_timeout``.
    """
    if node == c.node_index:
        try:
            c.store.kernel.delete(key, False, copy)
            return True
        except errors.ObjectNotFoundError:
            return False
    return bool(c._msg.call(node, W.Delete(key, copy)))
