#!/usr/bin/env bash
# Torch tests with real torch. The test extra leaves torch out (PyPI's default wheel pulls GBs of CUDA
# libraries); CI installs the CPU build its machines keep on disk (.ci/run). Elsewhere run this:
#
#   scripts/torch-check.sh            # in the project's venv (made if missing)
#
# It installs the CPU wheel (PyTorch's CPU index, else whatever pip finds) and runs tests/test_torch.py.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q -e '.[test]'
python -c "import torch" 2>/dev/null \
    || pip install -q torch --index-url https://download.pytorch.org/whl/cpu \
    || pip install -q torch
python -c "import torch; print('torch', torch.__version__)"
python -m pytest -q -p no:cacheprovider tests/test_torch.py -rs "$@"
