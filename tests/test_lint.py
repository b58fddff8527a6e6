"""The linter (ruff) and the type checker (mypy, strict on the package) find nothing.

They run as part of the suite so that the one test command of the README
checks them too (pinned in the ``test`` extra).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT

BIN = os.path.dirname(sys.executable)


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(BIN, tool)
    if not os.path.exists(exe):
        pytest.fail(f"{tool} is not installed: pip install -e '.[test]'")
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    r = _run("ruff", "check", "shmstore", "tests", "scripts")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.timeout(600)
def test_mypy_strict_on_the_package_finds_nothing():
    r = _run("mypy")  # pyproject.toml: strict, on shmstore/
    assert r.returncode == 0, r.stdout + r.stderr
