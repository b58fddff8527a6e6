"""The persistent folder (``persist_dir``): checkpoints that outlive the job, in files any later job can read.

One folder per checkpoint, named ``<name>@<id>`` (the id tells two jobs
checkpointing under one name apart: never mixed)::

    <persist_dir>/<name>@<id>/part-00003.bin    node 3's objects, back to back, each 4 KiB aligned
    <persist_dir>/<name>@<id>/part-00003.json   their index: key -> offset, stored size, kind, crc32, ...
    <persist_dir>/<name>@<id>/part-00003.error  why node 3's part could not be written (it never completes)
    <persist_dir>/<name>@<id>/MANIFEST.json     written last: the checkpoint is complete when it exists

Every file is written under a temporary name (``.tmp-<pid>``), flushed to
disk (``fsync``) and renamed when whole, so a reader never sees a part half
written, and a checkpoint whose writer died is never complete: the
previous complete one is what :func:`latest` returns. The manifest is
written by whichever part's writer finds every part in place (several may:
the same content, renamed atomically).

An object's record is its stored form (``node/serialize.py``): an ndarray's
bytes, raw bytes, or a pickle with out-of-band blobs, so a reader maps the
file and rebuilds the value on the mapped bytes (zero-copy, paged in lazily)
after checking the record's crc32.
"""
from __future__ import annotations

import json
import mmap
import os
import queue
import shutil
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import numpy as np

from ..errors import CheckpointError, StorageFullError
from ..meta import layout as L
from ..node import serialize
from ..primitives import native
from ..units import format_size

__all__ = ["Manifest", "checkpoint_dir", "write_part", "try_complete", "complete", "latest", "prune",
           "read_object", "part_name", "write_error", "errors", "manifest_at", "pruned", "FORMAT"]

FORMAT = 1
ALIGN = 4096
_POPULATE_MIN = 1 << 16
CHUNK = 16 << 20  # bytes per piece of a large object
BATCH = 8 << 20  # bytes per hand-over to the checksum thread: small objects go many at once
MANIFEST = "MANIFEST.json"
PRUNED = "PRUNED"


def part_name(part: int) -> str:
    return f"part-{part:05d}"


def checkpoint_dir(persist_dir: str, name: str, cid: str) -> str:
    return os.path.join(persist_dir, f"{name}@{cid}")


class Manifest:
    """A complete checkpoint as its manifest says: its name, id, folder, keys and the part of each."""

    def __init__(self, path: str, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data
        self.name: str = data["name"]
        self.id: str = data["id"]
        self.created: float = data["created"]
        self.completed: float = data["completed"]
        self.parts: int = data["parts"]
        self.keys: dict[str, int] = data["keys"]
        self.partners: dict[int, int] = {int(k): v for k, v in data.get("partners", {}).items()}
        self.nbytes: int = data.get("bytes", 0)
        self._index: dict[int, dict[str, Any]] = {}
        self.files = _Files()  # the part files, mapped as they are read (the values keep their maps)

    def index(self, part: int) -> dict[str, Any]:
        """The index of ``part`` (read once)."""
        got = self._index.get(part)
        if got is None:
            with open(os.path.join(self.path, part_name(part) + ".json")) as f:
                got = self._index[part] = json.load(f)["objects"]
        return got

    def __repr__(self) -> str:
        return f"<checkpoint {self.name!r} id {self.id} in {self.path}: {len(self.keys)} key(s)>"


# ---- writing ----------------------------------------------------------------------------------------------
def _json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(data))  # json.dump writes piece by piece: 75 ms for a 1,000-object index, 12 like this
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Crc:
    """The crc32 of each record, computed in a thread beside the writes (zlib releases the GIL): a part is
    written at the folder's speed, not at that plus the checksum's."""

    def __init__(self) -> None:
        self._q: queue.Queue[Any] = queue.Queue(maxsize=4)
        self.crcs: list[int] = []
        self._t = threading.Thread(target=self._run, name="shmstore-crc", daemon=True)
        self._t.start()

    def _run(self) -> None:
        crc = 0
        while True:
            batch = self._q.get()
            if batch is None:
                return
            for item in batch:
                if item is _END:
                    self.crcs.append(crc)
                    crc = 0
                else:
                    crc = zlib.crc32(item, crc)

    def add(self, batch: list[Any]) -> None:
        """Chunks to checksum in order, ``_END`` after each record's last."""
        self._q.put(batch)

    def close(self) -> list[int]:
        self._q.put(None)
        self._t.join()
        return self.crcs


_END = object()
_ZEROS = bytes(ALIGN)


def _write_all(fd: int, bufs: list[Any]) -> None:
    """Write every buffer of ``bufs`` in order, one ``write`` each (``writev`` of the same buffers ran at a
    third to a sixth of the speed into ext4's page cache here: 256 MiB in 300-800 ms against 135-150)."""
    for b in bufs:
        mv = memoryview(b).cast("B")
        while mv:
            n = os.write(fd, mv)
            mv = mv[n:]


