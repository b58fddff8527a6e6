"""scripts/gpu-check.sh, without a GPU: the install it plans (offline where the wheel folder holds wheels, never a
second CuPy there; online with the extra of the driver's CUDA version), its steps and their timeouts, and a real
run of two cheap steps: a failing step does not stop the next, and one summary file is written (issue 23)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

from helpers import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu-check.sh")
STEPS = ["install", "env", "device-tests", "conformance", "mpi-full-levels", "bench-gpu", "bench-gpu-mpi", "sweep",
         "cuda-aware"]
WHEELS = ["posix_ipc-1.3.2-cp312-cp312-manylinux_2_5_x86_64.manylinux1_x86_64.manylinux_2_17_x86_64."
          "manylinux2014_x86_64.whl", "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl"]


def check(tmp_path, *args: str, path: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the script with its outputs under ``tmp_path`` (its summary, its logs, its venv)."""
    full = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_VENV=str(tmp_path / "venv"),
                GPU_CHECK_PYTHON=sys.executable, **env)
    if path is not None:
        full["PATH"] = path + os.pathsep + full["PATH"]
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


def wheel_folder(tmp_path, names: list[str]) -> str:
    folder = tmp_path / "whl"
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"")
    return str(folder)


def install_lines(out: str) -> list[str]:
    """The install commands of a plan (the indented lines under 'step install')."""
    lines = out.splitlines()
    start = lines.index("step install (timeout 150 s):") + 1
    return [line.strip() for line in lines[start:] if line.startswith("    ")][:4]


def test_offline_where_the_wheel_folder_holds_wheels_and_never_a_second_cupy(tmp_path):
    """The GPU machine: no index, the image's CuPy. A venv that sees it, the carried wheels with --no-index
    --no-deps, the project with --no-build-isolation and no extras; a CuPy wheel in the folder is left out."""
    folder = wheel_folder(tmp_path, [*WHEELS, "cupy_cuda12x-14.2.0-cp312-cp312-manylinux2014_x86_64.whl"])
    r = check(tmp_path, "--plan", GPU_CHECK_WHEELS=folder)
    assert r.returncode == 0, r.stderr
    assert f"mode offline ({folder}/ holds 3 wheel(s))" in r.stdout
    assert "left out cupy_cuda12x-14.2.0" in r.stdout
    venv, activate, wheels, project = install_lines(r.stdout)
    assert "-m venv --clear --system-site-packages" in venv and activate.startswith(". ")
    assert wheels.startswith("python -m pip install --no-index --no-deps ")
    assert sorted(os.path.basename(w) for w in wheels.split()[6:]) == sorted(WHEELS)
    assert project == "python -m pip install --no-index --no-deps --no-build-isolation -e ."
    assert not any("cupy" in line or "[" in line for line in (wheels, project))
    assert not (tmp_path / "out").exists() and not (tmp_path / "venv").exists()  # a plan runs nothing


def test_offline_names_a_missing_wheel_and_how_to_get_it(tmp_path):
    folder = wheel_folder(tmp_path, WHEELS[:1])
    r = check(tmp_path, "--plan", GPU_CHECK_WHEELS=folder)
    assert "mode offline" in r.stdout
    assert f"no mpich wheel in {folder}/: run scripts/gpu-wheels.sh" in r.stdout
    r = check(tmp_path, "--plan", "--offline", GPU_CHECK_WHEELS=str(tmp_path / "none"))
    assert "mode offline (--offline)" in r.stdout and "no posix_ipc wheel" in r.stdout
    assert "--no-index --no-deps --no-build-isolation -e ." in r.stdout


def test_online_without_wheels_takes_the_extra_of_the_drivers_cuda_version(tmp_path):
    """A networked machine: an extra naming the driver's CUDA major version (here a CUDA 13 driver, as
    nvidia-smi prints it), unless a CuPy is importable already (then none: two CuPys conflict)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '| NVIDIA-SMI 580.65   Driver Version: 580.65   CUDA Version: 13.0 |'\n")
    smi.chmod(0o755)
    r = check(tmp_path, "--plan", path=str(bin_dir), GPU_CHECK_WHEELS=str(tmp_path / "none"))
    assert r.returncode == 0, r.stderr
    assert "mode online (no wheels in" in r.stdout
    extras = "mpich" if importlib.util.find_spec("cupy") else "gpu13,mpich"
    assert f"python -m pip install -e '.[{extras}]' 'pytest>=7' 'pytest-timeout>=2'" in r.stdout
    assert "--no-index" not in r.stdout
    r = check(tmp_path, "--plan", "--online", GPU_CHECK_WHEELS=wheel_folder(tmp_path, WHEELS))
    assert "mode online (--online)" in r.stdout


def test_every_step_has_its_own_timeout_and_the_budget_bounds_them_all(tmp_path):
    r = check(tmp_path, "--plan", GPU_CHECK_WHEELS=str(tmp_path / "none"))
    steps = re.findall(r"^step (\S+) \(timeout (\d+) s\)", r.stdout, re.M)
    assert [name for name, _ in steps] == STEPS
    budget = int(re.search(r"budget (\d+) s", r.stdout).group(1))
    assert budget <= 420 and all(0 < int(t) <= budget for _, t in steps)  # the device's check: under 8 minutes
    assert "--sweep 1,2,4,8,16" in r.stdout and "tests/mpi/ranks/test_full_levels.py" in r.stdout
    r = check(tmp_path, "--plan", "--only", "conformance,sweep", GPU_CHECK_WHEELS=str(tmp_path / "none"))
    assert re.findall(r"^step (\S+)", r.stdout, re.M) == ["conformance", "sweep"]
    r = check(tmp_path, "--plan", "--only", "nonsense")
    assert r.returncode == 2 and "no step nonsense" in r.stderr


def test_a_failing_step_does_not_stop_the_next_and_one_summary_is_written(tmp_path):
    """Two cheap steps for real, with the python on PATH: the first fails (a bad SHMSTORE_NO_GPU), the second
    still runs and passes; both outcomes are printed and in the one summary file, each log kept."""
    r = check(tmp_path, "--no-install", "--only", "env,cuda-aware", path=os.path.dirname(sys.executable),
              SHMSTORE_NO_GPU="maybe", GPU_CHECK_WHEELS=str(tmp_path / "none"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"^env +FAIL \(exit 1\)", r.stdout, re.M), r.stdout
    assert re.search(r"^cuda-aware +PASS .*MPI CUDA-aware: (True|False)", r.stdout, re.M), r.stdout
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["gpu-check-logs", "gpu-check-summary.txt"]
    assert sorted(os.listdir(out / "gpu-check-logs")) == ["cuda-aware.log", "env.log"]
    summary = (out / "gpu-check-summary.txt").read_text()
    assert "SHMSTORE_NO_GPU" in summary and "overall: FAIL (1 of 2 steps passed" in summary
    assert re.search(r"^cuda-aware +PASS", summary, re.M) and re.search(r"^env +FAIL", summary, re.M)
