"""Exceptions raised by shmstore.

Everything raised on purpose derives from :class:`ShmStoreError`. Where a
standard exception fits, ours also derives from it (``ObjectNotFoundError`` is
a ``KeyError``, as is ``InvalidKeyError``; ``LockTimeoutError`` a ``TimeoutError``),
so ``except KeyError`` keeps working. Messages are lowercase, name the object with ``!r``, give sizes
in human units and, for limits, end with the setting to change in parentheses.
"""
from __future__ import annotations

__all__ = [
    "ShmStoreError",
    "ObjectNotFoundError",
    "ObjectExistsError",
    "ObjectLockedError",
    "StorageFullError",
    "LockTimeoutError",
    "LayoutError",
    "StoreClosedError",
    "StoreNotFoundError",
    "StoreInUseError",
    "SpillError",
    "TransferError",
    "GetTimeoutError",
    "CheckpointError",
    "DeviceError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "SerializationError",
    "ConfigError",
    "PermissionDeniedError",
    "ShmStoreWarning",
    "ConfigWarning",
]


class ShmStoreError(Exception):
    """Root of every exception shmstore raises on purpose."""


class ObjectNotFoundError(ShmStoreError, KeyError):
    """No sealed object has this key (in this session)."""

    def __init__(self, message: str, object_id: str | None = None) -> None:
        super().__init__(message)
        self.object_id = object_id

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StoreNotFoundError(ShmStoreError, FileNotFoundError):
    """``connect(create=False)`` found no store of that name on this node."""


class ObjectExistsError(ShmStoreError):
    """A put or writer names a key that is already present."""

    def __init__(self, message: str, object_id: str | None = None) -> None:
        super().__init__(message)
        self.object_id = object_id


class ObjectLockedError(ShmStoreError):
    """The object is pinned, being written, or being moved."""

    def __init__(self, message: str, object_id: str | None = None) -> None:
        super().__init__(message)
        self.object_id = object_id


class StorageFullError(ShmStoreError):
    """A level has no room; says what was asked, what is free, what to raise."""

    def __init__(
        self,
        message: str,
        object_id: str | None = None,
        level: object = None,
        requested: int | None = None,
        available: int | None = None,
    ) -> None:
        super().__init__(message)
        self.object_id = object_id
        self.level = level
        self.requested = requested
        self.available = available


class LockTimeoutError(ShmStoreError, TimeoutError):
    """A store lock was not acquired in time (``lock_timeout``)."""


class LayoutError(ShmStoreError):
    """A segment of another layout version, or not a shmstore segment."""


class StoreClosedError(ShmStoreError):
    """The store (or reader/writer) was used after ``close()``."""


class StoreInUseError(ShmStoreError):
    """``destroy`` refused: live clients are attached (pass ``force=True``)."""


class SpillError(ShmStoreError):
    """Moving an object between levels failed; the object stayed where it was."""

    def __init__(self, message: str, object_id: str | None = None) -> None:
        super().__init__(message)
        self.object_id = object_id


class TransferError(ShmStoreError):
    """A transfer between nodes failed; nothing partial is left behind."""

    def __init__(self, message: str, object_id: str | None = None, peer: int | None = None) -> None:
        super().__init__(message)
        self.object_id = object_id
        self.peer = peer


class GetTimeoutError(TransferError, TimeoutError):
    """A get given ``timeout=`` (``ref.get``, ``Cluster.get``) did not finish in time: the transfer under way was
    given up (nothing partial is left; another rank of the node waiting for it takes it over) and the call may be
    made again. Ray's ``GetTimeoutError``."""


class CheckpointError(ShmStoreError):
    """A checkpoint could not be written or restored: names the checkpoint, the key, and every place tried."""

    def __init__(self, message: str, name: str | None = None, object_id: str | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.object_id = object_id


class DeviceError(ShmStoreError, RuntimeError):
    """A GPU operation failed: CuPy is missing, CUDA refused (the error it gave is chained), or the device
    cannot serve a shared arena (an exclusive compute mode, CUDA used before ``fork()``).

    A ``RuntimeError``, as CuPy's own CUDA errors are. The message names the
    device, the object (if any) and what to do; ``device`` is the CUDA
    ordinal in this process (None where unknown).
    """

    def __init__(self, message: str, object_id: str | None = None, device: int | None = None) -> None:
        super().__init__(message)
        self.object_id = object_id
        self.device = device


class InvalidArgumentError(ShmStoreError, ValueError):
    """An argument is out of range (negative size, bad level, ...)."""


class InvalidKeyError(InvalidArgumentError, KeyError):
    """A key is not a non-empty ``str`` of at most 255 UTF-8 bytes.

    Also a ``KeyError``: no object can have such a key, so a lookup answers it as it answers a missing one
    (``store.mapping().get(("t", 1))`` is None, ``.pop(k, None)`` the default, as with a dict); and a
    ``ValueError``, as every ``InvalidArgumentError``.
    """

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SerializationError(ShmStoreError, TypeError):
    """The value cannot be pickled (or unpickled)."""


class ConfigError(ShmStoreError, ValueError):
    """A configuration value (keyword or ``SHMSTORE_*`` variable) is invalid."""


class PermissionDeniedError(ShmStoreError, PermissionError):
    """A segment, semaphore or spill directory of the store's name is not this user's to use.

    Another user created it first (by accident, or to squat on the name),
    or it is a symbolic link. The message names the object and what to do.
    """


class ShmStoreWarning(UserWarning):
    """Root of every warning shmstore issues."""


class ConfigWarning(ShmStoreWarning):
    """``connect()`` asked an existing store for creation-time settings it does not have (they were ignored:
    the store keeps those it was created with); ``connect(..., strict=True)`` raises :class:`ConfigError`
    instead."""
