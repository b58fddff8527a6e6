"""scripts/gpu-check.sh, without a GPU: the install it plans (offline where the wheel folder holds wheels, never a
second CuPy there; online with the extra of the driver's CUDA version), its steps and their timeouts, and a real
run of two cheap steps: a failing step does not stop the next, and one summary file and one archive of the logs
are written (issue 23); a real install from an image python that is itself a venv (issue 31)."""
from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

from helpers import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu-check.sh")
STEPS = ["install", "env", "device-tests", "conformance", "mpi-full-levels", "cuda-aware", "bench-gpu",
         "bench-gpu-mpi", "sweep"]  # device tests first, benchmarks last
WHEELS = ["posix_ipc-1.3.2-cp312-cp312-manylinux_2_5_x86_64.manylinux1_x86_64.manylinux_2_17_x86_64."
          "manylinux2014_x86_64.whl", "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl"]


def check(tmp_path, *args: str, path: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the script with its outputs under ``tmp_path`` (its summary, its logs' archive, its venv, its
    temporary files)."""
    full = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_VENV=str(tmp_path / "venv"),
                GPU_CHECK_PYTHON=sys.executable, TMPDIR=str(tmp_path), **env)
    if path is not None:
        full["PATH"] = path + os.pathsep + full["PATH"]
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=90)


def wheel_folder(tmp_path, names: list[str]) -> str:
    folder = tmp_path / "whl"
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"")
    return str(folder)


def install_lines(out: str) -> list[str]:
    """The install commands of a plan (the indented lines under 'step install'), less the line that links the
    image's venv (where the python running the tests is a venv: see the test of issue 31)."""
    lines = out.splitlines()
    start = lines.index("step install (timeout 90 s):") + 1
    body = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        body.append(line.strip())
    return [line for line in body if "_gpu_check_parent.pth" not in line]


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
    assert wheels.startswith("python -m pip install --no-index --no-deps --ignore-installed ")
    assert sorted(os.path.basename(w) for w in wheels.split()[7:]) == sorted(WHEELS)
    assert project == "python -m pip install --no-index --no-deps --no-build-isolation -e ."
    assert not any("cupy" in line or "[" in line for line in (wheels, project))
    if sys.prefix != sys.base_prefix:  # this python is a venv: the check's venv links its site-packages
        assert re.search(r"^    python -c .*_gpu_check_parent\.pth.*site\.addsitedir.*" +
                         re.escape(sysconfig.get_path("purelib")), r.stdout, re.M), r.stdout
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
    # a real CuPy only: this test run may have the stand-in (tests/fakecuda) on its own sys.path, the script not
    real_cupy = subprocess.run([sys.executable, "-c", "import cupy"], capture_output=True, timeout=60,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).returncode == 0
    extras = "mpich" if real_cupy else "gpu13,mpich"
    assert f"python -m pip install -e '.[{extras}]' 'pytest>=7' 'pytest-timeout>=2'" in r.stdout
    assert "--no-index" not in r.stdout
    r = check(tmp_path, "--plan", "--online", GPU_CHECK_WHEELS=wheel_folder(tmp_path, WHEELS))
    assert "mode online (--online)" in r.stdout


def test_every_step_has_its_own_timeout_and_the_budget_bounds_them_all(tmp_path):
    r = check(tmp_path, "--plan", GPU_CHECK_WHEELS=str(tmp_path / "none"))
    steps = re.findall(r"^step (\S+) \(timeout (\d+) s\)", r.stdout, re.M)
    assert [name for name, _ in steps] == STEPS
    budget = int(re.search(r"budget (\d+) s", r.stdout).group(1))
    assert budget <= 390 and all(0 < int(t) <= budget for _, t in steps)  # the device's command: under 7 minutes
    assert int(dict(steps)["device-tests"]) >= 150  # 60-90 s on a cold device
    assert "--sweep 1,2,4,8,16" in r.stdout and "tests/mpi/ranks/test_full_levels.py" in r.stdout
    assert "--mib 256" in r.stdout or "sized down" in r.stdout
    # a small /dev/shm (here: a threshold above what it has free): the benchmarks sized down, and said
    r = check(tmp_path, "--plan", GPU_CHECK_WHEELS=str(tmp_path / "none"), GPU_CHECK_SHM_WANT_MIB=str(1 << 40))
    assert "benchmarks sized down" in r.stdout
    assert re.search(r"^step bench-gpu .*: env SHMSTORE_PREFAULT=64MiB python scripts/bench_gpu.py --mib 64$",
                     r.stdout, re.M), r.stdout
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
    assert sorted(os.listdir(out)) == ["gpu-check-logs.tar.gz", "gpu-check-summary.txt"]  # two files only
    with tarfile.open(out / "gpu-check-logs.tar.gz") as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == \
            ["gpu-check-logs/cuda-aware.log", "gpu-check-logs/env.log"]
        assert b"SHMSTORE_NO_GPU" in tar.extractfile("gpu-check-logs/env.log").read()
    assert not [f for f in os.listdir(tmp_path) if f.startswith("gpu-check.")]  # its temporary logs: removed
    summary = (out / "gpu-check-summary.txt").read_text()
    assert "SHMSTORE_NO_GPU" in summary and "overall: FAIL" in summary and "(1 of 2 steps passed" in summary
    assert re.search(r"^cuda-aware +PASS", summary, re.M) and re.search(r"^env +FAIL", summary, re.M)


def wheel(folder, name: str, version: str, files: dict[str, str]) -> str:
    """A real (tiny) py3-none-any wheel of ``files`` in ``folder``, with its dist-info."""
    dist = f"{name}-{version}"
    files = {**files, f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                       "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    whl = os.path.join(folder, f"{dist}-py3-none-any.whl")
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
    return whl


# The tiny project's build backend (PEP 517/660, in its tree): an editable wheel of a .pth naming the project.
BACKEND = """
import base64, hashlib, os, zipfile

def _wheel(directory, files):
    dist = "gpucheckproj-0"
    files = {**files, dist + ".dist-info/METADATA": "Metadata-Version: 2.1\\nName: gpucheckproj\\nVersion: 0\\n",
             dist + ".dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\n"
                                        "Tag: py3-none-any\\n"}
    record = [p + ",sha256=" + base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b"=").decode()
              + "," + str(len(t.encode())) for p, t in files.items()] + [dist + ".dist-info/RECORD,,"]
    name = dist + "-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(directory, name), "w") as z:
        for p, t in files.items():
            z.writestr(p, t)
        z.writestr(dist + ".dist-info/RECORD", "\\n".join(record) + "\\n")
    return name

def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, {"gpucheckproj.pth": os.path.abspath(".") + "\\n"})

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, {"gpucheckproj.py": open("gpucheckproj.py").read()})
"""


@pytest.mark.slow
def test_the_image_python_is_a_venv_and_the_checks_venv_sees_its_packages(tmp_path):
    """Issue 31: on the GPU machine python3 is itself a venv holding the packages (CuPy, numpy, mpi4py, pytest,
    pip...). A venv made from it with --system-site-packages sees only the base interpreter's site-packages, so
    the check's venv links the image venv's (its .pth files run), after its own site-packages; the carried
    wheels land in the check's venv even where the image has the same version (mpich: libmpi, mpiexec).

    Here the "image" is a venv made now whose site-packages holds a marker module, a .pth that must run (an
    import line, and a plain line that adds this test run's site-packages: pip, setuptools, numpy) and a
    'fakempi' 1.0; the carried wheel is a fakempi 1.0 with a script. The install step runs for real, offline,
    on a copy of the script in a tiny project (the checkout is not built or touched)."""
    image = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(image)], check=True, timeout=60)
    image_py = str(image / "bin" / "python")
    image_site = subprocess.run([image_py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                check=True, capture_output=True, text=True, timeout=30).stdout.strip()
    ours = sysconfig.get_path("purelib")  # this test run's: pip, setuptools, numpy
    with open(os.path.join(image_site, "gpucheck_image.pth"), "w") as f:
        f.write(f"import os; os.environ['GPUCHECK_IMAGE_PTH'] = 'ran'\n{ours}\n")
    with open(os.path.join(image_site, "gpucheck_marker.py"), "w") as f:
        f.write("WHERE = 'image'\n")
    os.makedirs(os.path.join(image_site, "fakempi"))
    with open(os.path.join(image_site, "fakempi", "__init__.py"), "w") as f:
        f.write("WHERE = 'image'\n")
    os.makedirs(os.path.join(image_site, "fakempi-1.0.dist-info"))
    with open(os.path.join(image_site, "fakempi-1.0.dist-info", "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: fakempi\nVersion: 1.0\n")

    folder = tmp_path / "whl"
    folder.mkdir()
    wheel(str(folder), "fakempi", "1.0", {"fakempi/__init__.py": "WHERE = 'venv'\n",
                                          "fakempi-1.0.data/scripts/fakempiexec": "#!/bin/sh\necho fakempiexec\n"})
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, project / "scripts" / "gpu-check.sh")
    (project / "pyproject.toml").write_text('[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                                            'backend-path = ["."]\n')
    (project / "backend.py").write_text(BACKEND)
    (project / "gpucheckproj.py").write_text("WHERE = 'project'\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    venv = tmp_path / "venv"
    r = subprocess.run(["bash", str(project / "scripts" / "gpu-check.sh"), "--only", "install"], cwd=tmp_path,
                       env=dict(env, OUT=str(tmp_path / "out"), GPU_CHECK_VENV=str(venv), GPU_CHECK_PYTHON=image_py,
                                GPU_CHECK_WHEELS=str(folder), TMPDIR=str(tmp_path), PIP_NO_INDEX="1"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^install +PASS .*linked the image venv", r.stdout, re.M), r.stdout
    assert (venv / "bin" / "fakempiexec").exists()  # --ignore-installed: in the venv though the image has it

    probe = ("import os, sys, fakempi, gpucheck_marker, gpucheckproj, numpy, pytest\n"
             "print(gpucheck_marker.WHERE, fakempi.WHERE, gpucheckproj.WHERE, os.environ.get('GPUCHECK_IMAGE_PTH'))\n"
             "print(sys.prefix)\n"
             "print('\\n'.join(sys.path))\n")
    p = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    first, prefix, *path = p.stdout.splitlines()
    assert first == "image venv project ran"  # the image's module, the venv's fakempi, the project, the .pth ran
    assert os.path.realpath(prefix) == os.path.realpath(venv)
    own = [i for i, d in enumerate(path) if os.path.realpath(d).startswith(os.path.realpath(venv) + os.sep)
           and d.endswith("site-packages")]
    linked = path.index(image_site)
    assert own and own[0] < linked  # the venv's own site-packages first: what it installs wins
