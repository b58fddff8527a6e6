"""This process's side of the GPU arenas, in plain Python over injected CUDA calls (issue 23 items 9-12).

- :class:`DeviceIds`: which device is which. CUDA ordinals depend on each
  process's ``CUDA_VISIBLE_DEVICES`` (a spill process inherits its
  spawner's; ranks bound to different GPUs all call theirs "device 0"), so
  an arena record names its device by a key that is the same in every
  process (:func:`device_key`, from the PCI bus id and the UUID), and each
  process maps that key to its own ordinal.
- :class:`MappingRegistry`: one mapping of an arena per process, shared by
  every level and every view that uses it (two ``connect``s to one store,
  a Cluster and a Store), refcounted. Older drivers refuse to open one IPC
  handle twice in a process (``CUDA_ERROR_ALREADY_MAPPED``, UCX #3192), and
  ``close()`` of a store must not unmap memory a view still reads: an
  access after ``cudaIpcCloseMemHandle`` is an illegal address, which kills
  the process's CUDA context for good. The owner's own allocation (the
  spill process) is registered too, so that a level of the same process
  uses its pointer instead of opening its own handle (which CUDA refuses).
- :func:`view_owner`: the memory owner of a device array handed out. It
  holds the object's pin and a reference to the mapping; when the array is
  collected it first lets the device finish the work this process queued
  (``settle``), then lets the mapping go, and only then the pin (see the
  rule in :func:`view_owner`).

The CUDA calls (open, close, settle, the device list) are passed in: the
GPU level passes CuPy's, from ``levels/device.py``; tests pass fakes.
Process-local; thread-safe.
"""
from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Hashable, Sequence
from typing import Any, Callable

from ..errors import DeviceError
from ..primitives.interrupts import finalizer

__all__ = ["device_key", "DeviceIds", "claim_slot", "Mapping", "MappingRegistry", "ViewOwner", "view_owner"]

KEY_SIZE = 16
UNCLAIMED = bytes(KEY_SIZE)


def device_key(pci_bus_id: str, uuid: bytes) -> bytes:
    """The 16 bytes naming a device in the metadata, the same in every process of the node.

    Both parts, because neither alone is enough: MIG instances share a PCI
    bus id, and CuPy's ``uuid`` property may come back short (a C string of
    the 16 UUID bytes stops at the first zero byte). Never all zero (which
    marks an unclaimed arena slot).
    """
    key = hashlib.blake2b(pci_bus_id.strip().lower().encode() + b"|" + bytes(uuid), digest_size=KEY_SIZE).digest()
    return key if key != UNCLAIMED else b"\1" + key[1:]


class DeviceIds:
    """The devices this process sees, by key: ordinal <-> :func:`device_key`.

    Built from ``source()``, which lists (PCI bus id, UUID) for ordinals
    0, 1, ... of this process, asked once (the list does not change within
    a process: CUDA reads ``CUDA_VISIBLE_DEVICES`` once, at init).
    Thread-safe.
    """

    def __init__(self, source: Callable[[], Sequence[tuple[str, bytes]]]) -> None:
        self._source = source
        self._ids: list[tuple[str, bytes]] | None = None
        self._lock = threading.Lock()

    def _list(self) -> list[tuple[str, bytes]]:
        with self._lock:
            if self._ids is None:
                self._ids = [(pci, device_key(pci, uuid)) for pci, uuid in self._source()]
            return self._ids

    def key_of(self, ordinal: int) -> bytes:
        """The key of this process's device ``ordinal``.

        Raises:
            DeviceError: no such device here.
        """
        ids = self._list()
        if not 0 <= ordinal < len(ids):
            raise DeviceError(f"no CUDA device {ordinal} in this process ({len(ids)} visible: check "
                              f"CUDA_VISIBLE_DEVICES)", None, ordinal)
        return ids[ordinal][1]

    def ordinal_of(self, key: bytes) -> int | None:
        """This process's ordinal of the device named ``key``; None where it does not see that device."""
        for ordinal, (_, k) in enumerate(self._list()):
            if k == key:
                return ordinal
        return None

    def name_of(self, ordinal: int) -> str:
        """The device's PCI bus id (for messages), or ``device <ordinal>``."""
        ids = self._list()
        return f"GPU {ordinal} ({ids[ordinal][0]})" if 0 <= ordinal < len(ids) else f"GPU {ordinal}"


