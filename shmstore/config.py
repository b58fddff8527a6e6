"""Configuration: keyword argument, then ``SHMSTORE_<NAME>``, then default.

One frozen :class:`Config` per connection. Unknown keywords raise
``TypeError``; a bad value raises :class:`~shmstore.errors.ConfigError` naming
the keyword or the environment variable it came from. There are no config
files.
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import tempfile
from typing import Any, Callable

from .errors import ConfigError
from .units import parse_size

__all__ = ["Config", "SHM_DIR", "env", "explicit_settings",
           "pure_python", "stream_count", "node_label", "default_node", "service_spin",
           "cuda_aware_override", "mpich_vcis", "no_gpu", "doorbell", "partner_hop"]

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _default_name() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    return f"job-{job}" if job else "default"


def _default_capacity() -> int:
    """40% of the node's /dev/shm: room for the job's own buffers besides the store."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 1 << 30
    return max(64 << 20, int(st.f_blocks * st.f_frsize * 0.4)) & ~4095


def _default_spill_dir() -> str:
    for var in ("SLURM_TMPDIR", "TMPDIR"):
        if os.environ.get(var):
            return os.environ[var]
    return tempfile.gettempdir()


def _default_persist_dir() -> str:
    """Where checkpoints outlive the job: ``$SCRATCH/shmstore-checkpoints`` (the parallel file system's scratch on
    most clusters), else ``shmstore-checkpoints`` in the working directory (where the job was started: usually
    on a shared file system too)."""
    scratch = os.environ.get("SCRATCH")
    return os.path.join(scratch if scratch else os.getcwd(), "shmstore-checkpoints")


def _parse_dir(text: Any) -> str:
    value = str(text).strip()
    if not value:
        raise ValueError("expected a folder")
    return os.path.abspath(os.path.expanduser(value))


def default_node() -> str:
    """The node's name as the launcher knows it: ``PMI_HOSTNAME`` (MPICH's hydra), else ``SLURMD_NODENAME``
    (Slurm's name for the node, also in prologs and epilogs), else the host name; the same order
    ``shmstore.mpi`` names nodes in, so a plain ``connect()``, a Cluster and the CLI find one store."""
    raw = os.environ.get("PMI_HOSTNAME") or os.environ.get("SLURMD_NODENAME") \
        or socket.gethostname().split(".")[0] or "localhost"
    return "".join(c if c.isalnum() or c in "_.-" else "-" for c in raw)[:48] or "node"


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r} (use 1/0, true/false, yes/no, on/off)")


def _parse_fraction(text: Any) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"must be in (0, 1], got {text!r}")
    return value


def _parse_positive_float(text: Any) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError(f"must be positive, got {text!r}")
    return value


def _parse_count(text: Any) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {text!r}")
    return value


def _parse_ident(text: Any) -> str:
    value = str(text)
    if not _NAME_RE.match(value):
        raise ValueError(f"{value!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")
    return value


def _parse_session(text: Any) -> str:
    value = str(text)
    if value and not _NAME_RE.match(value):
        raise ValueError(f"{value!r} must be empty or 1-64 characters of A-Z a-z 0-9 _ . -")
    return value


def _parse_optional_size(text: Any) -> int | None:
    return None if text in (None, "", "auto") else parse_size(text)


