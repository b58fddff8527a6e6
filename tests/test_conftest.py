"""The suite's own leak check touches only what this test run made."""
from __future__ import annotations

import os
import subprocess
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


_LATER_GARBAGE = '''
import gc, os, weakref

from helpers import SUITE

SEGMENT = f"shmstore-{os.getuid()}-{SUITE}cycle"


class Node:
    pass


def test_survivors():
    global KEPT  # outlives its test: frozen by that test's leak check
    KEPT = [Node() for _ in range(1000)]
    assert gc.get_freeze_count() == 0


def test_a_cycle_made_later_and_holding_a_segment():
    assert gc.get_freeze_count() >= 1000
    n = Node()
    n.me, n.old = n, KEPT[0]  # a cycle, reaching what is frozen: only a collection finds it
    n.segment = open("/dev/shm/" + SEGMENT, "wb")  # as a store's segment: gone when its holder is
    weakref.finalize(n, lambda f=n.segment: (f.close(), os.unlink(f.name)))
    del n


def test_the_cycle_was_collected_by_the_check_after_its_test():
    assert not os.path.exists("/dev/shm/" + SEGMENT)
'''


def test_the_leak_check_still_collects_what_a_test_leaves_in_cycles_after_freezing_what_earlier_tests_kept(
        tmp_path):
    """The leak check collects fully after each test, then freezes what survived (``gc.freeze``), so that the
    next collection walks only what the next test makes (a whole-heap collection cost ~0.3 s a test). A test that
    leaves a segment in a reference cycle, reaching objects an earlier test kept, must still see it finalized by
    its own check: else the check fails it for a leak (after waiting 15 s)."""
    (tmp_path / "test_later_garbage.py").write_text(_LATER_GARBAGE)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_later_garbage.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "3 passed" in r.stdout, r.stdout + r.stderr