def claim_slot(keys: Sequence[bytes], key: bytes) -> int:
    """The arena slot of the device ``key`` among the slots' recorded ``keys``: the slot already naming
    it, else the first unclaimed one (the caller records ``key`` there, under the ALLOC lock); -1 when
    every slot names another device."""
    for slot, k in enumerate(keys):
        if bytes(k) == key:
            return slot
    for slot, k in enumerate(keys):
        if bytes(k) == UNCLAIMED:
            return slot
    return -1


class Mapping:
    """One arena's device memory as this process addresses it: ``ptr`` on device ``ordinal``.

    Refcounted: every level that uses the arena and every view handed out
    over it holds one reference; the last :meth:`release` closes it
    (``cudaIpcCloseMemHandle``, or ``cudaFree`` for the owner's own
    allocation). Made by a :class:`MappingRegistry`, never directly.

    ``views`` counts the views among the references; ``watchers`` (by
    key) are told when the first view comes (True) and the last one goes
    (False): the GPU level records it in the metadata, so that the arena's
    owner keeps the allocation while any process reads a view of it.
    """

    __slots__ = ("key", "ptr", "ordinal", "refs", "registry", "views", "watchers")

    def __init__(self, registry: MappingRegistry, key: Hashable, ptr: int, ordinal: int) -> None:
        self.registry, self.key, self.ptr, self.ordinal, self.refs = registry, key, ptr, ordinal, 1
        self.views = 0
        self.watchers: dict[Hashable, Callable[[bool], None]] = {}

    def retain(self) -> None:
        """Take one more reference."""
        self.registry.retain(self)

    def release(self) -> None:
        """Let one reference go; never raises (also run by the garbage collector)."""
        self.registry.release(self)

    def watch(self, key: Hashable, watcher: Callable[[bool], None]) -> None:
        """Tell ``watcher`` whether views of this mapping live: now if some do, then at every change."""
        self.registry.watch(self, key, watcher)


