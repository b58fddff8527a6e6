"""The user API: :func:`connect`, :class:`Store`, :func:`destroy`.

A :class:`Store` is one process's connection to its node's store: a client
slot, a :class:`~shmstore.client.kernel.Kernel` for its session, and the policy the
kernel leaves out (priority lists of levels, waiting for the spill process).
"""
from __future__ import annotations

import atexit
import builtins
import functools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from .checkpoint import Checkpoint, Restored, checkpoint, restore
from .client.kernel import NO_DEFAULT, Kernel, check_get_args
from .config import Config, explicit_settings
from .errors import (
    ConfigError,
    ConfigWarning,
    LayoutError,
    ObjectNotFoundError,
    ShmStoreError,
    StoreClosedError,
    StoreInUseError,
)
from .levels import Capacity, Level, ObjectInfo, parse_levels
from .levels.registry import open_levels
from .levels.spillfiles import of_store
from .mapping import StoreMapping
from .meta import layout as L
from .node.check import check as check_node
from .node.nodestore import NodeStore, pid_alive, reap_children, store_prefix
from .node.settings import ignored_settings
from .persist.flusher import progress_of
from .persist.plans import listed as listed_plans
from .persist.plans import plan_dir
from .persist.plans import remove_all as remove_plans
from .placement import DEFAULT_PUT_LEVELS, DEVICE_PUT_LEVELS, Placement
from .primitives.interrupts import guard as guard_signals
from .primitives.interrupts import interruptible
from .primitives.procs import stop_spawned
from .primitives.segment import unlink_segment, unlink_semaphore
from .refs import Ref, values_of
from .refs import new_key as new_ref_key
from .spill.requests import request_arena
from .spill.supervisor import ensure_spill, log_path, spill_alive, spill_booted
from .streams import Reader, Writer
from .values import Conditions

__all__ = ["Store", "connect", "destroy", "observe"]

_GONE: Any = object()  # a key deleted between listing it and reading it
_POP_RAISE: Any = object()  # pop's default: raise on a miss
_HOST_TYPES = frozenset((np.ndarray, bytes, bytearray, memoryview, dict, list, tuple, str, int, float))


