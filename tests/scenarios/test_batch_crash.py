"""Processes killed (SIGKILL) at every step of a batch: each key all or nothing, the store consistent.

The sweep of ``test_crash.py``: a forked child runs ``put_many`` /
``delete_many`` under a line tracer that kills it at the N-th line of
shmstore code, for N over the whole batch (or a stride of it); after each
death ``store.check()`` finds nothing wrong and every key of the batch is
either absent or holds exactly its value (put), or the old or the new value,
never neither (overwrite), or absent or intact (delete).
"""
from __future__ import annotations

import numpy as np
import pytest

from ._sweeps import _child_store, crc_of, values
from .test_crash import sweep

pytestmark = pytest.mark.slow


def _batch() -> dict[str, object]:
    v = values()
    return {"small": v["small"], "dict": v["dict"], "large": v["large"], "tiny": b"t" * 10,
            "arr": np.arange(500), "more": b"m" * 2000}  # the kinds of test_crash over several stripes


@pytest.mark.parametrize("overwrite", [False, True], ids=["put_many", "put_many-overwrite"])
def test_put_many_killed_at_every_step_leaves_each_key_whole_or_absent(crash_store, overwrite):
    store, batch = crash_store, _batch()
    want = {k: crc_of(v) for k, v in batch.items()}
    old = {k: b"old:" + k.encode() for k in batch}

    def prepare():
        s = _child_store(store)()
        if overwrite:
            s.put_many(old, overwrite=True)
        return s

    def op(s):
        s.put_many(batch, overwrite=overwrite)

    def verify(finished):
        present = [k for k in batch if k in store]
        if finished or overwrite:
            assert present == list(batch)  # an overwrite never leaves a key missing
        for k in present:
            got = store.get(k)
            assert crc_of(got) == want[k] or (overwrite and bytes(got) == old[k]), k
            del got
        store.delete_many(present)

    assert sweep(store, prepare, op, verify) > 5


def test_delete_many_killed_at_every_step_leaves_each_key_intact_or_gone(crash_store):
    store, batch = crash_store, _batch()
    want = {k: crc_of(v) for k, v in batch.items()}

    def prepare():
        s = _child_store(store)()
        s.put_many(batch, overwrite=True)
        return s

    def op(s):
        s.delete_many(list(batch))

    def verify(finished):
        present = [k for k in batch if k in store]
        if finished:
            assert not present
        for k in present:
            assert crc_of(store.get(k)) == want[k], k
        store.delete_many(present)

    assert sweep(store, prepare, op, verify) > 5
