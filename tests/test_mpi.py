"""MPI for real: the tests/mpi suite on 4 ranks over two emulated nodes, and a rank killed mid-transfer."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

import shmstore
from shmstore import Level
from shmstore.kernel import layout as L

from helpers import ROOT, shm_segments, wait_for

pytest.importorskip("mpi4py")
BIN = os.path.dirname(sys.executable)
MPIEXEC = shutil.which("mpiexec", path=BIN + os.pathsep + os.environ.get("PATH", ""))
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'shmstore[mpich]')")]


def _env() -> dict[str, str]:
    return dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=ROOT)


@pytest.mark.timeout(600)
def test_mpi_suite_on_two_emulated_nodes():
    before = set(shm_segments())
    r = subprocess.run(["bash", os.path.join(ROOT, "mpi", "run-tests.sh")], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=540)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert out.count(" passed") >= 4 and " failed" not in out, out[-6000:]
    assert wait_for(lambda: set(shm_segments()) <= before, timeout=15), set(shm_segments()) - before


@pytest.mark.timeout(300)
def test_rank_killed_mid_transfer_leaves_no_pins_reservations_or_migrations():
    name = "k" + uuid.uuid4().hex[:10]
    job = os.path.join(ROOT, "tests", "mpi", "jobs", "kill_mid_transfer.py")
    r = subprocess.run([MPIEXEC, "-launcher", "fork", "-hosts", "n0:2,n1:2", "-n", "4", sys.executable, "-m",
                        "mpi4py", job, name], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert "killing myself mid-transfer" in out, out[-4000:]
    assert r.returncode != 0  # the launcher took the job down
    try:
        with shmstore.connect(name, node="n1", create=False) as dst, \
                shmstore.connect(name, node="n0", create=False) as src:
            dnode = dst._node

            def clean() -> bool:
                t = L.entry_table(dnode.meta.mm, dnode.layout)
                flights = [L.unpack_migration(dnode.meta.mm, dnode.layout, s).state for s in range(L.NMIGRATIONS)]
                return (L.MIG_FLIGHT not in flights and not (t["state"] == L.WRITING).any()
                        and not src.get_info("big").pinned and len(src.status()["clients"]) == 1)

            assert wait_for(clean, timeout=20)
            used = dst.get_capacity()[Level.MEMORY].used
            assert used == sum(i.stored for i in dst._kernel.list(all_sessions=True))
            assert "big" not in dst or dst.get("big")[-1] == 1
            assert src.get("big")[12345] == 1
    finally:
        shmstore.destroy(name, force=True, node="n0")
        shmstore.destroy(name, force=True, node="n1")