class Store:
    """A connection to this node's store (see :func:`connect`).

    Owns a client slot, given back by ``close``; never destroys data other
    processes use. Process-safe; thread-safe. Pickling sends the settings
    only: the receiver connects to the same store.
    """

    _kernel: Kernel | None = None
    _node: NodeStore | None = None

    def __init__(self, config: Config, create: bool = True, observe: bool = False,
                 asked: frozenset[str] = frozenset(), strict: bool = False) -> None:
        # from now on a signal inside the store's code waits for the verb (see interrupts.py)
        guard_signals()
        self.config = config
        self._observe = observe
        deadline = time.monotonic() + 10
        while True:
            node = NodeStore.open(config, create)
            if asked and not node.created:  # an existing store keeps its creation-time settings: say so
                _check_settings(node, config, asked, strict)
            try:
                slot = node.register()
                break
            except FileNotFoundError as exc:  # the janitor is removing it: start a fresh one
                node.close()
                if time.monotonic() > deadline:
                    raise LayoutError(f"store {config.name!r} on node {config.node!r} kept being removed while this "
                                      f"process connected, for 10 s (a process destroying it again and again? "
                                      f"`shmstore status {config.name}` shows who uses it)") from exc
                time.sleep(0.01)
        self._node = node
        # the levels as this client reaches them: a device level asks the spill process for its arenas
        try:
            node.use_levels(open_levels(node, functools.partial(request_arena, node, slot)))
            node.prefault.pin_row(slot, config.name)  # before any get writes a pin byte
            self._kernel = Kernel(node, slot, config.session, on_detach=self._on_detach)
            self._placement = Placement(self._kernel, node, config)
            if not observe:
                ensure_spill(node)
                node.prefault.start(config.prefault)
        except BaseException:
            node.deregister(slot)
            node.close()
            raise
        _open_stores.add(self)

    # ---- properties -----------------------------------------------------
    @property
    def kernel(self) -> Kernel:
        """The kernel verbs on this store (never wait; raise at once when full)."""
        return self._checked()

    @property
    def node_store(self) -> NodeStore:
        """The node's metadata store under this connection: the inspection seam for tools and tests (its
        table, usage, locks and spill process, as :mod:`shmstore.node.nodestore` documents them). Storing and
        reading objects never needs it."""
        return self._node_checked()

    @property
    def placement(self) -> Placement:
        """Where objects go and the wait for room (``Placement.place``: what a transfer into this node uses to
        reserve its space on the first level with room)."""
        return self._placement_checked()

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def node(self) -> str:
        return self.config.node

    @property
    def session(self) -> str:
        return self.config.session

    @property
    def spill_pid(self) -> int:
        """Pid of this node store's spill process (restarted here if it died)."""
        return ensure_spill(self._node_checked())

    def wait_prefaulted(self, nbytes: int, timeout: float = 60.0) -> bool:
        """Wait until the first ``nbytes`` of the arena are faulted in (by the background thread of the
        process that created the store: ``prefault=``); False after ``timeout`` seconds, or where this
        process did not create the store. For benchmarks and jobs that want warm pages before timing."""
        return self._node_checked().prefault.wait(nbytes, timeout)

    @property
    def closed(self) -> bool:
        return self._kernel is None or self._kernel.closed

    def _checked(self) -> Kernel:
        k = self._kernel
        if k is None:
            raise StoreClosedError("store is closed (connect() again)")
        if k.forked:
            k = self._reconnect_in_child()
        k.check_open()
        return k

    def _reconnect_in_child(self) -> Kernel:
        """This store was opened before ``fork()`` and this is the child: it becomes a client of its own, on
        first use (fork, forkserver and spawn alike: a fork pool's or a DataLoader's workers just use it).
        The parent's connection is left as it was: its slot, pins and writers are the parent's and only the
        parent releases them (see ``Kernel._inherited``); views the child inherited stay valid, pinned by
        the parent, their memory mapped by the inherited segments, which the child keeps to its end.

        Raises:
            whatever ``connect()`` raises.
        """
        with _RECONNECTING:
            k = self._kernel
            if k is not None and k.forked:
                _INHERITED.append((k, self._node))  # never closed here: the parent's
                self._kernel = self._node = None
                Store.__init__(self, self.config, observe=self._observe)
        k = self._kernel
        if k is None:
            raise StoreClosedError("store is closed (connect() again)")
        return k

    def _node_checked(self) -> NodeStore:
        """The node store, unless this connection is closed.

        Raises:
            StoreClosedError: it is.
        """
        self._checked()
        node = self._node
        if node is None:
            raise StoreClosedError("store is closed (connect() again)")
        return node

    # ---- objects --------------------------------------------------------
    def put(self, key: str, obj: Any, levels: Iterable[Level] | Level | None = None,
            overwrite: bool = False) -> ObjectInfo:
        """Store ``obj`` under ``key`` on the first level of ``levels`` with room.

        ``levels`` defaults to ``[Level.MEMORY, Level.DISK]`` (``[Level.GPU,
        Level.MEMORY, Level.DISK]`` for a device array; levels this process
        cannot use, GPU without CuPy or a device, are passed over). When MEMORY is
        full of spillable objects, the spill process makes room first (the
        put waits up to ``spill_timeout``); an object larger than the level
        goes to the next one at once. Numpy arrays, alone or inside
        containers, come back from ``get`` as read-only zero-copy views;
        bytes-like values are stored raw.

        ``overwrite=True`` replaces an existing object atomically: a get
        returns the old object until this put returns and the new one
        after, never a miss in between (not even if this process is killed
        half way: then the old one stays); views of the old object stay
        valid until dropped, and its space is freed then.

        Raises:
            ObjectExistsError: ``key`` is present (delete it first, or pass ``overwrite=True``).
            ObjectLockedError: ``key`` is being written by another writer right now (another put of it, or
                a transfer of it into this node); retry, or order the writers.
            StorageFullError: no level of ``levels`` has room.
            SpillError: making room failed (disk full, I/O error).
            SerializationError, InvalidKeyError: bad input; nothing changes.
        """
        p = self._placement_checked()
        if levels is None:
            if type(obj) not in _HOST_TYPES and hasattr(obj, "__cuda_array_interface__"):
                return p.put(key, obj, DEVICE_PUT_LEVELS, overwrite)  # a device array stays on the device
            return p.put(key, obj, DEFAULT_PUT_LEVELS, overwrite)  # the common case: MEMORY first
        return p.put(key, obj, parse_levels(levels, DEFAULT_PUT_LEVELS), overwrite)

    def get(self, key: str, default: Any = NO_DEFAULT, *misuse: Any, conditions: Conditions | None = None,
            levels: Iterable[Level] | Level | None = None) -> Any:
        """The value of ``key``: views into shared memory (or into the spill file) for arrays and bytes.

        ``default`` is returned where ``key`` has no object, as with a dict
        (``get(key, None)``); without it a miss raises. ``conditions`` and
        ``levels`` are keyword-only. ``conditions`` slices an array without
        materialising it, e.g. ``conditions=(slice(0, 100),)``; on DISK only
        the pages needed are read. With ``levels``, an object on none of them
        is first moved to the first one (``levels=[Level.MEMORY]`` brings a
        spilled object back).

        Raises:
            ObjectNotFoundError: no such object in this session (and no ``default``); the message names the
                sessions that do hold the key.
            ObjectLockedError: it must move but is pinned.
            InvalidArgumentError: ``conditions`` on a non-array value; a third positional argument, or an
                index (a slice, or a tuple of them) as ``default``: ``conditions`` passed by position.
        """
        k = self._kernel
        if k is None:
            raise StoreClosedError("store is closed (connect() again)")
        if k.forked:
            k = self._reconnect_in_child()
        if misuse:
            check_get_args(key, default, misuse)
        if levels is not None:
            try:
                self._placement_checked().bring(key, parse_levels(levels, DEFAULT_PUT_LEVELS))
            except ObjectNotFoundError:
                if default is NO_DEFAULT:
                    raise
        if conditions is None:
            return k.get(key, default)
        return k.get(key, default, conditions=conditions)

    def move(self, key: str, level: Level, progress: Any = None) -> ObjectInfo:
        """Move ``key`` to ``level`` (explicit spill or restore); waits for the spill process.

        Args:
            progress: called with the spill state while this move's copy runs; not while the spill process
                moves other objects first (another client's move, room made on ``level``).

        Raises:
            ObjectNotFoundError, ObjectLockedError (pinned), StorageFullError, SpillError.
        """
        return self._placement_checked().move(key, parse_levels(level, ())[0], progress)

    def _placement_checked(self) -> Placement:
        self._checked()
        return self._placement

    def delete(self, key: str, missing_ok: bool = False) -> None:
        """Remove ``key``: hidden at once, space freed when its last view goes.

        Raises:
            ObjectNotFoundError: no such object (unless ``missing_ok``).
        """
        self._checked().delete(key, missing_ok)

    # ---- batches: each stripe's lock taken once per step, not once per key -------------------
    def put_many(self, items: Any, levels: Iterable[Level] | Level | None = None,
                 overwrite: bool = False) -> builtins.list[ObjectInfo]:
        """Store every value of ``items`` (a mapping, or (key, value) pairs: the last of a key wins), placed
        like ``put``; the ObjectInfos in ``items``' order.

        One batch on the first level with room for all of them (each key
        all-or-nothing, as ``put``: none visible until sealed whole, not
        even if this process is killed); where that level has no room for
        the whole batch, one ``put`` each, waiting for the spill process.

        Raises:
            As ``put``, for the first key that fails: the batch stops there, the message names the key and
            the keys stored before it (also in ``exc.done``; none where the batch's checks failed).
        """
        pairs = builtins.list(dict(items.items() if hasattr(items, "items") else items).items())
        p = self._placement_checked()
        return p.put_many(pairs, parse_levels(levels, DEFAULT_PUT_LEVELS), overwrite)

    def get_many(self, keys: Iterable[str | Ref], *,
                 levels: Iterable[Level] | Level | None = None) -> builtins.list[Any]:
        """The values of ``keys`` (as ``get`` returns them), in their order; a :class:`~shmstore.refs.Ref` among
        them is resolved as ``ref.get()`` does.

        With ``levels``, an object on none of them is first moved to the
        first one, as ``get`` does.

        Raises:
            ObjectNotFoundError: a key has no object (the first missing one, saying how many are); nothing
                stays pinned.
        """
        items = builtins.list(keys)
        if any(type(k) is Ref for k in items):
            return values_of(items, lambda ks: self.get_many(ks, levels=levels))
        names: builtins.list[str] = items  # type: ignore[assignment]  # no Ref among them
        if levels is not None:
            order = parse_levels(levels, DEFAULT_PUT_LEVELS)
            for key in names:
                self._placement_checked().bring(key, order)
        return self._checked().get_many(names)

    def delete_many(self, keys: Iterable[str], missing_ok: bool = False) -> int:
        """Delete every key of ``keys`` (each hidden at once, its space freed when its last view goes); returns
        how many objects went.

        Raises:
            ObjectNotFoundError: a key has no object (unless ``missing_ok``): the batch stops there; the keys
                deleted before it are in ``exc.done``.
        """
        return len(self._checked().delete_many(builtins.list(dict.fromkeys(keys)), missing_ok))

    def __contains__(self, key: object) -> bool:
        return self._checked().contains(key)  # type: ignore[arg-type]

    def get_info(self, key: str) -> ObjectInfo:
        """What the store knows about ``key``.

        Raises:
            ObjectNotFoundError: no such object.
        """
        return self._checked().info(key)

    def list(self, level: Level | None = None, *, all_sessions: bool = False) -> builtins.list[ObjectInfo]:
        """Objects of this session (of every session with ``all_sessions``: ``ObjectInfo.session`` says
        whose), optionally only those on ``level``."""
        return self._checked().list(None if level is None else parse_levels(level, ())[0], all_sessions)

    def keys(self) -> builtins.list[str]:
        """This session's keys, as a list: a snapshot (the store may change meanwhile), which callers index
        and slice. ``store.mapping().keys()`` is the ``KeysView`` of dict semantics."""
        return [i.key for i in self.list()]

    # ---- dict operators (store.mapping() is the MutableMapping view) -------------------------
    def __getitem__(self, key: str) -> Any:
        """``store[key]``: ``get(key)``; a miss raises ObjectNotFoundError, a KeyError."""
        return self.get(key)

    def __setitem__(self, key: str, obj: Any) -> None:
        """``store[key] = obj``: ``put(key, obj, overwrite=True)``, an atomic replace."""
        self.put(key, obj, overwrite=True)

    def __delitem__(self, key: str) -> None:
        """``del store[key]``: ``delete(key)``; a miss raises ObjectNotFoundError, a KeyError."""
        self.delete(key)

    def __len__(self) -> int:
        """Objects of this session."""
        return len(self.list())

    def __iter__(self) -> Iterator[str]:
        """This session's keys, as a snapshot (the loop may change the store)."""
        return iter(self.keys())

    def __bool__(self) -> bool:
        """Always True, even for an empty store: a Store is a connection, and ``store or shmstore.connect()``
        must not reconnect (or a check of an optional ``store=None`` argument take a fresh one) because it holds
        no object. ``len(store)`` counts the objects; ``store.mapping()`` has dict truth (false when empty)."""
        return True

    def items(self) -> builtins.list[tuple[str, Any]]:
        """(key, value) of this session's objects; one deleted meanwhile is left out."""
        return [(k, v) for k, v in zip(*self._snapshot()) if v is not _GONE]

    def values(self) -> builtins.list[Any]:
        """Values of this session's objects (as ``get`` returns them); one deleted meanwhile is left out."""
        return [v for v in self._snapshot()[1] if v is not _GONE]

    def _snapshot(self) -> tuple[builtins.list[str], builtins.list[Any]]:
        keys = self.keys()
        k = self._checked()
        return keys, [k.get(key, default=_GONE) for key in keys]

    def pop(self, key: str, default: Any = _POP_RAISE) -> Any:
        """Remove ``key`` and return its value (a view of it stays valid), else ``default`` if given.

        Raises:
            ObjectNotFoundError: (a KeyError) no such object and no ``default``.
        """
        value = self._checked().get(key, default=_GONE)
        if value is _GONE:
            if default is _POP_RAISE:
                return self.get(key)  # raises, naming the key (and the sessions that hold it)
            return default
        self.delete(key, missing_ok=True)  # deleted meanwhile by another process: popped there
        return value

    def update(self, other: Any = (), **kwargs: Any) -> None:
        """``store[k] = v`` for each pair of ``other`` (a mapping or (key, value) pairs) and ``kwargs``, as
        ``dict.update``; a batch (``put_many(..., overwrite=True)``)."""
        items = dict(other.items() if hasattr(other, "items") else other)
        items.update(kwargs)
        self.put_many(items, overwrite=True)

    def mapping(self) -> StoreMapping:
        """This connection as a :class:`collections.abc.MutableMapping` (dict semantics throughout, values
        as ``get`` returns them), for libraries that check for one (zict, zarr)."""
        return StoreMapping(self)

    def get_capacity(self) -> dict[Level, Capacity]:
        """Total, used, pinned, free, spillable, spilled and restored bytes per level."""
        return self._placement_checked().capacity()

    def clear(self) -> int:
        """Delete every object of this session; returns how many."""
        k = self._checked()
        infos = k.list()
        for info in infos:
            k.delete(info.key, missing_ok=True)
        return len(infos)

    def pin(self, key: str) -> None:
        """Pin ``key`` (counted) so that spill never moves it."""
        self._checked().pin(key)

    def unpin(self, key: str) -> None:
        """Undo one ``pin``."""
        self._checked().unpin(key)

    def open_writer(self, key: str, size: int, levels: Iterable[Level] | Level | None = None) -> Writer:
        """A writer for a new raw object of exactly ``size`` bytes, sealed on close.

        Placed like ``put``: the first level of ``levels`` with room.
        """
        p = self._placement_checked()
        order = parse_levels(levels, DEFAULT_PUT_LEVELS)
        writer: Writer = p.place(key, order, lambda level: Writer(self._checked(), key, size, level))
        return writer

    def open_reader(self, key: str) -> Reader:
        """A reader streaming the stored bytes of ``key`` (pinned while open)."""
        return Reader(self._checked(), key)

    # ---- checkpoints (shmstore/checkpoint.py) ------------------------------------------------
    def checkpoint(self, name: str, objects: Any) -> Checkpoint:
        """Checkpoint ``objects`` (a mapping of keys to values, or keys of objects in this store) as ``name``.

        The objects are copied into this node's store (the only wait); the spill process then writes them
        to ``persist_dir`` in the background and the manifest last: ``ck.wait()`` / ``ck.done()``. The
        newest ``checkpoint_keep`` complete checkpoints are kept, older ones removed from the folder and
        the store once a newer one completes. A checkpoint is kept apart from the store's own keys: its
        copies are not in ``keys()``, and later puts, overwrites and deletes do not change it.

        Raises:
            InvalidArgumentError: a bad name or key. ObjectNotFoundError: a key of ``objects`` not in the
                store. StorageFullError: the store has no room for the copies.
        """
        return checkpoint(self, name, objects)

    def restore(self, name: str | None = None) -> Restored:
        """The newest complete checkpoint (named ``name``, if given) in ``persist_dir``: a mapping of its keys
        to their values, each read on first use from this node's store where it still holds it (views), else
        from the folder (the file mapped, checked against its checksum).

        Raises:
            CheckpointError: no complete checkpoint; on reading a key: no whole copy of it anywhere (naming
                every place tried).
        """
        return restore(self, name)

    def share(self, obj: Any, levels: Iterable[Level] | Level | None = None) -> Ref:
        """Put ``obj`` under a generated key (``@ref/`` and a uuid) and return a :class:`~shmstore.refs.Ref`, a
        small picklable handle that resolves (``ref.get()``) to the zero-copy value in any process of this
        node, like ``ray.put``. ``ref.delete()``, or ``with store.share(obj) as ref:``, ends the object.

        Raises:
            StorageFullError, SpillError, SerializationError: as ``put``.
        """
        key = new_ref_key()
        self.put(key, obj, levels)
        return Ref.shared(self, key)

    def check(self) -> builtins.list[str]:
        """Check every invariant of this node store's metadata, spill files and counters.

        Holds every lock of the store meanwhile (tens of milliseconds for a
        large table). Meant for tests, debugging and ``shmstore check``.

        Returns:
            The problems found, as sentences; empty when the store is consistent.

        Raises:
            LockTimeoutError: a lock stayed taken for ``lock_timeout``.
        """
        return check_node(self._node_checked())

    def status(self) -> dict[str, Any]:
        """A snapshot of the whole node store: capacity per level, clients, spill process."""
        node = self._node_checked()
        spill = node.spill_pid()
        return {
            "name": self.config.name, "node": self.config.node, "segments": node.prefix + "-*",
            "persistent": bool(L.HEAD.get(node.buf, "flags") & L.FLAG_PERSIST),
            "objects": node.nobjects(),
            "levels": {lv.name.lower(): c._asdict() for lv, c in self._placement.capacity().items()},
            "spill_dir": node.spill_path,
            "moving": _moving(node),
            # checkpoint parts this node's spill process is flushing (or flushed, awaiting the other nodes')
            "checkpoints": progress_of(node.spill_path),
            "clients": [{"pid": pid, "alive": pid_alive(pid, start), "slot": slot}
                        for slot, pid, start in node.clients()],
            "spill": {"pid": spill, "alive": pid_alive(spill),
                      "heartbeat": L.unpack_spill_state(node.buf).heartbeat,  # time.time() of its last round
                      "log": log_path(node) if os.path.lexists(log_path(node)) else None},  # problems it logged
        }

    def wait_spill_ready(self, timeout: float = 10.0) -> bool:
        """Wait until this node's spill process has started (its imports and its recovery of what a previous
        one left): True; False where none runs or after ``timeout`` seconds. ``connect()`` does not wait (a
        put needs no spill process until memory is full); a :class:`~shmstore.mpi.Cluster` does, so that the
        start-up's CPU time (a few hundred ms of one core) is spent in its constructor, not beside the
        application's first steps."""
        return _wait_spill_ready(self._node_checked(), timeout)

    # ---- lifecycle ------------------------------------------------------
    def close(self) -> None:
        """Detach this process; idempotent. Never destroys data others use.

        If views returned by ``get`` are still alive, the mapping stays until
        they are garbage collected. The last client's detach removes the
        store (unless ``persist``): its spill process does, or, where that
        one has not finished starting yet, the client itself, stopping it.
        """
        if self._kernel is not None and not self._kernel.close():  # detaching runs _on_detach, now or when
            node = self._node  # the last view dies; meanwhile each view keeps the device mapping it reads,
            if node is not None:  # and the store keeps none, so the last view unmaps
                node.forget_mappings()

    def _on_detach(self, remaining: int) -> None:
        node, self._node = self._node, None
        if node is not None:
            if remaining == 0 and not self._observe:
                if spill_alive(node) and spill_booted(node):
                    node.wake.post()  # the janitor removes the store now rather than at its next round
                # no janitor (yet) to do it: the last client does, and a spill process of ours still importing need
                # not finish, but for the checkpoint plans this client left it (see _flush_waits)
                elif node.remove_if_unused(keep=functools.partial(_flush_waits, node)) is not None:
                    stop_spawned(node.spill_pid())
            node.close()
        reap_children()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, ShmStoreError):  # a finalizer never raises; the janitor reclaims the slot
            pass

    def __reduce__(self) -> tuple[Any, tuple[Config]]:
        return (_reconnect, (self.config,))

    def _close_at_exit(self) -> None:
        """Close at interpreter exit; where views still pin objects, leave the slot to the janitor."""
        k = self._kernel
        if k is not None and not k.close():
            # The views die during interpreter teardown, where store code can no longer run (imports fail):
            # their releases become no-ops and the spill process reclaims this slot once the process is gone.
            k.pins.closed = True

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        c = self.config
        return f"<shmstore.Store {c.name!r} node={c.node!r} session={c.session!r} {state}>"


