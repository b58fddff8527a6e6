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
