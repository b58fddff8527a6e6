"""The scenario sweeps' store (``test_crash.py``, ``test_batch_crash.py``, ``test_interrupts.py``; their shared
helpers are in ``_sweeps.py``)."""
from __future__ import annotations

import pytest

import shmstore


@pytest.fixture
def crash_store(name, tmp_path):
    """A store to sweep: small, no prefault (a child connects once per stop point), a spill directory of
    the test's own."""
    with shmstore.connect(name, capacity="32MiB", spill_dir=str(tmp_path), prefault=0, max_objects=1024) as s:
        yield s
