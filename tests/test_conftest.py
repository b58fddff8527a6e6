"""The suite's own leak check touches only what this test run made."""
from __future__ import annotations

from helpers import SUITE, Bystander, of_this_run, shm_segments


def test_a_store_another_program_starts_while_a_test_runs_is_left_alone(bystanders, tmp_path_factory):
    """Regression (issue 19): the leak check unlinked every segment that appeared while a test ran, whoever made
    it: a live store of another program started beside the suite lost its segments. This one starts during the
    test and outlives it: this test's teardown (the leak check) and every later one check that it is still there,
    file by file, and the end of the run reads its objects back."""
    b = Bystander(str(tmp_path_factory.mktemp("bystander")))
    bystanders.append(b)  # closed at the end of the run
    mine = [s for s in shm_segments() if b.owns(s)]
    assert len(mine) == 3 and not any(of_this_run(s) for s in mine) and not b.name.startswith(SUITE)
