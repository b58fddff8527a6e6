"""Object references: ``store.share(obj)`` and ``cluster.share(obj)`` return a :class:`Ref`, like ``ray.put``.

A ``Ref`` is a small picklable handle: the store's name, session and node,
the generated key the object was put under, and whether a ``Cluster``
shared it. Pickling sends only that (``__reduce__``), so handing one large
value to many tasks through any executor that pickles its arguments
(``concurrent.futures``, ``multiprocessing``, joblib, Dask, mpi4py's
``MPIPoolExecutor``) costs one put, and the tasks read it zero-copy.

Resolution is explicit: ``ref.get()`` (or ``ref.value``) returns what
``store.get(key)`` returns, found in this order:

1. the store that shared it, where that is this process and it is open;
2. for a cluster's ref, a ``Cluster`` this process has open over the same
   store and session (``shmstore.mpi`` registers how to find one, see
   :func:`register_cluster_finder`): ``cluster.get(key)``, a local hit or
   one deduplicated transfer into this node, which every other rank of the
   node then finds locally;
3. this node's store, where the ref was shared on this node or a copy was
   fetched here: ``connect(name, node=..., session=..., create=False)``,
   opened once per process and kept until it exits.

A cluster's ref shared on another node, in a process that has no Cluster
open, raises ``TransferError`` saying so; so does a store's ref (node-local:
``store.share``) asked for on another node. ``ref.delete()`` ends the object (every copy
for a cluster ref) and ``with store.share(x) as ref:`` deletes it at exit;
a ref whose object is gone raises ``ObjectNotFoundError`` naming the key and
saying that the reference was deleted.

Keys live under :data:`PREFIX` (``"@ref/"`` and a uuid4): ``keys()`` and
``shmstore ls`` show them, and no key a user picks by hand collides with one.
"""
from __future__ import annotations

import os
import threading
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Callable

from .config import default_node, node_label
from .errors import InvalidArgumentError, ObjectNotFoundError, StoreNotFoundError, TransferError

if TYPE_CHECKING:
    from .store import Store

__all__ = ["Ref", "PREFIX", "new_key", "register_cluster_finder", "release", "values_of"]

PREFIX = "@ref/"

ClusterFinder = Callable[[str, str], Any]  # (store name, session) -> an open Cluster of this process, or None

_finders: list[ClusterFinder] = []
_sharers: weakref.WeakValueDictionary[tuple[str, str, str], Store] = weakref.WeakValueDictionary()
_opened: dict[tuple[str, str, str], Store] = {}  # connections this process opened to resolve refs
_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child cannot use its parent's connections (they raise StoreClosedError): forget them."""
    global _lock
    _sharers.clear()
    _opened.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def new_key() -> str:
    """A fresh key in the reserved namespace: ``@ref/`` and 32 hex digits of a uuid4."""
    return PREFIX + uuid.uuid4().hex


def register_cluster_finder(finder: ClusterFinder) -> None:
    """Tell refs how to find an open Cluster of this process (``shmstore.mpi`` does, when imported)."""
    if finder not in _finders:
        _finders.append(finder)


def release() -> int:
    """Close the connections this process opened to resolve refs (views still alive keep their mapping);
    returns how many. Processes need not call it: those connections close at exit."""
    with _lock:
        stores = list(_opened.values())
        _opened.clear()
    for s in stores:
        s.close()
    return len(stores)


def here() -> str:
    """This process's node, as a plain ``connect()`` names it (``SHMSTORE_NODE``, else the launcher's)."""
    return node_label() or default_node()


