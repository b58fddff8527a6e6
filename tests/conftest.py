"""Fixtures: uuid-named stores, and a leak check around every test."""
from __future__ import annotations

import gc
import os
import threading
import uuid

import pytest

import shmstore
from shmstore.kernel.node import reap_children

from helpers import children, shm_segments, wait_for

SMALL = "64MiB"


@pytest.fixture
def name() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def store(name):
    with shmstore.connect(name, capacity=SMALL, prefault="16MiB") as s:
        yield s


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if not t.name.startswith("shmstore-copy")}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail a test that leaves shm segments, spill processes, threads or fds behind."""
    seg0, threads0, fds0 = set(shm_segments()), _threads(), _fds()
    yield
    gc.collect()

    def clean() -> bool:
        reap_children()
        return not (set(shm_segments()) - seg0) and not children() and (_threads() <= threads0)

    ok = wait_for(clean, timeout=15)
    leaked = sorted(set(shm_segments()) - seg0)
    kids = children()
    for seg in leaked:  # do not let one test's leak fail the next ones
        try:
            os.unlink("/dev/shm/" + seg)
        except OSError:
            pass
    assert ok, f"leaked segments {leaked}, child processes {kids}, threads {sorted(_threads() - threads0)}"
    assert _fds() <= fds0 + 2, f"leaked file descriptors: {fds0} before, {_fds()} after"
