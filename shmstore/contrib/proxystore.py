"""A ProxyStore connector over shmstore (extra ``proxystore``).

::

    from proxystore.store import Store
    from shmstore.contrib.proxystore import ShmStoreConnector, serialize, deserialize

    with Store("shm", ShmStoreConnector(), serializer=serialize, deserializer=deserialize,
               register=True) as store:
        proxy = store.proxy(np.arange(10**8))  # resolved in any process of the node:
                                               # a read-only view of the store's memory

:class:`ShmStoreConnector` implements ProxyStore's ``Connector`` and
``DeferrableConnector`` protocols on a node's store (node-local by default),
or across the nodes of an MPI job through :class:`shmstore.mpi.Cluster`
(``cluster=True``: a proxy resolved on another node fetches the object into
that node once).

:func:`serialize`/:func:`deserialize` are a zero-copy pair: ProxyStore's
default deserializer reads through ``io.BytesIO``, which copies every array;
with this pair, numpy arrays and torch CPU tensors inside a proxied object
resolve as read-only views of the store's shared memory (the object stays
pinned, so spill never moves it, until the last view is dropped).
:func:`serialize` writes a large object (1 MiB or more) straight into the
store of the connector this process used last (the most recently made one
before any put): the bytes it returns are a read-only view of an object
already sealed there under a fresh key, and that connector's ``put``
adopts it without copying (one copy in all, as a raw connector put). The
bytes are whole and valid anywhere: given to another connector, they are
copied as any bytes are, and the staged object is deleted once its view is
dropped (at this connector's next verb or close; a process killed between
``serialize`` and ``put`` leaves it in a persistent store, under a key
nobody knows, until ``destroy``).

Lifetimes: a store lives while a process is connected to it. A producer
that closes its connector (or exits) before the consumers resolve their
proxies takes the data with it unless the store was created persistent:
``ShmStoreConnector(persist=True)``, removed later with
``shmstore.destroy(name)`` or ``shmstore gc``. Using a connector after
``close()`` raises :class:`~shmstore.errors.StoreClosedError` (ProxyStore
says use after close is undefined; here it is an error, never a crash),
except ``exists``, which still answers, as ProxyStore's Local and File
connectors do: by a look at the store, which holds the object while it
lives (persistent, or other processes attached).
"""
from __future__ import annotations

import collections
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import errors
from ..meta import layout as L
from ..node import serialize as _codec
from ..store import Store, connect, observe
from ..values import Level

__all__ = ["ShmStoreKey", "ShmStoreConnector", "serialize", "deserialize"]

_MAGIC = b"SHMSTORE-PICKLE5"
# the magic, padded: blobs keep the 64-byte alignment the store gives the object
_PREFIX = 64
# smaller: a fresh buffer and the put's copy cost less than a staged object's verbs
_STAGE_MIN = 1 << 20
_new = tuple.__new__
_STAGER: list[weakref.ref[ShmStoreConnector]] = []  # where serialize() writes (ShmStoreConnector._stage)


class _Stage:
    """A staged object's key and fate, kept apart from its view (the view's finalizer must not reach it)."""

    __slots__ = ("key", "connector", "adopted")

    def __init__(self, key: str, connector: ShmStoreConnector) -> None:
        self.key, self.connector, self.adopted = key, weakref.ref(connector), False

    def dropped(self) -> None:
        """The view is gone: unless a put adopted it, its connector deletes it at its next verb.

        A finalizer: it may run inside a locked section of this very thread, so it takes no lock
        (``deque.append`` is atomic) and leaves the delete to the connector.
        """
        c = self.connector()
        if not self.adopted and c is not None:
            c._orphans.append(self.key)


class _Staged(np.ndarray):
    """The read-only bytes of an object :func:`serialize` sealed in a connector's store (a pinned view of
    it); ``_stage`` says which. Only ``memoryview(staged)`` leaves this module."""

    _stage: _Stage


class ShmStoreKey(NamedTuple):
    """Key of an object put through :class:`ShmStoreConnector`."""

    shm_key: str


