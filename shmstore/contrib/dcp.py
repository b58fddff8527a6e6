"""``torch.distributed.checkpoint`` storage through the store: ``dcp.save``/``async_save``/``load`` users get
shmstore's checkpoints (node memory first, the folder written in the background) by passing a writer/reader::

    import torch.distributed.checkpoint as dcp
    from shmstore.contrib.dcp import ShmStoreReader, ShmStoreWriter

    dcp.save(state_dict, storage_writer=ShmStoreWriter("/scratch/me/run1/step100"))
    dcp.load(state_dict, storage_reader=ShmStoreReader("/scratch/me/run1/step100"))

The checkpoint id is a folder, as for torch's ``FileSystemWriter``: it holds
one checkpoint of ``dcp``. Each rank's ``write_data`` is a
``Store.checkpoint`` named ``r<rank>`` of its items (its tensors as one
store object: one copy into the node's store), flushed by the node's spill
process; the coordinator's ``finish`` waits until every rank's part is
complete in the folder, then checkpoints dcp's metadata as ``meta``: the
dcp checkpoint is complete when ``meta`` is. ``load`` reads each item from
the node's store where it still holds it (views; the planner copies them
into the state dict's tensors), else from the folder's files.

Each process connects to its node's store (``shmstore.connect()``, or the
``store`` given). A later job, on any nodes, reads the folder.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

import shmstore

from ..checkpoint import Checkpoint, Restored, checkpoint, restore
from ..errors import CheckpointError
from ..persist import folder

__all__ = ["ShmStoreWriter", "ShmStoreReader"]

KEEP_ALL = 1 << 30  # a dcp folder holds one checkpoint: its parts are never pruned


def _store(store: shmstore.Store | None) -> shmstore.Store:
    return store if store is not None else shmstore.connect()


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ShmStoreWriter(StorageWriter):
    """A dcp ``StorageWriter`` into shmstore (see the module's docstring); ``timeout``: the longest ``finish``
    waits for the ranks' parts to be flushed."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, store: shmstore.Store | None = None,
                 timeout: float = 3600.0) -> None:
        super().__init__()
        self.path = None if path is None else os.path.abspath(os.fspath(path))
        self._store = store
        self.timeout = timeout
        self.rank = 0
        self.parts: list[Checkpoint] = []

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self.parts = []

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank", _rank()))
        if self.path is None:
            raise CheckpointError("ShmStoreWriter needs a folder: ShmStoreWriter(path) or dcp.save(..., "
                                  "checkpoint_id=path)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"r{i}") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        part = plan.storage_data or f"r{self.rank}"
        objects: dict[str, Any] = {}
        results = []
        for i, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            key = f"{part}/{i}"
            if isinstance(data, io.BytesIO):
                value: Any = data.getvalue()
                size = len(value)
            else:
                value = data.detach().cpu().contiguous()
                size = value.numel() * value.element_size()
            objects[key] = value
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=key))
        assert self.path is not None
        self.parts.append(checkpoint(_store(self._store), part, objects, self.path, KEEP_ALL))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator: wait until every rank's part is complete in the folder, then checkpoint the metadata
        (``meta``) and wait for it."""
        assert self.path is not None
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        deadline = time.monotonic() + self.timeout
        for i in range(len(results)):
            for ck in self.parts:
                ck.wait(max(0.0, deadline - time.monotonic()))
            while folder.latest(self.path, f"r{i}") is None:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"part r{i} of dcp checkpoint {self.path} was not complete after "
                                          f"{self.timeout:g} s (ShmStoreWriter(timeout=))")
                time.sleep(0.01)
        meta = checkpoint(_store(self._store), "meta", {"metadata": pickle.dumps(metadata)}, self.path, KEEP_ALL)
        if not meta.wait(max(0.0, deadline - time.monotonic())):
            raise CheckpointError(f"the metadata of dcp checkpoint {self.path} was not flushed in time")

    def storage_meta(self) -> Any:
        return None


def _narrow(tensor: Any, offsets: Any, lengths: Any) -> Any:
    """The part of ``tensor`` a load item asks for (``offsets`` and ``lengths`` per dimension)."""
    for dim, (off, n) in enumerate(zip(offsets, lengths)):
        if off != 0 or n != tensor.size(dim):
            tensor = tensor.narrow(dim, off, n)
    return tensor


class ShmStoreReader(StorageReader):
    """A dcp ``StorageReader`` of what :class:`ShmStoreWriter` wrote (see the module's docstring)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, store: shmstore.Store | None = None) -> None:
        super().__init__()
        self.path = None if path is None else os.path.abspath(os.fspath(path))
        self._store = store
        self._parts: dict[str, Restored] = {}
        self.storage_data: dict[Any, str] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self._parts = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and folder.latest(os.fspath(checkpoint_id),
                                                                                 "meta") is not None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        got = self._part("meta")
        md: Metadata = pickle.loads(bytes(got["metadata"]))
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _part(self, part: str) -> Restored:
        got = self._parts.get(part)
        if got is None:
            if self.path is None:
                raise CheckpointError("ShmStoreReader needs a folder: ShmStoreReader(path) or dcp.load(..., "
                                      "checkpoint_id=path)")
            got = self._parts[part] = restore(_store(self._store), part, self.path)
        return got

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            key = self.storage_data[req.storage_index]
            value = self._part(key.split("/", 1)[0])[key]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(value)))
                continue
            tensor = _narrow(value, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
