"""The optional C fast path and the pure-Python kernel behave the same."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from shmstore.kernel import fastpath, kernel

from helpers import ROOT


def test_the_extension_is_used_where_it_was_built():
    built = glob.glob(os.path.join(ROOT, "shmstore", "kernel", "_fast*.so")) or fastpath.load() is not None
    assert (kernel._fast is not None) == bool(built)


@pytest.mark.timeout(300)
def test_pure_python_kernel_passes_the_store_tests():
    env = dict(os.environ, SHMSTORE_PURE_PYTHON="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                        "tests/test_store.py", "tests/test_streams.py", "tests/test_processes.py",
                        "-k", "not gc_removes"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert " passed" in r.stdout and " failed" not in r.stdout


def test_fast_path_offsets_match_the_entry_layout():
    from shmstore.kernel import layout as L
    codes = L.ENTRY_HEAD.format.lstrip("<").rstrip("4x")  # one letter per field, then padding
    assert len(codes) == 18
    field = {i: L.struct.calcsize("<" + codes[:i]) for i in range(18)}  # offset of field i
    lay = L.fast_path_layout()
    assert lay[0] == L.ENTRY_SIZE
    assert (lay[1], lay[2], lay[3], lay[4], lay[5]) == (field[L.E_HASH], field[L.E_NEXT], field[L.E_KEYLEN],
                                                        field[L.E_SESSION], field[L.E_STATE])
    assert (lay[11], lay[12], lay[13], lay[14], lay[15], lay[16]) == (
        field[L.E_OFFSET], field[L.E_NBYTES], field[L.E_ATIME], field[L.E_GEN], field[L.E_KIND], field[L.E_LEVEL])
    assert (lay[7], lay[8], lay[17], lay[18]) == (L.SEALED, L.WRITING, L.MAX_KEY, L.DELETED)


def test_fast_get_refreshes_the_access_time_and_releases_its_pin(store):
    import time

    import numpy as np

    from shmstore.kernel import layout as L
    store.put("a", np.arange(4))
    k = store._kernel
    idx = k.lookup("a", b"a", False)[0]
    before = L.entry_raw(k._buf, k._lay.entry(idx))[L.E_ATIME]
    time.sleep(0.1)
    view = store.get("a")
    assert k._pins.get(idx) == 1
    assert L.entry_raw(k._buf, k._lay.entry(idx))[L.E_ATIME] > before + 0.05
    del view
    assert idx not in k._pins
