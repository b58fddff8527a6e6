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
from mpi4py import MPI  # noqa: E402,F401  (MPI opens its descriptors at import: before the leak checks count them)
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


@pytest.mark.timeout(200)
def test_ranks_alone_in_their_shared_memory_groups_but_sharing_a_host_and_label_are_warned():
    """Two fake hosts (so MPI gives each rank a shared-memory group of its own) but one SHMSTORE_NODE label
    on one real host: the situation that silently made one store per rank under some Slurm layouts."""
    code = ("import warnings, uuid\n"
            "from mpi4py import MPI\n"
            "from shmstore.mpi import Cluster\n"
            "name = MPI.COMM_WORLD.bcast('w' + uuid.uuid4().hex[:8])\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    with Cluster(name=name, capacity='16MiB', prefault=0) as c:\n"
            "        warned = any('own shared-memory group' in str(w.message) for w in caught)\n"
            "        print(f'nodes {len(c.nodes)} warned {warned}', flush=True)\n")  # one write: ranks interleave
    for label, warned in (("same", True), (None, False)):
        env = _env()
        env.pop("SHMSTORE_NODE", None)
        if label:
            env["SHMSTORE_NODE"] = label
        r = subprocess.run([MPIEXEC, "-launcher", "fork", "-hosts", "n0:1,n1:1", "-n", "2", sys.executable, "-m",
                            "mpi4py", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        assert r.stdout.count(f"nodes 2 warned {warned}") == 2, (label, r.stdout + r.stderr[-2000:])


def test_node_label_order(monkeypatch):
    from shmstore.mpi.cluster import _label
    for var in ("SHMSTORE_NODE", "PMI_HOSTNAME", "SLURMD_NODENAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "cn042")
    assert _label({}) == "cn042"  # Slurm's name for the node, where the launcher gives none
    monkeypatch.setenv("PMI_HOSTNAME", "n1")
    assert _label({}) == "n1"
    monkeypatch.setenv("SHMSTORE_NODE", "emu0")
    assert _label({}) == "emu0" and _label({"node": "given"}) == "given"