def _moving(node: NodeStore) -> dict[str, Any] | None:
    s = L.unpack_spill_state(node.buf)
    if not s.moving:
        return None
    return {"entry": s.moving - 1, "to": Level(s.moving_to).name.lower(), "done": s.progress, "total": s.total}


def _reconnect(config: Config) -> Store:
    return Store(config)


def _check_settings(node: NodeStore, config: Config, asked: frozenset[str], strict: bool) -> None:
    """Warn (``ConfigWarning``) where settings ``asked`` for differ from those the existing store ``node`` was
    created with, each named with both values; with ``strict``, close ``node`` and raise instead.

    Raises:
        ConfigError: ``strict`` and a setting differs.
    """
    ignored = ignored_settings(node, config, asked)
    if not ignored:
        return
    msg = (f"store {config.name!r} on node {config.node!r} already exists with other settings; ignored: "
           f"{'; '.join(ignored)} (a store keeps the settings it was created with: connect without them, or "
           f"shmstore.destroy({config.name!r}) and connect again)")
    if strict:
        node.close()
        raise ConfigError(msg)
    warnings.warn(msg, ConfigWarning, stacklevel=4)  # at the caller of connect()


def connect(name: str | None = None, *, create: bool = True, strict: bool = False, **kwargs: Any) -> Store:
    """Connect to this node's store, creating it on first use.

    Args:
        name: the store's name (``SHMSTORE_NAME``; default ``job-$SLURM_JOB_ID``
            under Slurm, else ``"default"``).
        **kwargs: ``capacity``, ``spill_dir``, ``session``, ``node``,
            ``persist``, ``high_watermark``, ``low_watermark``,
            ``lock_timeout``, ``max_objects``, ``max_clients``, ``prefault``.
        create: False to attach only: a consumer that must find data a producer
            left raises StoreNotFoundError (also a FileNotFoundError) instead of
            silently creating an empty store.
        strict: raise ConfigError, rather than warn, where the store exists
            and a creation-time setting passed (as a keyword or a
            ``SHMSTORE_*`` variable: ``capacity``, ``spill_dir``,
            ``disk_capacity``, ``gpu_capacity``, ``max_objects``,
            ``max_clients``, the watermarks, ``persist``) differs from the
            store's: an existing store keeps the settings it was created with.

    Warns:
        ConfigWarning: the store exists and such a setting differs (naming
            each one, what was asked and what the store has).

    Raises:
        TypeError: an unknown setting. ConfigError: a bad value; with ``strict``, an ignored setting.
        StorageFullError: /dev/shm cannot hold the capacity asked for.
        LayoutError, PermissionError: the segments are not ours to use.
    """
    return Store(Config.from_kwargs(name=name, **kwargs), create, asked=explicit_settings(kwargs), strict=strict)