class MappingRegistry:
    """Every arena mapping of this process, keyed by (store, arena slot, device key, epoch).

    ``open_handle(handle, ordinal) -> ptr`` and ``close_handle(ptr)`` are
    CUDA's IPC open and close; an owner's allocation brings its own close
    (``free``). Thread-safe, and safe to release from a finalizer: the
    garbage collector may run :meth:`release` inside another call of this
    registry on the same thread; then the release is queued, and the
    holder of the lock carries it out before letting the lock go.
    """

    def __init__(self, open_handle: Callable[[bytes, int], int], close_handle: Callable[[int], None]) -> None:
        self._open, self._close = open_handle, close_handle
        self._maps: dict[Hashable, Mapping] = {}
        self._closers: dict[Hashable, Callable[[int], None]] = {}
        self._lock = threading.Lock()
        self._queued: list[tuple[Mapping, bool]] = []  # (mapping, the reference was a view's)

    def open(self, key: Hashable, handle: bytes, ordinal: int) -> Mapping:
        """The mapping of ``key`` with one more reference: the one this process has, or ``handle`` opened
        on this process's device ``ordinal``.

        Raises:
            whatever ``open_handle`` raises (nothing is registered then).
        """
        with self._lock:
            try:
                m = self._maps.get(key)
                if m is not None:
                    m.refs += 1
                    return m
                m = self._maps[key] = Mapping(self, key, self._open(handle, ordinal), ordinal)
                return m
            finally:
                self._drain_locked()

    def adopt(self, key: Hashable, ptr: int, ordinal: int, free: Callable[[int], None]) -> Mapping:
        """Register this process's own allocation ``ptr`` under ``key`` (one reference); ``free`` is called
        when the last reference goes."""
        with self._lock:
            m = self._maps[key] = Mapping(self, key, ptr, ordinal)
            self._closers[key] = free
            self._drain_locked()
            return m

    def retain(self, m: Mapping, view: bool = False) -> None:
        """One more reference to ``m``; ``view``: it is a view's (the watchers hear of the first)."""
        with self._lock:
            m.refs += 1
            if view:
                m.views += 1
                if m.views == 1:
                    _tell(m, True)
            self._drain_locked()

    def release(self, m: Mapping, view: bool = False) -> None:
        # atomic: a finalizer run inside a locked section of this thread lands here
        self._queued.append((m, view))
        if self._lock.acquire(blocking=False):
            try:
                self._drain_locked()
            finally:
                self._lock.release()

    def watch(self, m: Mapping, key: Hashable, watcher: Callable[[bool], None]) -> None:
        with self._lock:
            if key not in m.watchers:
                m.watchers[key] = watcher
                if m.views:
                    _tell(m, True, watcher)
            self._drain_locked()

    def _drain_locked(self) -> None:
        while self._queued:
            m, view = self._queued.pop()
            if view:
                m.views -= 1
                if m.views == 0:
                    _tell(m, False)
            m.refs -= 1
            if m.refs == 0:
                self._forget_locked(m)

    def _forget_locked(self, m: Mapping) -> None:
        if self._maps.get(m.key) is m:
            del self._maps[m.key]
        close = self._closers.pop(m.key, self._close)
        try:
            close(m.ptr)
        # a dead context, interpreter exit: the driver unmaps at process exit anyway
        except Exception:
            pass

    def live(self) -> dict[Hashable, int]:
        """Key -> references of every open mapping (for checks and tests)."""
        with self._lock:
            self._drain_locked()
            return {k: m.refs for k, m in self._maps.items()}


class ViewOwner:
    """The memory owner of a device array the GPU level hands out (``cupy.cuda.UnownedMemory(owner=)``):
    holds the stored object's pin and the arena's mapping as long as the array (or any view of it) lives."""

    __slots__ = ("__weakref__",)


def view_owner(token: Any, mapping: Mapping, settle: Callable[[int], None]) -> ViewOwner:
    """An owner for a view over ``mapping`` whose pin is held by ``token`` (``kernel.views.pin_token``).

    The rule, when the view is collected: first ``settle(ordinal)`` (the
    GPU level passes a synchronise of the device's current stream, where
    the view's last use was queued, and none while that stream captures a
    graph: ``device.settle``), then the mapping reference goes, then the
    pin. A pin dropped at host time while a kernel still reads the view
    would let a delete hand its space to another process's put while the
    kernel reads it; after the synchronise nothing queued there touches it.
    """
    owner = ViewOwner()
    mapping.registry.retain(mapping, view=True)
    weakref.finalize(owner, _let_go, settle, mapping, [token])
    return owner


def _tell(m: Mapping, held: bool, only: Callable[[bool], None] | None = None) -> None:
    """Tell ``m``'s watchers (or ``only`` that one) whether views of it live; never raises."""
    for watcher in [only] if only is not None else list(m.watchers.values()):
        try:
            watcher(held)
        except Exception:  # a store closed meanwhile: nothing left to record in
            pass


# run by the garbage collector anywhere: a Ctrl-C deferred inside it waits for the code it interrupted
@finalizer
def _let_go(settle: Callable[[int], None], mapping: Mapping, token: list[Any]) -> None:
    try:
        settle(mapping.ordinal)
    except Exception:  # a dead context runs nothing any more: releasing is safe
        pass
    mapping.registry.release(mapping, view=True)
    token.clear()  # the pin goes last (its own finalizer unpins)
