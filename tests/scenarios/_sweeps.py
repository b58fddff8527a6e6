"""What the crash sweep (``test_crash.py``, ``test_batch_crash.py``) and the interrupt sweep
(``test_interrupts.py``) share: the store they sweep, how a child connects to it, the values they put, the
points they stop at, and how the store is checked after each stop."""
from __future__ import annotations

import os
import time
import zlib

import numpy as np

import shmstore
from shmstore import Level
from shmstore.meta import layout as L

from helpers import wait_for

PKG = os.path.dirname(shmstore.__file__)
RNG = __import__("random").Random()


def _child_store(store):
    """How a child process connects to ``store``."""
    return lambda: shmstore.connect(store.name, spill_dir=store.config.spill_dir, prefault=0)


def settle(store) -> None:
    """Wait until a spill process has gone round its loop since now: dead clients reclaimed, moves recovered."""
    since = time.time()

    def done() -> bool:
        _ = store.spill_pid  # restart it if it is gone (a new one recovers before its first round)
        store.node_store.wake.post()
        others = [c for c in store.status()["clients"] if c["pid"] != os.getpid()]
        return not others and L.unpack_spill_state(store.node_store.meta.mm).heartbeat > since
    assert wait_for(done, timeout=20, interval=0.002), store.status()


def assert_consistent(store) -> None:
    problems = store.check()
    assert not problems, "\n".join(problems)
    cap, infos = store.get_capacity(), store.list()
    for lv in (Level.MEMORY, Level.DISK):
        assert cap[lv].used == sum(i.stored for i in infos if i.level == lv), lv
    for info in infos:  # nothing listed that get does not find
        store.get(info.key)


def crc_of(obj) -> int:
    if isinstance(obj, dict):
        return zlib.crc32(np.ascontiguousarray(obj["a"])) ^ obj["n"]
    return zlib.crc32(np.ascontiguousarray(np.frombuffer(memoryview(obj).cast("B"), np.uint8))
                      if not isinstance(obj, np.ndarray) else np.ascontiguousarray(obj))


def values():
    rng = np.random.default_rng(5)
    return {
        "small": rng.integers(0, 255, 3000, dtype=np.uint8).tobytes(),        # C fast path, chunk
        "dict": {"a": rng.random(5000), "n": 7},                                # pickled: Python path
        "large": rng.random(300_000),                                           # an extent of its own
        "disk": rng.integers(0, 255, 200_000, dtype=np.uint8),                  # on DISK
    }


def kill_points(total: int, max_points: int | None = None) -> range:
    """Lines to kill at: all of them, or a stride with a random start (printed, so a failure can be rerun).

    ``SHMSTORE_CRASH_POINTS`` sets how many per operation (0: every line).
    """
    if max_points is None:
        max_points = int(os.environ.get("SHMSTORE_CRASH_POINTS", "40"))
    stride = max(1, total // max_points) if max_points else 1
    start = 1 + RNG.randrange(stride)
    print(f"kill points: {start}..{total} step {stride}")
    return range(start, total + 1, stride)