def observe(name: str | None = None, **kwargs: Any) -> Store:
    """Attach to an existing store only to look at it (the CLI's status, ls, info, check): starts no spill
    process and removes nothing when it closes, even where the store's job is gone, so a look changes
    nothing. ``kwargs``: ``node``, ``session``.

    Raises:
        StoreNotFoundError: no such store on this node.
    """
    return Store(Config.from_kwargs(name=name, prefault=0, **kwargs), create=False, observe=True)


def destroy(name: str | None = None, force: bool = False, node: str | None = None) -> bool:
    """Remove a store's segments and spill files.

    Refuses while live clients are attached, unless ``force``.

    Returns:
        True if anything was removed.

    Raises:
        StoreInUseError: live clients are attached and ``force`` is False.
    """
    cfg = Config.from_kwargs(name=name, node=node)
    prefix = store_prefix(cfg.name, cfg.node)
    try:
        ns = NodeStore.open(cfg, create=False)
    except (FileNotFoundError, ShmStoreError, PermissionError, BlockingIOError):
        # exactly this store's names, each only if a regular file of ours (never 'name-x's, nor a planted FIFO)
        leftovers = [unlink_segment(prefix + "-arena"), unlink_semaphore(prefix + "-wake"),
                     unlink_segment(prefix + "-meta")]
        return any(leftovers)
    try:
        with ns.admin:
            # the store's own spill process holds a slot while it flushes a checkpoint: not a user of it
            live = [pid for _, pid, start in ns.clients() if pid_alive(pid, start) and pid != ns.spill_pid()]
            if live and not force:
                procs = list(dict.fromkeys(live))  # a process connected twice holds two slots: named once
                raise StoreInUseError(f"store {cfg.name!r} has {len(live)} attached client(s) (pid"
                                      f"{'s' if len(procs) > 1 else ''} {', '.join(map(str, procs[:8]))}); close "
                                      f"them or pass force=True")
            L.HEAD.set(ns.buf, "state", L.STATE_DESTROYING)
        of_store(ns).remove_all()  # its spill files (no level is opened here: see NodeStore.unlink)
        remove_plans(plan_dir(ns.spill_path))  # its checkpoints' flush plans: their parts can never be flushed now
        ns.unlink()
    finally:
        ns.close()
    return True


