"""The suite's own leak check touches only what this test run made."""
from __future__ import annotations

import os
import sys

from helpers import SUITE, Bystander, of_this_run, shm_segments


def test_a_store_another_program_starts_while_a_test_runs_is_left_alone(bystanders, tmp_path_factory):
    """Regression (issue 19): the leak check unlinked every segment that appeared while a test ran, whoever made
    it: a live store of another program started beside the suite lost its segments. This one starts during the
    test and outlives it: this test's teardown (the leak check) and every later one check that it is still there,
    file by file, and the end of the run reads its objects back."""
    b = Bystander(str(tmp_path_factory.mktemp("bystander")))
    bystanders.append(b)  # closed at the end of the run
    mine = [s for s in shm_segments() if b.owns(s)]
    assert len(mine) == 3 and not any(of_this_run(s) for s in mine) and not b.name.startswith(SUITE)


def test_the_cuda_context_is_made_once_before_the_leak_check_and_only_where_a_gpu_is(cuda_context):
    """Issue 23: the first test that made a CUDA context failed the fd bound. Made once per session where a GPU
    is (a new kernel then opens no descriptor for good); without CuPy or with SHMSTORE_NO_GPU nothing is done,
    CuPy not even imported."""
    from shmstore.levels.device import cupy_or_reason
    cupy, why = cupy_or_reason()
    if cupy is None:
        if "not installed" in why or "SHMSTORE_NO_GPU" in why:
            assert "cupy" not in sys.modules
        return
    fds = len(os.listdir("/proc/self/fd"))
    assert int((cupy.arange(1000) * 2).sum()) == 999_000
    assert len(os.listdir("/proc/self/fd")) <= fds
