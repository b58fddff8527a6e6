"""Dask worker storage over shmstore: ``data=`` of a ``distributed`` worker.

::

    from distributed import LocalCluster
    from shmstore.contrib.dask import ShmStoreData

    cluster = LocalCluster(n_workers=4, processes=True,
                           data=(ShmStoreData, {"name": "run42", "capacity": "16GiB"}))

Pass the class and its arguments (or a ``functools.partial``): each worker
then builds its own :class:`ShmStoreData`, connected to the node's store.
Never a built instance: every worker given it would share it (the old bug
below), so pickling one, as ``processes=True`` would, raises ``TypeError``.

What each worker gets:

- **Its own entries.** Every worker keeps its objects under a prefix of its
  own (``dask/<pid>.<start time>.<n>/``) in one session of the store
  (``"dask"``), so a ``del data[k]`` on one worker never touches the copy of
  ``k`` another worker holds. Dask copies keys between workers and drops
  copies all the time (the active memory manager's ``ReduceReplicas``,
  ``replicate``, work stealing); with one shared namespace (the old README
  hint, ``store.mapping()`` as ``data=``) the first drop deleted every
  worker's copy.
- **Any hashable key.** Dask's keys (``str``, ``int``, ``float`` and tuples
  of them, nested) become store keys deterministically and reversibly
  (:func:`encode_key` / :func:`decode_key`: their ``repr``); a key whose
  encoding would not fit the store's 255 bytes takes a digest instead, and
  a key of another hashable type a number of the mapping's own (the mapping
  remembers which Dask key each store key holds).
- **Zero-copy values.** A numpy array comes back from ``data[k]`` as a
  read-only view of the store's shared memory (a :class:`DaskSharedArray`,
  an ndarray subclass); the store spills cold objects to disk under its own
  ``capacity`` and watermarks. Other values come back as the store's
  ``get`` returns them (unpickled, their arrays shared views). Dask task
  code never writes into its inputs, so read-only inputs serve it
  (``tests/contrib/test_dask.py`` runs sums, reductions along axes and a
  blocked matmul on them).
- **Private values.** What the store cannot hold stays in a private dict of
  the worker, exactly as in a plain worker: values smaller than
  ``min_size`` (scalars, partial sums: a store object would cost more than
  it saves), bytes-like values (the store would return them as a
  ``memoryview``, not their own type), values that cannot be pickled
  (``SerializationError``), and values no level of the store has room for
  (``StorageFullError``, logged once). A value that already is a view of a
  store (a ``SharedArray``: an input passed through, a slice of one, an
  array received from a peer by reference) is kept as it is, zero copy:
  its view pins the object it views, as a plain dict's entry keeps a
  numpy base alive.

Same-node transfers by reference. Dask moves a key between workers by
serializing it on the sender and deserializing it on the receiver. This
module registers a Dask serializer for :class:`DaskSharedArray` (the value
``data[k]`` returns): where the serializer's context says the recipient is
on the sender's host, it sends the store's name, node, session and key
instead of the bytes, and the receiver maps the sender's object (zero copy
where the receiving process has a :class:`ShmStoreData` on that store: the
received array then pins the sender's object; one copy out of shared memory
in any other process of the host, e.g. the client gathering a result,
through a short-lived connection). Elsewhere, and for slices or arrays
received from a peer (which the sender does not own), the bytes go as for
any numpy array. The sender's ``del`` of a key whose array is being sent by
reference waits until the sender's copy of the message is dropped: Dask's
``get_data`` keeps it until the receiver has answered, after
deserializing. A receiver that cannot map the object (another host behind
the same address, the store gone) raises ``ReferenceLostError``, which
distributed takes for a lost peer (see :mod:`shmstore.contrib.dask_transfer`).
Turn it off with ``by_reference=False``.

Lifetimes. ``close()`` deletes the worker's objects (and runs at
interpreter exit: a worker process that ends normally leaves nothing). A
worker killed with SIGKILL leaves its objects: every :class:`ShmStoreData`
deletes those of dead workers of its store when it is made (Dask's nanny
restarts a killed worker, whose new mapping does it), every
``sweep_interval`` seconds while it stores values, and before giving up on
a full store. The store itself goes with its last connected process, as
every store does.

Caveats. Dask's memory manager does not spill this mapping (it has no
``fast``/``evict``): the store's spill process does, by the store's
``capacity``. A worker's RSS counts the pages of shared memory it has
touched, so Dask's ``memory_limit`` (pause at 80%, the nanny's kill at
95%) sees stored objects the worker read: size it with the store in mind.
Composing a ``zict.Buffer(fast={}, slow=ShmStoreData(...), n=...)`` works
(any hashable key), but values in ``fast`` are the worker's private copies.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Hashable, Iterator, MutableMapping
from typing import Any

import numpy as np

from ..errors import SerializationError, StorageFullError, StoreClosedError
from ..node.views import SharedArray
from ..store import Store, connect
from .dask_keys import BOOT_ID, decode_key, encode_key, new_prefix, owner_alive, owner_of, store_key

__all__ = ["ShmStoreData", "DaskSharedArray", "encode_key", "decode_key", "open_mapping", "transfer_stats", "BOOT_ID"]

_MISSING: Any = object()
_log = logging.getLogger("shmstore.contrib.dask")
_open: weakref.WeakValueDictionary[int, ShmStoreData] = weakref.WeakValueDictionary()  # by id: open mappings
#: this process's transfers of stored arrays (dask_transfer): ``sent`` by reference, ``sent_by_value`` (under
#: 1 MiB, or to another host), received by reference as a shared view (``received_shared``) or copied out of the
#: store (``received_copied``, in a process without a mapping on that store)
transfer_stats: collections.Counter[str] = collections.Counter()


class DaskSharedArray(SharedArray):
    """A stored array as :meth:`ShmStoreData.__getitem__` returns it: a read-only zero-copy view whose life pins
    the object. ``store_ref`` (set on that view only, never on views taken from it) names the mapping and store key it
    came from, which is what lets a same-host transfer send the key instead of the bytes. Pickles as a plain
    array."""

    #: (mapping, store key) on the view ``data[k]`` returned; None on every other view
    store_ref: tuple[ShmStoreData, str] | None = None


class ShmStoreData(MutableMapping[Hashable, Any]):
    """A Dask worker's ``data``: its values in the node's store, under keys of its own.

    Args:
        name: the store (``SHMSTORE_NAME``; default ``job-$SLURM_JOB_ID`` under Slurm, else ``"default"``).
        session: the store session every worker's keys live in (apart from the application's own keys).
        min_size: values smaller than this many bytes (``dask.sizeof``) stay in the worker's private dict.
        sweep_interval: seconds between looks for objects of dead workers while values are stored.
        by_reference: send stored arrays to processes on this host by reference (see the module's docs).
        **connect_kwargs: for :func:`shmstore.connect` (``capacity``, ``spill_dir``, ...).

    Owns its store connection and the objects under its prefix: ``close()``
    (idempotent; also at interpreter exit) deletes them and closes the
    connection; it never deletes another worker's objects, except those of a
    dead worker (the sweep). One process's mapping; thread-safe (Dask reads
    from its event loop and executor threads).

    Raises:
        As :func:`shmstore.connect`.
    """

    _store: Store | None = None

    def __init__(self, name: str | None = None, *, session: str = "dask", min_size: int = 64 << 10,
                 sweep_interval: float = 10.0, by_reference: bool = True, **connect_kwargs: Any) -> None:
        self._prefix = new_prefix()
        self._owner = owner_of(self._prefix)
        self.min_size, self.sweep_interval, self.by_reference = int(min_size), float(sweep_interval), by_reference
        self._index: dict[Hashable, str] = {}  # dask key -> store key, for values in the store
        self._private: dict[Hashable, Any] = {}
        self._numbers = itertools.count()  # store keys of keys that are no literals
        self._lock = threading.RLock()
        # store key -> views being sent by reference lent views dropped (appended by finalizers)
        self._lent: collections.Counter[str] = collections.Counter()
        self._returned: collections.deque[str] = collections.deque()
        # deleted while lent: deleted in the store when the last lent view goes
        self._doomed: set[str] = set()
        self._warned: set[str] = set()
        self._store = connect(name, session=session, **connect_kwargs)
        self._last_sweep = 0.0
        try:
            # a worker restarted after a SIGKILL: what the killed one left goes now
            self.sweep()
        except BaseException:
            self.close()
            raise
        _open[id(self)] = self

    # ---- the mapping ----------------------------------------------------
    @property
    def store(self) -> Store:
        """The store connection.

        Raises:
            StoreClosedError: this mapping is closed.
        """
        store = self._store
        if store is None:
            raise StoreClosedError("dask worker storage is closed")
        return store

    @property
    def closed(self) -> bool:
        return self._store is None

    def __getitem__(self, key: Hashable) -> Any:
        """The value of ``key``: a stored array as a read-only :class:`DaskSharedArray` view, zero copy.

        Raises:
            KeyError: no such key (``ObjectNotFoundError`` where another thread deleted it meanwhile).
        """
        value = self._private.get(key, _MISSING)
        if value is not _MISSING:
            return value
        skey = self._index[key]
        value = self.store.get(skey)
        if type(value) is SharedArray:
            view = value.view(DaskSharedArray)
            view.store_ref = (self, skey)
            return view
        return value

    def __setitem__(self, key: Hashable, value: Any) -> None:
        """Keep ``value`` under ``key``: in the store (a copy into shared memory), or privately (see the
        module's docs), replacing what ``key`` held.

        Raises:
            StoreClosedError: closed.
        """
        with self._lock:
            self._settle()
            self._maybe_sweep()
            if self._keeps_private(value):
                self._private[key] = value.view(DaskSharedArray) if type(value) is DaskSharedArray else value
                self._forget_stored(key)
                return
            skey = self._index.get(key) or store_key(self._prefix, key, next(self._numbers))
            if not self._put(skey, value):
                self._private[key] = value
                self._forget_stored(key)
                return
            self._private.pop(key, None)
            self._index[key] = skey
            self._doomed.discard(skey)  # stored again under a key deleted while lent: keep the new object

    def __delitem__(self, key: Hashable) -> None:
        """Drop ``key``: this worker's value only, never another worker's copy.

        Raises:
            KeyError: no such key.
        """
        with self._lock:
            self._settle()
            if self._private.pop(key, _MISSING) is not _MISSING:
                return
            self._drop(self._index.pop(key))

    def __contains__(self, key: object) -> bool:
        return key in self._private or key in self._index

    def __iter__(self) -> Iterator[Hashable]:
        return iter([*self._index, *self._private])  # a snapshot: Dask changes the mapping while it iterates

    def __len__(self) -> int:
        return len(self._index) + len(self._private)

    @property
    def stored_keys(self) -> list[Hashable]:
        """The keys whose values are in the store (the rest are private)."""
        return list(self._index)

    def store_key(self, key: Hashable) -> str:
        """The store key of ``key``'s value.

        Raises:
            KeyError: ``key`` has no value in the store (none, or a private one).
        """
        return self._index[key]

    # ---- where values go ------------------------------------------------
    def _keeps_private(self, value: Any) -> bool:
        if isinstance(value, SharedArray) or isinstance(value, (bytes, bytearray, memoryview)):
            # already shared (zero copy as it is); bytes-like: the store would return a memoryview
            return True
        return _sizeof(value) < self.min_size

    def _put(self, skey: str, value: Any) -> bool:
        """Put ``value`` under ``skey``; False where the store cannot hold it (it then stays private)."""
        for attempt in (0, 1):
            try:
                self.store.put(skey, value, overwrite=True)
                return True
            except SerializationError as exc:
                self._warn_once("serialize", f"keeping values that cannot be pickled in the worker ({exc})")
                return False
            except StorageFullError as exc:
                if attempt == 0 and self.sweep(force=True):
                    continue  # dead workers' objects went: try once more
                self._warn_once("full", f"store {self.store.name!r} is full, keeping values in the worker "
                                        f"({exc})")
                return False
        return False

    def _forget_stored(self, key: Hashable) -> None:
        skey = self._index.pop(key, None)
        if skey is not None:
            self._drop(skey)

    def _drop(self, skey: str) -> None:
        if self._lent[skey]:
            self._doomed.add(skey)  # a view of it is being sent by reference: delete when it is dropped
        else:
            self.store.delete(skey, missing_ok=True)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            _log.warning(message)

    # ---- by-reference sends (dask_transfer) -------------------------------
    def lend(self, view: DaskSharedArray, skey: str) -> None:
        """Count ``view`` (of ``skey``) as being sent by reference until it is dropped: a ``del`` of its key
        meanwhile deletes the object only then (at this mapping's next verb after it). For the serializer."""
        with self._lock:
            self._lent[skey] += 1
        weakref.finalize(view, self._returned.append, skey)  # a finalizer takes no lock: deque.append is atomic

    def _settle(self) -> None:
        """Count the lent views dropped since; delete what was deleted while they were lent (lock held)."""
        while self._returned:
            skey = self._returned.popleft()
            self._lent[skey] -= 1
            if self._lent[skey] <= 0:
                del self._lent[skey]
                if skey in self._doomed:
                    self._doomed.discard(skey)
                    self.store.delete(skey, missing_ok=True)

    # ---- dead workers ---------------------------------------------------
    def sweep(self, force: bool = False) -> int:
        """Delete the objects of this store's dead workers (their processes are gone: SIGKILL, OOM killer).
        Runs at most once per ``sweep_interval`` unless ``force``; returns how many objects went.

        Raises:
            StoreClosedError: closed.
        """
        now = time.monotonic()
        if not force and now - self._last_sweep < self.sweep_interval:
            return 0
        self._last_sweep = now
        alive: dict[str, bool] = {}
        dead = []
        for info in self.store.kernel.list():
            owner = owner_of(info.key)
            if owner is None or owner == self._owner:
                continue  # a key made elsewhere, or ours
            if owner not in alive:
                alive[owner] = owner_alive(owner)
            if not alive[owner]:
                dead.append(info.key)
        if dead:
            self.store.delete_many(dead, missing_ok=True)
            _log.info("deleted %d objects of dead dask workers", len(dead))
        return len(dead)

    def _maybe_sweep(self) -> None:
        if time.monotonic() - self._last_sweep >= self.sweep_interval:
            self.sweep()

    # ---- lifecycle ------------------------------------------------------
    def close(self) -> None:
        """Delete this worker's objects and close the store connection; idempotent. Views handed out stay
        valid (each pins its object until dropped)."""
        store, self._store = self._store, None
        _open.pop(id(self), None)
        if store is None:
            return
        with self._lock:
            keys = [*self._index.values(), *self._doomed]
            self._index.clear()
            self._private.clear()
            self._doomed.clear()
        try:
            if keys and not store.closed:
                store.delete_many(keys, missing_ok=True)
        finally:
            store.close()

    def __enter__(self) -> ShmStoreData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("ShmStoreData is one worker's storage: pass data=(ShmStoreData, {...}) to Dask")

    def __repr__(self) -> str:
        state = "closed" if self._store is None else f"{len(self._index)} stored, {len(self._private)} private"
        return f"<shmstore.contrib.dask.ShmStoreData {self._prefix!r} {state}>"


def _sizeof(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    try:
        from dask.sizeof import sizeof
    except ImportError:
        import sys
        return sys.getsizeof(value)
    return int(sizeof(value))


@atexit.register
def _close_at_exit() -> None:
    """Delete the open mappings' objects at exit (registered after shmstore.store's own handler, so run before
    it: the stores are still open)."""
    for m in list(_open.values()):
        try:
            m.close()
        except Exception:  # noqa: BLE001 - at exit: the sweep of another worker or the store's end removes them
            pass


def open_mapping(name: str, node: str, session: str) -> ShmStoreData | None:
    """An open mapping of this process on store ``name`` of ``node``, in ``session``; None if there is none."""
    for m in list(_open.values()):
        store = m._store
        if store is not None and (store.name, store.node, store.session) == (name, node, session):
            return m
    return None


try:  # the same-host transfers by reference: with distributed only
    from . import dask_transfer  # noqa: E402,F401 - registers the serializer of DaskSharedArray
except ImportError:  # pragma: no cover - dask without distributed: the mapping alone
    pass
