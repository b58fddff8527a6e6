"""Fixtures: stores named for this test run, a leak check around every test, and a bystander store that the
whole run must leave alone."""
from __future__ import annotations

import gc
import os
import sys
import threading
import warnings

import pytest


def _cupy_stand_in() -> None:
    """Where CuPy cannot find a device, the GPU level's tests run on the CuPy stand-in (tests/fakecuda:
    device memory of shared memory; it proves the store's logic, not CUDA's semantics), in this process and
    in every process it starts (``SHMSTORE_FAKE_CUPY``, inherited). Where a device is, the real CuPy runs
    them. ``SHMSTORE_NO_GPU=1`` runs without either; ``SHMSTORE_FAKE_CUPY=`` (empty) without the stand-in."""
    if "SHMSTORE_FAKE_CUPY" in os.environ or os.environ.get("SHMSTORE_NO_GPU", "").lower() in ("1", "true", "yes"):
        return
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return
    except Exception:  # not installed, no driver, no device
        pass
    for mod in [m for m in sys.modules if m.split(".")[0] in ("cupy", "cupy_backends")]:
        del sys.modules[mod]
    os.environ["SHMSTORE_FAKE_CUPY"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakecuda")
    sys.path.insert(0, os.environ["SHMSTORE_FAKE_CUPY"])


_cupy_stand_in()


def _sigint_by_default() -> None:
    """A suite started in the background of a shell without job control (``nohup pytest &``, a script's ``&``)
    inherits SIGINT ignored, and so would every child it starts: Python then installs no KeyboardInterrupt
    handler, and the tests that send a child Ctrl-C saw "no run was interrupted" (22 of them, in one such run).
    A handler here is reset to the default at each child's exec, as an ignored signal is not."""
    import signal
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_sigint_by_default()

import shmstore  # noqa: E402
from shmstore.node.nodestore import reap_children  # noqa: E402

from helpers import Bystander, children, of_this_run, shm_segments, unique_name, wait_for  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """``stress`` tests (hours with ``scripts/chaos.py``) run only where ``-m`` names them: a marker expression of
    one's own (``-m "not slow"``, the inner loop) replaces any in addopts, and brought them back."""
    if "stress" in (config.getoption("markexpr") or ""):
        return
    stress = [item for item in items if item.get_closest_marker("stress")]
    if stress:
        config.hook.pytest_deselected(items=stress)
        items[:] = [item for item in items if not item.get_closest_marker("stress")]


SMALL = "64MiB"


@pytest.fixture
def name() -> str:
    return unique_name()


@pytest.fixture
def store(name):
    with shmstore.connect(name, capacity=SMALL, prefault="16MiB") as s:
        yield s


@pytest.fixture(scope="session")
def bystanders(tmp_path_factory):
    """The live stores of other programs beside this run (tests may add more); verified and closed at the end.

    None in the ranks of an MPI run (tests/mpi/ranks under mpiexec): the pytest that launched it has its own."""
    launched = any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))
    out = [] if launched else [Bystander(str(tmp_path_factory.mktemp("bystander")))]
    yield out
    try:
        for b in out:
            assert not b.damage(), f"another program's store {b.name!r} was damaged by the test run: {b.damage()}"
            b.verify()
    finally:
        for b in out:
            b.close()


@pytest.fixture(scope="session")
def cuda_context() -> None:
    """Where CuPy and a device are usable, this process's CUDA context, made once before any test's leak check
    counts descriptors: a context keeps ``/dev/nvidia*`` descriptors (and the driver's pipes and eventfds) open
    for the life of the process, as MPI does from its import (tests/mpi/test_jobs.py). Without CuPy, without a
    device or with ``SHMSTORE_NO_GPU`` set: nothing, not even an import of CuPy."""
    from shmstore.levels.device import cupy_or_reason
    cupy, _ = cupy_or_reason()
    if cupy is None:
        return
    try:
        cupy.cuda.Device(0).use()
        cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # the primary context, as the first test would make it
        cupy.arange(1).sum()  # and the module loads of a first kernel (NVRTC, the kernel cache)
        cupy.cuda.get_current_stream().synchronize()
    except Exception as exc:  # no NVRTC, a device in exclusive mode...: the GPU tests say it, each on its own
        warnings.warn(f"could not make the CUDA context before the tests: {exc!r}", stacklevel=1)


def _threads(skip: set[str]) -> set[str]:
    return {t.name for t in threading.enumerate() if not t.name.startswith("shmstore-copy") and t.name not in skip}


def _fds() -> int:
    """This process's open descriptors, less those of the CUDA driver (``/dev/nvidia*``): it opens more as the
    process first uses CUDA IPC or torch starts CUDA, and keeps them for the life of the process."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += not os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return n


@pytest.fixture(autouse=True)
def no_leaks(request, bystanders, cuda_context):
    """Fail a test that leaves segments of this run, spill processes, threads or fds behind, or that touched
    another program's store. Segments of other names that appear meanwhile are reported, never removed."""
    seg0, fds0, known = set(shm_segments()), _fds(), len(bystanders)
    threads0 = _threads(set())
    yield
    # a full collection walks only what is not frozen: what this test (and the runner since the last test) made
    gc.collect()
    try:
        _check_leaks(bystanders, known, seg0, fds0, threads0)
    finally:
        # what survived it from now on never walked again: a collection of the whole heap took ~0.3 s a test
        # once torch and dask were imported, a quarter of the suite's time; garbage it leaves later (a module's
        # fixture) is closed by that fixture, not found by a collection
        gc.freeze()


def _check_leaks(bystanders: list[Bystander], known: int, seg0: set[str], fds0: int, threads0: set[str]) -> None:
    """:func:`no_leaks`' checks after a test (see there)."""
    new = bystanders[known:]  # started by the test, to outlive it: its pipes, its reader thread, its process
    skip_threads = {f"child-{b.child.pid}-stdout" for b in new}
    skip_pids = {b.child.pid for b in bystanders}

    def mine() -> list[str]:
        return sorted(s for s in set(shm_segments()) - seg0 if of_this_run(s))

    def clean() -> bool:
        reap_children()
        return not mine() and not set(children()) - skip_pids and _threads(skip_threads) <= threads0

    ok = wait_for(clean, timeout=15)
    leaked, kids = mine(), sorted(set(children()) - skip_pids)
    for seg in leaked:  # ours: do not let one test's leak fail the next ones
        try:
            os.unlink("/dev/shm/" + seg)
        except OSError:
            pass
    _report_others(set(shm_segments()) - seg0, bystanders)
    damaged = {b.name: b.damage() for b in bystanders if b.damage()}
    assert not damaged, f"the test removed or replaced another program's store: {damaged}"
    assert ok, f"leaked segments {leaked}, child processes {kids}, threads {sorted(_threads(skip_threads) - threads0)}"
    assert _fds() <= fds0 + 3 * len(new) + 2, f"leaked file descriptors: {fds0} before, {_fds()} after"


def _report_others(appeared: set[str], bystanders: list[Bystander]) -> None:
    """Say which segments of other names appeared while the test ran: another program's (or test run's),
    or a test that named a store outside ``SUITE``. Never removed: they may be in use."""
    others = sorted(s for s in appeared if not of_this_run(s) and not any(b.owns(s) for b in bystanders))
    if others:
        warnings.warn(f"segments of names not of this test run appeared (left alone): {others}", stacklevel=1)