# field name -> (parser, default factory)
_FIELDS: dict[str, tuple[Callable[[Any], Any], Callable[[], Any]]] = {
    "name": (_parse_ident, _default_name),
    "capacity": (parse_size, _default_capacity),
    "spill_dir": (str, _default_spill_dir),
    "node": (_parse_ident, default_node),
    "session": (_parse_session, lambda: ""),
    "persist": (lambda v: v if isinstance(v, bool) else _parse_bool(str(v)), lambda: False),
    "high_watermark": (_parse_fraction, lambda: 0.9),
    "low_watermark": (_parse_fraction, lambda: 0.75),
    "lock_timeout": (_parse_positive_float, lambda: 10.0),
    "spill_timeout": (_parse_positive_float, lambda: 60.0),
    "peer_timeout": (_parse_positive_float, lambda: 60.0),  # shmstore.mpi: the longest wait on another rank
    "max_objects": (_parse_count, lambda: 0),  # 0: derived from capacity (see objects_for)
    "max_clients": (_parse_count, lambda: 320),  # a 256-rank node and its tools
    "prefault": (parse_size, lambda: 1 << 30),
    "disk_capacity": (_parse_optional_size, lambda: None),
    "gpu_capacity": (_parse_optional_size, lambda: None),
    # checkpoints (shmstore.checkpoint): the folder that outlives jobs, and how many complete ones it keeps
    "persist_dir": (_parse_dir, _default_persist_dir),
    "checkpoint_keep": (_parse_count, lambda: 2),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of one connection to a node store (immutable).

    ``capacity``, ``max_objects`` and ``max_clients`` only matter to the
    process that creates the store; attachers read them from the store.
    ``peer_timeout`` only matters to ``shmstore.mpi``: the longest a rank
    waits on another rank (a reply, a transfer's next frame) before it
    raises ``TransferError`` naming that rank.
    """

    name: str
    capacity: int
    spill_dir: str
    node: str
    session: str
    persist: bool
    high_watermark: float
    low_watermark: float
    lock_timeout: float
    spill_timeout: float
    peer_timeout: float
    max_objects: int
    max_clients: int
    prefault: int
    disk_capacity: int | None
    gpu_capacity: int | None
    persist_dir: str
    checkpoint_keep: int

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> Config:
        """Build a Config: keyword, then ``SHMSTORE_<NAME>``, then default.

        Raises:
            TypeError: an unknown keyword.
            ConfigError: a value that does not parse, naming its source.
        """
        unknown = set(kwargs) - set(_FIELDS)
        if unknown:
            raise TypeError(f"unknown shmstore setting(s): {', '.join(sorted(unknown))}")
        values = {name: _resolve(name, kwargs.get(name)) for name in _FIELDS}
        if values["low_watermark"] >= values["high_watermark"]:
            raise ConfigError(
                f"low_watermark ({values['low_watermark']}) must be below high_watermark "
                f"({values['high_watermark']}) (set SHMSTORE_LOW_WATERMARK / SHMSTORE_HIGH_WATERMARK)"
            )
        if values["capacity"] < 1 << 20:
            raise ConfigError(f"capacity must be at least 1 MiB, got {values['capacity']} B "
                              f"(capacity= / SHMSTORE_CAPACITY)")
        if not values["max_objects"]:
            values["max_objects"] = objects_for(values["capacity"])
        return cls(**values)


def explicit_settings(kwargs: dict[str, Any]) -> frozenset[str]:
    """The settings a caller asked for rather than left to their defaults: those passed as keywords (not None)
    and those whose ``SHMSTORE_<NAME>`` variable is set (non-empty)."""
    given = {name for name, value in kwargs.items() if value is not None and name in _FIELDS}
    return frozenset(given | {name for name in _FIELDS if os.environ.get("SHMSTORE_" + name.upper(), "").strip()})


OBJECTS_MIN, OBJECTS_MAX = 65536, 1 << 22


def objects_for(capacity: int) -> int:
    """The default ``max_objects`` of a store of ``capacity`` bytes: one entry per 16 KiB of memory, at least
    65,536 and at most 4,194,304. The entry table is touched only as entries are handed out, so a large
    default costs no memory until a job puts that many objects."""
    return max(OBJECTS_MIN, min(OBJECTS_MAX, capacity // (16 << 10)))


def env(name: str, parser: Callable[[str], Any], default: Any = None) -> Any:
    """``SHMSTORE_<NAME>`` parsed, or ``default`` when unset (or empty).

    The one reader of shmstore's environment variables: settings of a store
    go through :class:`Config`, process-wide switches through the helpers
    below; all of them through here.

    Raises:
        ConfigError: the value does not parse, naming the variable.
    """
    var = "SHMSTORE_" + name.upper()
    raw = os.environ.get(var, "")
    if not raw.strip():
        return default
    try:
        return parser(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad value for {var}: {exc}") from None


def pure_python() -> bool:
    """``SHMSTORE_PURE_PYTHON``: run without the optional C helpers (the kernel's fast path, the copier)."""
    return bool(env("PURE_PYTHON", _parse_bool, False))


def doorbell() -> bool:
    """``SHMSTORE_DOORBELL``: an idle MPI node service sleeps in the kernel and a request after silence rings it
    awake (``shmstore.mpi.doorbell``; default on); ``0``: it probes MPI at its idle pace instead."""
    return bool(env("DOORBELL", _parse_bool, True))


def partner_hop() -> bool:
    """``SHMSTORE_PARTNER_HOP``: a thread spinning for a message from a thread of this machine (a get's reply from
    the holder's service, a service's next request from its asker) moves itself to an idle CPU where that thread
    waits to run on its own (``shmstore.mpi.poll``; default on); ``0``: it naps 20 us there instead."""
    return bool(env("PARTNER_HOP", _parse_bool, True))


def no_gpu() -> bool:
    """``SHMSTORE_NO_GPU``: keep the GPU level unavailable even where CuPy and a device are (``=0`` does not)."""
    return bool(env("NO_GPU", _parse_bool, False))


def _parse_streams(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 2:
        raise ValueError(f"must be 1 or 2, got {text!r}")
    return value


def stream_count() -> int | None:
    """``SHMSTORE_STREAMS``: bulk streams per cluster transfer (1 or 2), None when unset."""
    value: int | None = env("STREAMS", _parse_streams)
    return value


def log_level() -> int:
    """``SHMSTORE_LOG``: how much the spill process logs (``warning`` by default: problems only;
    ``info`` adds every client reclaimed and store removed; ``debug``)."""
    import logging
    names = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

    def parse(text: str) -> int:
        if text.strip().lower() not in names:
            raise ValueError(f"must be one of {', '.join(names)}, got {text!r}")
        return names[text.strip().lower()]

    value: int = env("LOG", parse, logging.WARNING)
    return value


def log_file() -> str | None:
    """``SHMSTORE_LOG_FILE``: the file spill processes append their log to (``stderr``: the creating process's
    stderr, whatever it is); None when unset (see :func:`shmstore.primitives.procs.spill_output`)."""
    value: str | None = env("LOG_FILE", str)
    return value


def node_label() -> str | None:
    """``SHMSTORE_NODE``: the node id this process claims, None when unset."""
    value: str | None = env("NODE", _parse_ident)
    return value


def _parse_spin_us(text: str) -> float:
    us = float(text)
    if not 0 <= us <= 1e6:
        raise ValueError(f"must be microseconds in 0..1000000, got {text!r}")
    return us


def service_spin() -> float | None:
    """``SHMSTORE_SERVICE_SPIN_US``: seconds an MPI node service probes back to back after a request (given
    in microseconds, 0..1000000), None when unset (``shmstore.mpi.poll.spin_window`` decides)."""
    us: float | None = env("SERVICE_SPIN_US", _parse_spin_us)
    return None if us is None else us * 1e-6


def service_idle() -> float | None:
    """``SHMSTORE_SERVICE_IDLE_US``: seconds between an idle MPI node service's probes (given in microseconds,
    0..1000000: the longest a request after a pause waits to be noticed), None when unset
    (``shmstore.mpi.poll.idle_nap`` decides)."""
    us: float | None = env("SERVICE_IDLE_US", _parse_spin_us)
    return None if us is None else max(us, 1.0) * 1e-6


def _parse_auto_bool(text: str) -> bool | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return _parse_bool(text)
    except ValueError:
        raise ValueError(f"expected 1, 0 or auto, got {text!r}") from None


def cuda_aware_override() -> bool | None:
    """``SHMSTORE_CUDA_AWARE``: True or False where set (1/0, true/false, yes/no, on/off), None when unset or
    ``auto`` (ask the MPI library: ``shmstore.mpi.cuda``)."""
    value: bool | None = env("CUDA_AWARE", _parse_auto_bool)
    return value


def mpich_vcis() -> int:
    """``MPIR_CVAR_CH4_NUM_VCIS``, MPICH's own setting (its virtual communication interfaces; 1 when unset or
    not a number): ``shmstore.mpi`` uses two bulk streams where it is above 1."""
    try:
        return int(os.environ.get("MPIR_CVAR_CH4_NUM_VCIS", "1"))
    except ValueError:
        return 1


_UNSET: Any = object()


def _resolve(name: str, value: Any) -> Any:
    """A setting: ``value`` (a keyword argument) parsed, else ``SHMSTORE_<NAME>`` (through :func:`env`), else
    its default."""
    parser, default = _FIELDS[name]
    if value is None:
        value = env(name, parser, _UNSET)
        return default() if value is _UNSET else value
    try:
        return parser(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad value for {name}=: {exc}") from None
