"""shmstore: a shared-memory object store for HPC jobs.

Processes on a node share objects through POSIX shared memory without copies
and without a server in the request path; a per-node spill process keeps
memory in check and cleans up after crashes; ``shmstore.mpi`` moves objects
between nodes over MPI.
"""
from .errors import (
    CheckpointError,
    ConfigError,
    ConfigWarning,
    DeviceError,
    GetTimeoutError,
    InvalidArgumentError,
    InvalidKeyError,
    LayoutError,
    LockTimeoutError,
    ObjectExistsError,
    ObjectLockedError,
    ObjectNotFoundError,
    PermissionDeniedError,
    SerializationError,
    ShmStoreError,
    ShmStoreWarning,
    SpillError,
    StorageFullError,
    StoreClosedError,
    StoreInUseError,
    StoreNotFoundError,
    TransferError,
)
from .levels import Capacity, Level, ObjectInfo
from .mapping import StoreMapping
from .node.views import SharedArray
from .refs import Ref
from .store import Store, connect, destroy
from .stores import collect_stale
from .streams import Reader, Writer

__version__ = "0.1.0"

__all__ = [
    "connect", "destroy", "collect_stale", "Store", "SharedArray", "Level", "ObjectInfo", "Capacity", "Reader",
    "Writer", "StoreMapping", "Ref",
    "ShmStoreError", "ObjectNotFoundError", "ObjectExistsError", "ObjectLockedError", "StorageFullError",
    "LockTimeoutError", "LayoutError", "StoreClosedError", "StoreNotFoundError",
    "StoreInUseError", "SpillError", "TransferError", "GetTimeoutError", "CheckpointError", "DeviceError",
    "InvalidArgumentError", "InvalidKeyError", "SerializationError", "ConfigError", "PermissionDeniedError",
    "ShmStoreWarning", "ConfigWarning",
    "__version__",
]