def _pieces(enc: serialize.Encoded) -> list[tuple[int, Any]]:
    """``serialize.parts`` of ``enc``; an ndarray's bytes as uint8 (a buffer of datetime64 values, say, cannot be
    exported as a memoryview)."""
    if enc.kind != L.KIND_NDARRAY or enc.device or not enc.size:
        return serialize.parts(enc)
    order = enc.array[2]  # type: ignore[index]
    src = np.asarray(enc.src)
    if not (src.flags.c_contiguous if order == "C" else src.flags.f_contiguous):
        src = np.array(src, order=order)
    return [(0, src.ravel(order="K").view(np.uint8))]


def _record_pieces(enc: serialize.Encoded) -> Iterator[Any]:
    """The stored bytes of ``enc``, in order, gaps as zeros, in chunks of at most ``CHUNK``."""
    pos = 0
    for off, piece in _pieces(enc):
        if off > pos:
            yield memoryview(bytes(off - pos))
        mv = memoryview(piece).cast("B")
        if len(mv) >= _POPULATE_MIN:
            # map its pages in one call (shared memory this process has not read yet: a fault per 64 KiB
            # otherwise, in both the writing and the checksumming thread; 256 MiB of a store read by a fresh
            # process: 392 ms to write, 237 ms once mapped)
            addr = np.frombuffer(mv, np.uint8).ctypes.data
            native.populate_read(addr & ~4095, (addr & 4095) + len(mv))
        for i in range(0, len(mv), CHUNK):
            yield mv[i: i + CHUNK]
        pos = off + len(mv)
    if enc.size > pos:
        yield memoryview(bytes(enc.size - pos))


def _meta(enc: serialize.Encoded) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": enc.kind, "size": enc.size, "nbytes": enc.nbytes}
    if enc.kind == L.KIND_NDARRAY:
        dtype, shape, order = enc.array  # type: ignore[misc]
        out["array"] = [np.dtype(dtype).str, list(shape), order]
    return out


def write_part(path: str, part: int, items: Iterable[tuple[str, Any]],
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Write the objects of ``items`` (key, value) as part ``part`` of the checkpoint folder ``path``; returns
    the part's index as written. ``progress(bytes written so far)`` is called as it goes.

    Raises:
        StorageFullError: the folder's file system is full (the part is removed; earlier checkpoints are
            untouched). CheckpointError: another write error.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    for stale in os.listdir(path):  # what a writer of this part killed before us left (one node writes a part)
        if stale.startswith(part_name(part) + ".") and ".tmp-" in stale:
            _remove(os.path.join(path, stale))
    final = os.path.join(path, part_name(part) + ".bin")
    tmp = f"{final}.tmp-{os.getpid()}"
    objects: dict[str, Any] = {}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    crc = _Crc()
    pos = written = 0
    out: list[Any] = []  # what the next batch writes; the same chunks, less the padding, to the checksum thread
    sums: list[Any] = []

    def write_out() -> None:
        crc.add(list(sums))
        _write_all(fd, out)
        out.clear()
        sums.clear()
        if progress is not None:
            progress(pos)

    try:
        for key, value in items:
            enc = serialize.encode(value)
            objects[key] = dict(_meta(enc), offset=pos)
            for chunk in _record_pieces(enc):
                out.append(chunk)
                sums.append(chunk)
                pos += len(chunk)
                if pos - written >= BATCH:
                    written = pos
                    write_out()
            sums.append(_END)
            pad = -pos % ALIGN
            if pad:
                out.append(_ZEROS[:pad])
                pos += pad
        write_out()
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        fd = -1
        crc.close()
        _remove(tmp)
        raise _write_error(exc, path, part, pos) from exc
    finally:
        if fd >= 0:
            os.close(fd)
    for meta, value in zip(objects.values(), crc.close()):
        meta["crc"] = value
    os.replace(tmp, final)
    index = {"format": FORMAT, "part": part, "bytes": pos, "objects": objects}
    _json_atomic(os.path.join(path, part_name(part) + ".json"), index)
    _sync_dir(path)
    return index


def _write_error(exc: OSError, path: str, part: int, done: int) -> Exception:
    import errno
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(f"the checkpoint folder {path} is full: part {part} stopped after "
                                f"{format_size(done)} ({exc.strerror}); the part was removed and earlier "
                                f"checkpoints are intact (free space there, lower checkpoint_keep, or point "
                                f"persist_dir= / SHMSTORE_PERSIST_DIR elsewhere)")
    return CheckpointError(f"cannot write part {part} of checkpoint folder {path}: {exc}")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def try_complete(path: str, skeleton: dict[str, Any]) -> Manifest | None:
    """Write the manifest of the checkpoint in ``path`` if every part of it is in place; returns it (also when
    it was there already), None while a part is missing."""
    done = manifest_at(path)
    if done is not None:
        return done
    total = 0
    for part in range(skeleton["parts"]):
        try:
            with open(os.path.join(path, part_name(part) + ".json")) as f:
                total += json.load(f)["bytes"]
        except (OSError, ValueError, KeyError):
            return None
    data = dict(skeleton, format=FORMAT, completed=time.time(), bytes=total)
    _json_atomic(os.path.join(path, MANIFEST), data)
    _sync_dir(path)
    return Manifest(path, data)


