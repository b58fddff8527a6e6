#!/usr/bin/env bash
# Download here (a machine with a package index) the wheels that scripts/gpu-check.sh installs offline on the GPU
# test machine, which has no index: CPython 3.12, manylinux x86_64.
#
#   scripts/gpu-wheels.sh                 # into .whl/ (git-ignored: carry it with the checkout)
#   GPU_CHECK_WHEELS=DIR scripts/gpu-wheels.sh
#
# Exactly what the project needs there that the image lacks, with --no-deps:
# - posix_ipc (install_requires; cp312 wheel, manylinux2014 = manylinux_2_17);
# - mpich (the MPI library and mpiexec for the image's mpi4py: libmpi.so.12 under <venv>/lib, where mpi4py
#   looks; the wheel is py3-none, manylinux_2_28 only, so the machine needs glibc >= 2.28).
# The image already has CuPy (cupy-cuda13x), numpy, cloudpickle, mpi4py, pytest, pytest-timeout, setuptools and
# wheel: none of them is downloaded, and never a CuPy (a second CuPy beside the image's conflicts with it).
# The versions are the ones the static review checked (../shared/reviews/gpu-2026-12.md); GPU_WHEELS overrides.
# A device command carries at most 64 MiB in all (checkout and wheels): the total is checked.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_CHECK_WHEELS:-.whl}
PYVER=${GPU_WHEELS_PYTHON_VERSION:-3.12}
read -r -a PACKAGES <<< "${GPU_WHEELS:-posix_ipc==1.3.2 mpich==5.0.2}"
LIMIT=$(( 64 << 20 ))

for p in "${PACKAGES[@]}"; do
    case ${p,,} in
        cupy*) echo "gpu-wheels: refusing $p: the GPU machine's image has its own CuPy (cupy-cuda13x)" >&2; exit 2;;
    esac
done
mkdir -p "$DEST"
# posix_ipc publishes manylinux2014 wheels, mpich manylinux_2_28 ones: both tags are allowed (pip also takes
# the older manylinux tags each of them implies).
"${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --implementation cp \
    --python-version "$PYVER" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DEST" "${PACKAGES[@]}"

wheels=$(du -cb "$DEST"/*.whl | tail -n 1 | cut -f1)
tree=$( (git ls-files -z 2>/dev/null || true) | xargs -0 -r du -cb 2>/dev/null | tail -n 1 | cut -f1)
tree=${tree:-0}
ls -l "$DEST"
echo "gpu-wheels: $DEST holds $(( wheels >> 10 )) KiB of wheels; with the tracked checkout" \
     "($(( tree >> 10 )) KiB): $(( (wheels + tree) >> 10 )) KiB of the 64 MiB a device command carries"
if (( wheels + tree > LIMIT )); then
    echo "gpu-wheels: over 64 MiB: remove other wheels from $DEST" >&2
    exit 1
fi