class ShmStoreConnector:
    """ProxyStore connector storing objects in shmstore.

    Args:
        name: the shmstore store (``SHMSTORE_NAME``; default ``job-$SLURM_JOB_ID``
            under Slurm, else ``"default"``).
        session: the shmstore session keys live in (namespaces them from the
            application's own keys).
        cluster: False: this node's store. True: the :class:`shmstore.mpi.Cluster`
            this process has open over store ``name`` (create it on every rank
            first); objects are then found on any node. A process that
            resolves a proxy without an open Cluster falls back to its node's store.
        clear: ``close()`` evicts the objects this connector put.
        **connect_kwargs: passed to :func:`shmstore.connect` (``capacity``,
            ``spill_dir``, ``persist``, ...).

    Owns its store connection (not a Cluster's); ``close()`` is idempotent.
    Thread-safe.
    """

    def __init__(self, name: str | None = None, *, session: str = "proxystore", cluster: bool = False,
                 clear: bool = False, **connect_kwargs: Any) -> None:
        self._kwargs = dict(connect_kwargs)
        self.clear = clear
        self._cluster = None
        self._own: Store | None = None
        if cluster:
            self._cluster = _open_cluster(name)
        if self._cluster is not None:
            self.store = self._cluster.store
            if self.store.session != session:
                raise errors.InvalidArgumentError(
                    f"the open Cluster's store has session {self.store.session!r}, not {session!r} (create the "
                    f"Cluster with session={session!r}, or pass the connector its session)")
        else:
            self.store = self._own = connect(name, session=session, **connect_kwargs)
        self.name, self.session, self.cluster = self.store.name, session, cluster
        self._put_keys: set[str] = set()
        # keys: 16 random hex digits drawn once per connector, then a serial number (a random key per put cost
        # ~2.5 us of getrandom here: a tenth of a small put+get+evict)
        self._prefix, self._serial = os.urandom(8).hex() + "-", itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._stages: dict[str, _Stage] = {}  # staged by serialize(), not yet put
        self._orphans: collections.deque[str] = collections.deque()  # staged, dropped unput: to delete
        _STAGER[:] = [weakref.ref(self)]

    def __repr__(self) -> str:
        where = "cluster" if self._cluster is not None else f"node {self.store.node!r}"
        return f"ShmStoreConnector(name={self.name!r}, session={self.session!r}, {where})"

    def __enter__(self) -> ShmStoreConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- configuration ------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """What :meth:`from_config` needs to connect to the same store (in any process)."""
        return {"name": self.name, "session": self.session, "cluster": self.cluster, "clear": self.clear,
                **self._kwargs}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ShmStoreConnector:
        return cls(**config)

    def close(self, clear: bool | None = None) -> None:
        """Disconnect; with ``clear`` (default: the constructor's) evict what this connector put first.

        Idempotent. A Cluster's store stays open (the Cluster owns it).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            keys, self._put_keys = self._put_keys, set()
            stages, self._stages = self._stages, {}
        # staged, never put: hidden now (views of them stay valid until dropped)
        for stage in stages.values():
            stage.adopted = True
            try:
                self._evict(stage.key)
            except errors.StoreClosedError:  # the Cluster closed its store first: nothing more to do from here
                break
        self._reap()
        if self.clear if clear is None else clear:
            for k in keys:
                self._evict(k)
        if self._own is not None:
            self._own.close()

    def _check(self) -> None:
        if self._closed:
            raise errors.StoreClosedError(f"{self!r} is closed (make a new connector)")

    # ---- the Connector protocol ---------------------------------------------------------
    def put(self, obj: Any) -> ShmStoreKey:
        """Store the bytes-like ``obj``; its key.

        Bytes that :func:`serialize` staged in this connector's store are
        adopted as they are (their key is returned; no copy).
        """
        self._check()
        if type(obj) is memoryview:
            adopted = self._adopt(obj)
            if adopted is not None:
                return ShmStoreKey(adopted)
        k = self._prefix + format(next(self._serial), "x")  # (new_key)
        self._put(k, obj, overwrite=False)
        key: ShmStoreKey = _new(ShmStoreKey, (k,))  # (the NamedTuple's own __new__ is a Python call)
        return key

    def put_batch(self, objs: Sequence[Any]) -> list[ShmStoreKey]:
        """Store each bytes-like value of ``objs``; their keys. On a node's store one ``put_many`` (each stripe
        lock taken once, not once per value); staged bytes are adopted as by :meth:`put`."""
        self._check()
        if self._cluster is not None:  # (the Cluster has no put_many: it registers each key with its home)
            return [self.put(obj) for obj in objs]
        keys = [self._adopt(obj) for obj in objs]
        todo = {}
        for i, obj in enumerate(objs):
            if keys[i] is None:
                keys[i] = k = self.new_key().shm_key
                todo[k] = obj
        self._put_many(todo)
        return [ShmStoreKey(k) for k in keys]  # type: ignore[arg-type]

    def _put_many(self, items: dict[str, Any]) -> None:
        """:meth:`_put` of many (new keys, this connector's node store)."""
        _STAGER[:] = [weakref.ref(self)]
        if self._orphans:
            self._reap()
        for obj in items.values():
            if not isinstance(obj, (bytes, bytearray, memoryview)):
                raise errors.InvalidArgumentError(f"ShmStoreConnector stores bytes-like values, not "
                                                  f"{type(obj).__name__} (serialize it first)")
        self.store.put_many(items)
        with self._lock:
            self._put_keys.update(items)

    def get(self, key: ShmStoreKey) -> Any:
        """The bytes of ``key`` as a read-only memoryview of the store's memory, or None.

        The view pins the object (spill never moves it) until it is dropped.
        """
        self._check()
        try:
            if self._cluster is not None:
                return self._cluster.get(key.shm_key)
            return self.store.get(key.shm_key)
        except errors.ObjectNotFoundError:
            return None

    def get_batch(self, keys: Sequence[ShmStoreKey]) -> list[Any]:
        """:meth:`get` of each key (None for a missing one): on a node's store one ``get_many`` (each stripe
        lock taken once, not once per key), with a Cluster one batch fetch."""
        self._check()
        names = [key.shm_key for key in keys]
        try:
            values: list[Any] = self.store.get_many(names) if self._cluster is None else \
                self._cluster.get_many(names)
            return values
        except errors.ObjectNotFoundError:  # some are missing: None for those, key by key
            return [self.get(key) for key in keys]

    def exists(self, key: ShmStoreKey) -> bool:
        """Whether ``key`` holds an object (on any node, with a Cluster). Answers after :meth:`close` too."""
        if self._closed:
            return self._exists_after_close(key.shm_key)
        if key.shm_key in self.store:
            return True
        return self._cluster is not None and bool(self._cluster.locate(key.shm_key))

    def _exists_after_close(self, k: str) -> bool:
        """``exists`` of a closed connector: through the Cluster while it is still open (it is not ours), else
        by a look at this node's store (:func:`~shmstore.store.observe`: no spill process started, nothing
        removed); False once the store is gone (removed when its last client closed it)."""
        if self._cluster is not None and not self.store.closed:
            return k in self.store or bool(self._cluster.locate(k))
        try:
            with observe(self.name, node=self.store.node, session=self.session) as look:
                return k in look
        except errors.StoreNotFoundError:
            return False

    def evict(self, key: ShmStoreKey) -> None:
        """Remove ``key`` (every copy, with a Cluster); a missing key is no error."""
        self._check()
        self._evict(key.shm_key)
        with self._lock:
            self._put_keys.discard(key.shm_key)

    def _evict(self, k: str) -> None:
        if self._cluster is not None:
            self._cluster.delete(k)
        else:
            self.store.delete(k, missing_ok=True)

    # ---- the DeferrableConnector protocol ---------------------------------------------
    def new_key(self, obj: Any = None) -> ShmStoreKey:
        """A fresh key (``obj`` is ignored)."""
        self._check()
        return ShmStoreKey(self._prefix + format(next(self._serial), "x"))

    def set(self, key: ShmStoreKey, obj: Any) -> None:
        """Associate ``obj`` with ``key``, replacing what it held atomically (``ref.update()`` relies on it)."""
        self._check()
        self._put(key.shm_key, obj, overwrite=True)

    def _put(self, k: str, obj: Any, overwrite: bool) -> None:
        if not _STAGER or _STAGER[0]() is not self:
            _STAGER[:] = [weakref.ref(self)]
        if self._orphans:
            self._reap()
        if not isinstance(obj, (bytes, bytearray, memoryview)):
            raise errors.InvalidArgumentError(f"ShmStoreConnector stores bytes-like values, not "
                                              f"{type(obj).__name__} (serialize it first)")
        if self._cluster is not None:
            self._cluster.put(k, obj, overwrite=overwrite)
        else:
            self.store.put(k, obj, overwrite=overwrite)
        with self._lock:
            self._put_keys.add(k)


    # ---- staging: serialize() writes into the store, put adopts ---------------------------------
    def _stage(self, enc: _codec.Encoded, size: int) -> _Staged | None:
        """``enc`` behind the prefix, written straight into this store as a new sealed raw object of
        ``size`` bytes: a pinned read-only view of it, or None (closed, no room in memory) where
        :func:`serialize` must use a buffer of its own."""
        if self._closed:
            return None
        key = os.urandom(16).hex()
        try:
            if self._cluster is not None:  # sealed, then registered in the location directory
                w = self._cluster.open_writer(key, size)
            else:
                w = self.store.open_writer(key, size, levels=Level.MEMORY)
        except errors.ShmStoreError:
            return None
        try:
            dst = np.frombuffer(w.buffer, np.uint8)  # InvalidArgumentError: placed on disk
            _fill(dst, enc)
            w.advance(size)
            w.close()
        except errors.InvalidArgumentError:
            w.abort()
            return None
        except BaseException:
            w.abort()
            raise
        try:
            view = self.store.get(key)  # a lease: pins it while the view lives
        except errors.ShmStoreError:  # deleted at once by another process (a clear() of the session)
            return None
        staged = np.frombuffer(view, np.uint8).view(_Staged)
        stage = staged._stage = _Stage(key, self)
        weakref.finalize(staged, stage.dropped)
        with self._lock:
            self._stages[key] = stage
        return staged

    def _adopt(self, obj: Any) -> str | None:
        """The key of ``obj`` if it is the whole of bytes staged in this store and not yet put, else None."""
        staged: Any = obj.obj if type(obj) is memoryview else None
        if type(staged) is not _Staged:
            return None
        if obj.nbytes != staged.nbytes or not obj.contiguous:  # a part of it: bytes like any other
            return None
        with self._lock:
            stage = self._stages.pop(staged._stage.key, None)
            if stage is None:
                return None  # another connector's, or put already: copied under a new key
            stage.adopted = True
            self._put_keys.add(stage.key)
        _STAGER[:] = [weakref.ref(self)]
        return stage.key

    def _reap(self) -> None:
        """Delete what serialize() staged here and nobody put (views dropped)."""
        while self._orphans:
            k = self._orphans.popleft()
            with self._lock:
                if self._stages.pop(k, None) is None:
                    continue
            try:
                self._evict(k)
            except errors.StoreClosedError:
                return


def _open_cluster(name: str | None) -> Any:
    """The Cluster this process has open over store ``name`` (shmstore.mpi imported only if it was)."""
    mod = sys.modules.get("shmstore.mpi.cluster")
    if mod is None:
        return None
    from ..config import Config
    return mod.Cluster.opened(Config.from_kwargs(name=name).name)


# ---- the zero-copy serializer pair -----------------------------------------------------

def serialize(obj: Any) -> memoryview:
    """``obj`` as bytes that :func:`deserialize` rebuilds over, without copying arrays.

    Pickle protocol 5: numpy arrays and torch CPU tensors are laid out as
    raw, 64-byte aligned blobs after the pickle stream.

    Raises:
        SerializationError: ``obj`` cannot be pickled.
    """
    enc = _codec.encode_pickle(obj)
    size = _PREFIX + enc.size
    target = _STAGER[0]() if _STAGER and size >= _STAGE_MIN else None
    staged = None if target is None else target._stage(enc, size)
    if staged is not None:
        return staged.data  # a memoryview whose ``obj`` is ``staged``
    out = np.empty(size, np.uint8)  # not bytearray(n): zero-filling it costs 4x the copy
    _fill(out, enc)
    return out.data


def _fill(out: np.ndarray, enc: _codec.Encoded) -> None:
    """The prefix, then ``enc``, into ``out`` (a writable uint8 array of ``_PREFIX + enc.size`` bytes)."""
    out[:_PREFIX] = 0
    out[:len(_MAGIC)] = np.frombuffer(_MAGIC, np.uint8)
    _codec.write(enc, out, _PREFIX)


def deserialize(data: Any) -> Any:
    """Rebuild an object made by :func:`serialize`; its arrays are read-only views of ``data``.

    Data that :func:`serialize` did not make goes to ProxyStore's own
    deserializer.

    Raises:
        SerializationError: the data is damaged (truncated, a header that does not add up, a pickle that
            does not load), or ProxyStore's deserializer refused data without our prefix.
    """
    try:
        mv = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
    except (TypeError, ValueError) as exc:
        raise errors.SerializationError(f"cannot deserialize a {type(data).__name__}: {exc}") from None
    if bytes(mv[:len(_MAGIC)]) != _MAGIC:
        return _deserialize_theirs(mv)
    base = np.frombuffer(mv, np.uint8, offset=min(_PREFIX, len(mv)))
    if base.flags.writeable:  # a writable buffer: views of it must not write into the caller's
        base = base.view()
        base.flags.writeable = False
    _check_frame(base, len(mv))
    return _codec.decode(L.KIND_PICKLE, base, base.nbytes)


def _check_frame(base: np.ndarray, size: int) -> None:
    """Raise SerializationError unless the header in ``base`` and every part it names fit in ``base``."""
    damaged = f"serialized object of {size} bytes is truncated or damaged (not as serialize() made it)"
    if base.nbytes < L.OBJECT_HEADER.size:
        raise errors.SerializationError(damaged)
    nblobs = L.OBJECT_HEADER.unpack(base, 0).nblobs
    if _codec.object_header_size(nblobs) > base.nbytes:
        raise errors.SerializationError(damaged)
    start, plen, blobs = _codec.unpack_object_header(base)
    if start + plen > base.nbytes or any(o + n > base.nbytes for o, n in blobs):
        raise errors.SerializationError(damaged)


def _deserialize_theirs(mv: memoryview) -> Any:
    from proxystore.serialize import deserialize as theirs
    try:
        return theirs(bytes(mv))
    # theirs raises its own SerializationError, or whatever its decoders do
    except Exception as exc:
        raise errors.SerializationError(f"cannot deserialize {len(mv)} bytes: not made by shmstore's serialize(), "
                                        f"and ProxyStore's deserializer refused them: {exc}") from exc