def write_error(path: str, part: int, message: str) -> None:
    """Record why ``part`` failed, where every rank waiting on the checkpoint sees it."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        with open(os.path.join(path, part_name(part) + ".error"), "w") as f:
            f.write(message)
    except OSError:
        pass


def errors(path: str) -> list[str]:
    """The recorded failures of the checkpoint in ``path``."""
    out = []
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(".error"))
    except OSError:
        return []
    for n in names:
        try:
            with open(os.path.join(path, n)) as f:
                out.append(f.read())
        except OSError:
            pass
    return out


# ---- reading ----------------------------------------------------------------------------------------------
def manifest_at(path: str) -> Manifest | None:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            data = json.load(f)
        if data.get("format") != FORMAT:
            return None
        return Manifest(path, data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete(persist_dir: str, name: str | None = None) -> list[Manifest]:
    """The complete checkpoints in ``persist_dir`` (of ``name`` only, if given), oldest first."""
    try:
        entries = os.listdir(persist_dir)
    except OSError:
        return []
    found = []
    for entry in entries:
        if "@" not in entry or (name is not None and entry.rsplit("@", 1)[0] != name):
            continue
        m = manifest_at(os.path.join(persist_dir, entry))
        if m is not None:
            found.append(m)
    return sorted(found, key=lambda m: (m.completed, m.created))


def latest(persist_dir: str, name: str | None = None) -> Manifest | None:
    found = complete(persist_dir, name)
    return found[-1] if found else None


def prune(persist_dir: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` complete checkpoints (the manifest first, so a removal cut short
    leaves an incomplete folder, never a complete one with files missing), and folders of checkpoints that
    never completed and started before the oldest one kept; returns the ids removed. Each removal is noted
    in ``<persist_dir>/PRUNED`` (``id complete`` or ``id abandoned``), which :func:`pruned` reads: a
    checkpoint waited for after a newer one replaced it says how it ended."""
    found = complete(persist_dir)
    if len(found) <= keep:
        return []
    kept = found[-keep:]
    since = min(m.created for m in kept)
    removed: list[tuple[str, str]] = []
    for m in found[:-keep]:
        _remove(os.path.join(m.path, MANIFEST))
        removed.append((m.id, "complete"))
        shutil.rmtree(m.path, ignore_errors=True)
    kept_paths = {m.path for m in kept}
    for entry in os.listdir(persist_dir):
        path = os.path.join(persist_dir, entry)
        if "@" in entry and path not in kept_paths and not os.path.exists(os.path.join(path, MANIFEST)):
            try:
                old = os.stat(path).st_mtime < since
            except OSError:
                continue
            if old:
                removed.append((entry.rsplit("@", 1)[1], "abandoned"))
                shutil.rmtree(path, ignore_errors=True)
    if removed:
        with open(os.path.join(persist_dir, PRUNED), "a") as f:
            f.write("".join(f"{cid} {how}\n" for cid, how in removed))
    return [cid for cid, _ in removed]


def pruned(persist_dir: str, cid: str) -> str | None:
    """How checkpoint ``cid`` left the folder (``complete``: it completed and newer ones replaced it;
    ``abandoned``: it never completed), or None if it was not pruned."""
    try:
        with open(os.path.join(persist_dir, PRUNED)) as f:
            for line in f:
                got, _, how = line.strip().partition(" ")
                if got == cid:
                    return how
    except OSError:
        pass
    return None


class _Files:
    """Read-only maps of the part files of one checkpoint (each opened once)."""

    def __init__(self) -> None:
        self._maps: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> Any:
        with self._lock:
            mm = self._maps.get(path)
            if mm is None:
                with open(path, "rb") as f:
                    empty = os.fstat(f.fileno()).st_size == 0  # (mmap refuses an empty file)
                    mm = self._maps[path] = b"" if empty else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return mm


def read_object(m: Manifest, key: str) -> Any:
    """The value of ``key`` from the folder: rebuilt on the mapped file (zero-copy) after its crc32 matched.

    Raises:
        CheckpointError: the file is missing, short, or its bytes do not match their checksum.
    """
    part = m.keys[key]
    where = os.path.join(m.path, part_name(part) + ".bin")
    try:
        meta = m.index(part)[key]
        mm = m.files.get(where)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{where}: cannot read {key!r}: {exc}", m.name, key) from None
    off, size = meta["offset"], meta["size"]
    if off + size > len(mm):
        raise CheckpointError(f"{where} is truncated: {key!r} needs bytes {off}..{off + size}, the file has "
                              f"{len(mm)}", m.name, key)
    base = np.frombuffer(mm, np.uint8, size, off)
    if zlib.crc32(base.data) != meta["crc"]:
        raise CheckpointError(f"{where}: {key!r} ({format_size(size)}) does not match its checksum (the file "
                              f"was damaged after it was written)", m.name, key)
    kind = meta["kind"]
    if kind == L.KIND_NDARRAY:
        dtype, shape, order = meta["array"]
        return np.ndarray(tuple(shape), np.dtype(dtype), base.data, 0, None, order)
    return serialize.decode(kind, base, meta["nbytes"])
