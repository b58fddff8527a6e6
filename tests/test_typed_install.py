"""The install the README gives is type-visible: ``mypy --strict`` on a user's script outside the checkout finds
shmstore and its types (issue 35 item 4: setuptools' editable import-hook finder hid them from mypy)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

USER_SCRIPT = """
import numpy as np
import shmstore

with shmstore.connect("example", capacity="64MiB") as store:
    info = store.put("a", np.arange(10))
    reveal_type(store)
    reveal_type(info.level)
    value = store.get("a", conditions=(slice(0, 5),))
"""


def test_mypy_strict_on_a_users_script_finds_shmstore_and_its_types(tmp_path):
    mypy = shutil.which("mypy", path=str(sys.executable).rsplit("/", 1)[0])
    if mypy is None:
        pytest.skip("mypy is not installed (the test extra has it)")
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    run = subprocess.run([mypy, "--strict", "--no-incremental", "--python-executable", sys.executable, str(script)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert "Cannot find implementation or library stub" not in out, out
    assert 'Revealed type is "shmstore.store.Store"' in out and 'Revealed type is "shmstore.values.Level"' in out, out
    assert run.returncode == 0, out