class Ref:
    """A handle on one shared object; picklable, immutable, cheap to send anywhere in the job.

    Attributes:
        name, session: the store and session the object lives in.
        node: the node it was shared on.
        key: its key (under :data:`PREFIX`).
        cluster: True when a ``Cluster`` shared it (resolved on any node of the job, deleted everywhere).
    """

    __slots__ = ("name", "session", "node", "key", "cluster", "_owner", "_pid", "__weakref__")

    def __init__(self, name: str, session: str, node: str, key: str, cluster: bool = False,
                 owner: Any = None) -> None:
        self.name, self.session, self.node, self.key, self.cluster = name, session, node, key, cluster
        # the Store or Cluster that shared it (this process only; never pickled)
        self._owner = owner
        self._pid = os.getpid()  # a forked child inherits the ref but cannot use the owner

    @classmethod
    def shared(cls, store: Store, key: str, owner: Any = None) -> Ref:
        """The ref of ``key`` just put in ``store`` (by ``owner``: a Cluster, or the store itself)."""
        _sharers[(store.name, store.node, store.session)] = store
        return cls(store.name, store.session, store.node, key, owner is not None and owner is not store,
                   owner if owner is not None else store)

    def __reduce__(self) -> tuple[Any, tuple[str, str, str, str, bool]]:
        return (Ref, (self.name, self.session, self.node, self.key, self.cluster))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and self._id() == other._id()

    def __hash__(self) -> int:
        return hash(self._id())

    def _id(self) -> tuple[str, str, str, str]:
        return (self.name, self.session, self.node, self.key)

    def __repr__(self) -> str:
        kind = "cluster " if self.cluster else ""
        return f"<shmstore.Ref {kind}{self.key!r} store={self.name!r} node={self.node!r} session={self.session!r}>"

    # ---- resolution --------------------------------------------------------------
    def get(self, timeout: float | None = None) -> Any:
        """The shared value, as ``store.get`` returns it (zero-copy views for arrays and bytes).

        ``timeout``: seconds to wait at most for the object to come from another node (as Ray's
        ``ray.get(ref, timeout=)``; a ref is made after its object exists, so only that transfer can wait).
        None: each wait up to the cluster's ``peer_timeout``. An object on this node comes at once.

        Raises:
            ObjectNotFoundError: the object is gone (``delete()``, its store's ``clear()``, or the store removed
                with its last client); the message names the key and says so.
            GetTimeoutError: it did not come within ``timeout`` (the transfer is given up; ask again).
            TransferError: the ref was shared on another node and this process has no Cluster open over the
                store (or a transfer into this node failed).
        """
        try:
            return self._resolve(timeout)
        except ObjectNotFoundError as exc:
            raise self._gone() from exc

    @property
    def value(self) -> Any:
        """``get()``."""
        return self.get()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        """``np.asarray(ref)``: the shared value as an array (an array value as ``get()`` gives it: a read-only
        view, no copy), not a 0-d array of objects holding the ref."""
        import numpy as np
        value = self.get()
        return np.array(value, dtype, copy=True) if copy else np.asarray(value, dtype)

    def _resolve(self, timeout: float | None = None) -> Any:
        if timeout is not None and not timeout >= 0:
            raise InvalidArgumentError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        owner = self._live_owner()
        if owner is not None and not self.cluster and not owner.closed:
            return owner.get(self.key)
        cluster = self._cluster() if self.cluster else None
        if cluster is not None:
            return cluster.get(self.key, timeout=timeout)
        node = here()
        store = self._local(node)
        if store is not None and (node == self.node or self.key in store):
            return store.get(self.key)
        if node == self.node:
            raise self._gone()
        if not self.cluster:
            raise TransferError(f"reference {self.key!r} was made by store.share on node {self.node!r} and resolves "
                                f"on that node only, not on {node!r} (make it with cluster.share to reach every "
                                f"node)", self.key)
        raise TransferError(f"reference {self.key!r} was shared on node {self.node!r} and this process runs on "
                            f"node {node!r} with no shmstore.mpi.Cluster open over store {self.name!r} (session "
                            f"{self.session!r}): open one in every rank (see mpi/README.md, References)", self.key)

    def _live_owner(self) -> Any:
        return self._owner if self._pid == os.getpid() else None

    def _cluster(self) -> Any:
        owner = self._live_owner()
        if self.cluster and owner is not None and not getattr(owner, "_closed", True):
            return owner
        for find in _finders:
            found = find(self.name, self.session)
            if found is not None:
                return found
        return None

    def _local(self, node: str) -> Store | None:
        """This process's open connection to the store on ``node`` (opened now, once, if it exists)."""
        ident = (self.name, node, self.session)
        known = _sharers.get(ident)
        if known is not None and not known.closed:
            return known
        with _lock:
            store = _opened.get(ident)
            if store is None or store.closed:
                from .store import connect  # same floor; store.py imports this module
                try:
                    store = connect(self.name, node=node, session=self.session, create=False)
                except StoreNotFoundError:
                    return None
                _opened[ident] = store
            return store

    def _gone(self) -> ObjectNotFoundError:
        return ObjectNotFoundError(f"reference {self.key!r} (store {self.name!r}, session {self.session!r}, shared "
                                   f"on node {self.node!r}) was deleted: its object is gone (ref.delete(), the end "
                                   f"of its with-block, a delete or clear of its store, or the store removed with "
                                   f"its last client)", self.key)

    # ---- lifetime ----------------------------------------------------------------
    def delete(self) -> bool:
        """End the object: this node's copy, and for a cluster ref every node's copy (needs the Cluster open in
        this process). Idempotent; True if this call removed a copy.

        Raises:
            TransferError: a cluster ref, and this process has no Cluster open over its store (or a node did not
                answer within ``peer_timeout``).
        """
        if self.cluster:
            cluster = self._cluster()
            if cluster is None:
                raise TransferError(f"cannot delete cluster reference {self.key!r} everywhere: this process has no "
                                    f"shmstore.mpi.Cluster open over store {self.name!r} (delete it where one is)",
                                    self.key)
            return bool(cluster.delete(self.key))
        owner = self._live_owner()
        store = owner if owner is not None and not owner.closed else self._local(self.node)
        if store is None:
            return False
        try:
            store.delete(self.key)
        except ObjectNotFoundError:
            return False
        return True

    def __enter__(self) -> Ref:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()


def values_of(keys: list[Any], get_many: Callable[[list[str]], list[Any]]) -> list[Any]:
    """The values of ``keys``, a mix of keys and :class:`Ref` objects, in their order: the keys' through
    ``get_many`` (a store's or a cluster's: batched), each ref's as ``ref.get()`` resolves it."""
    plain = [k for k in keys if type(k) is not Ref]
    values = iter(get_many(plain)) if plain else iter(())
    return [k.get() if type(k) is Ref else next(values) for k in keys]
