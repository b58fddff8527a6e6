"""Slurm for real: a throwaway cluster of two emulated nodes (mpi/slurm/testcluster.sh), the quick scaling
job and a job scancelled mid-transfer, submitted with sbatch and checked afterwards.

Needs Slurm's daemons (Debian: ``slurm-wlm munge``; ``.ci/run`` installs them) and root; skips with the
reason otherwise.
"""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import time

import pytest

from helpers import ROOT, wait_for

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged") and shutil.which("sbatch"))
    or os.getuid() != 0, reason="no Slurm here (apt-get install slurm-wlm munge, as root; .ci/run does)")]
BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The cluster's environment (SLURM_CONF, PATH with this interpreter first); stopped at the end."""
    d = str(tmp_path_factory.mktemp("slurm"))
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=ROOT,
               SLURM_CONF=os.path.join(d, "slurm.conf"), SHMSTORE_PYTHON=sys.executable)
    for var in [v for v in env if v.startswith(("SLURM_JOB", "SLURM_NNODES", "SHMSTORE_NODE"))]:
        env.pop(var)
    script = os.path.join(ROOT, "mpi", "slurm", "testcluster.sh")
    r = subprocess.run(["bash", script, "start", d], env=env, capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        yield env
    finally:
        subprocess.run(["bash", script, "stop", d], env=env, capture_output=True, timeout=60)


def sbatch(env: dict[str, str], *args: str) -> str:
    r = subprocess.run(["sbatch", "--parsable", *args], env=env, capture_output=True, text=True, timeout=30,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def running(env: dict[str, str], job: str) -> bool:
    r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    return bool(r.stdout.strip())


def leftovers(job: str, spill_dir: str) -> list[str]:
    """Whatever job ``job`` left on this machine: store segments, semaphores, spill files, spill processes."""
    left = [s for s in os.listdir("/dev/shm") if f"-job-{job}-" in s]
    left += [os.path.join(r, f) for r, _, fs in os.walk(spill_dir) for f in fs]
    r = subprocess.run(["pgrep", "-af", f"shmstore.spill --name job-{job} "], capture_output=True, text=True)
    return left + r.stdout.split("\n")[:-1]


@pytest.mark.timeout(300)
def test_quick_scaling_job_writes_its_csv_and_plots_and_leaves_nothing(slurm, tmp_path):
    out, spill = tmp_path / "results", tmp_path / "spill"
    spill.mkdir()
    env = dict(slurm, SCALING_OUT=str(out), SHMSTORE_SPILL_DIR=str(spill))
    job = sbatch(env, "-N", "2", "--ntasks-per-node=2", "-o", str(tmp_path / "job.out"),
                 os.path.join(ROOT, "mpi", "slurm", "scaling.sbatch"), "--quick")
    assert wait_for(lambda: not running(env, job), timeout=240), (tmp_path / "job.out").read_text()[-3000:]
    log = (tmp_path / "job.out").read_text()
    assert "rows in" in log, log[-3000:]
    with open(out / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["nodes"] for r in rows} == {"1", "2"}, log[-2000:]  # real nodes from the allocation
    assert {"fetch_bw", "remote_get_lat", "broadcast", "local_put_ops", "spill_bw"} <= {r["workload"] for r in rows}
    assert all(float(r["value"]) > 0 and float(r["baseline_value"]) > 0 for r in rows)
    try:
        import matplotlib  # noqa: F401
        for png in ("throughput_vs_ranks", "bandwidth_vs_size", "latency_vs_nodes", "messages_vs_nodes",
                    "broadcast_vs_nodes"):
            assert (out / f"{png}.png").stat().st_size > 10_000
    except ImportError:
        assert "no matplotlib" in log
    assert wait_for(lambda: not leftovers(job, str(spill)), timeout=30), leftovers(job, str(spill))


@pytest.mark.timeout(300)
def test_job_cancelled_mid_transfer_leaves_no_store_spill_file_or_process(slurm, tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    env = dict(slurm, SHMSTORE_SPILL_DIR=str(spill))
    log = tmp_path / "job.out"
    job = sbatch(env, "-N", "2", "--ntasks-per-node=2", "-o", str(log), "--wrap",
                 f"srun --mpi=pmi2 -K {sys.executable} -m mpi4py {ROOT}/tests/mpi/jobs/transfer_loop.py")
    assert wait_for(lambda: log.exists() and "transferring" in log.read_text(), timeout=120), \
        log.read_text()[-3000:] if log.exists() else "no output"
    assert [s for s in os.listdir("/dev/shm") if f"-job-{job}-n1-" in s]  # one store per node, named by the job
    assert [s for s in os.listdir("/dev/shm") if f"-job-{job}-n2-" in s]
    time.sleep(0.3)  # well inside the transfer loop
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)
    assert wait_for(lambda: not running(env, job), timeout=60)
    assert wait_for(lambda: not leftovers(job, str(spill)), timeout=30), leftovers(job, str(spill))
