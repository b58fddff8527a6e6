"""Flush plans: what a checkpoint asks of its node's spill process, in small files on the node's own disk.

A checkpoint's objects are put into the node's store under hidden keys
(:func:`hidden`: ``"\\x00ckpt/<id>/<key>"``, left out of ``keys()``,
``len()`` and ``clear()``); then one plan per node names them, the folder
and the part to write. The plan lives beside the store's spill files
(``<spill dir>.checkpoints/<id>-<part>.plan``), so it survives the
processes of the job: a spill process killed in the middle of a flush is
restarted by the next client that needs it and starts the part again.

States, each a file name (renamed, never rewritten): ``.plan`` (to flush),
``.flushed`` (the part is in the folder; waiting for the manifest to prune
older checkpoints), ``.failed`` (the error, for ``shmstore status``); the
plan is removed once the checkpoint is complete or given up. Progress
(``.progress``: bytes flushed and the total) is rewritten as the part is
written.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time
from typing import Any

__all__ = ["PREFIX", "hidden", "new_id", "id_time", "Plan", "plan_dir", "write", "listed", "set_state",
           "write_progress", "read_progress", "remove"]

PREFIX = "\x00ckpt/"


def hidden(cid: str, key: str) -> str:
    """The store key of checkpoint ``cid``'s object ``key``."""
    return f"{PREFIX}{cid}/{key}"


def new_id() -> str:
    """A checkpoint id: its start time in milliseconds (hex, so ids sort by age) and 24 random bits."""
    return f"{int(time.time() * 1000):011x}{secrets.token_hex(3)}"


def id_time(cid: str) -> float:
    """When checkpoint ``cid`` started (seconds since the epoch); 0 for an id not made by :func:`new_id`."""
    try:
        return int(cid[:11], 16) / 1000.0
    except ValueError:
        return 0.0


@dataclasses.dataclass
class Plan:
    """One node's part of a checkpoint: flush the objects of bundles ``keys`` (one dict per process, under
    ``hidden(id, "@" + bundle)`` in ``session``) as part ``part`` of ``<persist_dir>/<name>@<id>``;
    ``skeleton`` is the manifest less what the flush adds."""

    name: str
    id: str
    persist_dir: str
    session: str
    part: int
    keys: list[str]
    skeleton: dict[str, Any]
    keep: int

    @property
    def folder(self) -> str:
        return os.path.join(self.persist_dir, f"{self.name}@{self.id}")

    @property
    def stem(self) -> str:
        return f"{self.id}-{self.part:05d}"


def plan_dir(spill_path: str) -> str:
    """The plans of the store whose spill directory is ``spill_path``."""
    return spill_path.rstrip("/") + ".checkpoints"


def write(where: str, plan: Plan) -> str:
    """Write ``plan`` (to flush) into ``where``; returns its path."""
    os.makedirs(where, mode=0o700, exist_ok=True)
    path = os.path.join(where, plan.stem + ".plan")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        # the fields as they are (dataclasses.asdict deep-copies the skeleton's per-key maps: 5 ms of 7 for 1,000 keys)
        f.write(json.dumps({fld.name: getattr(plan, fld.name) for fld in dataclasses.fields(plan)}))
    os.replace(tmp, path)
    return path


def listed(where: str, state: str = "plan") -> list[tuple[str, Plan]]:
    """(path, plan) of the plans in ``where`` in ``state`` (``plan``, ``flushed`` or ``failed``), oldest first;
    a file that does not read as a plan is skipped."""
    try:
        names = sorted(n for n in os.listdir(where) if n.endswith("." + state))
    except OSError:
        return []
    out = []
    for n in names:
        path = os.path.join(where, n)
        try:
            with open(path) as f:
                data = json.load(f)
            data.pop("error", None)
            out.append((path, Plan(**data)))
        except (OSError, ValueError, TypeError):
            continue
    return out


def set_state(path: str, state: str, error: str | None = None) -> str:
    """Move the plan at ``path`` to ``state``; returns its new path."""
    new = path.rsplit(".", 1)[0] + "." + state
    if error is not None:
        with open(path) as f:
            data = json.load(f)
        data["error"] = error
        with open(path, "w") as f:
            json.dump(data, f)
    os.replace(path, new)
    return new


def write_progress(where: str, plan: Plan, done: int, total: int) -> None:
    path = os.path.join(where, plan.stem + ".progress")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump({"name": plan.name, "id": plan.id, "part": plan.part, "done": done, "total": total,
                       "time": time.time()}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def read_progress(where: str) -> list[dict[str, Any]]:
    """The progress records in ``where`` (one per part flushed or flushing on this node)."""
    try:
        names = sorted(n for n in os.listdir(where) if n.endswith(".progress"))
    except OSError:
        return []
    out = []
    for n in names:
        try:
            with open(os.path.join(where, n)) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue
    return out


def remove(path: str) -> None:
    """Remove a plan and its progress record."""
    for p in (path, path.rsplit(".", 1)[0] + ".progress"):
        try:
            os.unlink(p)
        except OSError:
            pass


def is_plan_file(name: str) -> bool:
    """Whether ``name`` is one of the files this module writes in a plans folder (a plan in any state, a
    progress record, either's temporary file)."""
    return name.rsplit(".", 1)[-1] in ("plan", "flushed", "failed", "progress") or ".tmp-" in name


def remove_all(where: str) -> None:
    """Remove every plan and progress record in ``where``, and the folder: its store is gone (destroyed, by
    its last client, ``destroy`` or ``gc``), and its checkpoints' unflushed parts with it."""
    try:
        names = os.listdir(where)
    except OSError:
        return
    for n in names:
        if is_plan_file(n):
            try:
                os.unlink(os.path.join(where, n))
            except OSError:
                pass
    try:
        os.rmdir(where)
    except OSError:
        pass