_open_stores: weakref.WeakSet[Store] = weakref.WeakSet()
# a forked child's inherited connections (kernel, node store): kept, never closed, to the child's end
_INHERITED: list[tuple[Any, Any]] = []
_RECONNECTING = threading.Lock()  # two threads of a child using the store first at once reconnect once


@atexit.register
def _close_at_exit() -> None:
    """Close the stores still open, while the interpreter is whole.

    A store never closed used to be closed by ``Store.__del__`` during
    interpreter teardown, which printed ``Exception ignored in Store.__del__
    ... sys.meta_path is None`` (imports fail by then). atexit handlers run
    before teardown, last registered first: this one runs after the handlers
    of any code that imported shmstore, which may still use its stores.
    """
    for store in list(_open_stores):
        try:
            store._close_at_exit()
        except (OSError, ShmStoreError):  # as in __del__: the janitor reclaims what this could not
            pass


@interruptible
def _flush_waits(node: NodeStore) -> bool:
    """Whether checkpoint plans wait for a spill process that is still starting: the store stays, and that
    process flushes them, then removes it (the last client removed it, and the checkpoint was lost without a
    word: a job that ends right after its checkpoint, before its spill process booted)."""
    return spill_alive(node) and bool(listed_plans(plan_dir(node.spill_path)))


def _wait_spill_ready(node: NodeStore, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    nap = 0.001
    while not spill_booted(node):
        if not spill_alive(node) or time.monotonic() >= deadline:
            return False
        time.sleep(nap)
        nap = min(nap * 2, 0.02)
    return True
