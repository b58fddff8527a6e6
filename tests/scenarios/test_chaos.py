"""The chaos run (``scripts/chaos.py``) as a test: bounded here, hours with ``-m stress`` or the script.

Several worker processes put, get, delete, write, read, pin and move
checksummed objects through a 16 MiB store that keeps spilling, while
workers (half of the time while a move is in flight) and the spill process
are SIGKILLed and SIGTERMed at random, workers get Ctrl-C (SIGINT), catch it
and go on (issue 19 item 1: on the code before, the ALLOC lock stayed held by
an interrupted worker and the others failed LockTimeoutError within seconds;
each round ends with ``check()`` beside the live interrupted workers), and
the store's names are unlinked
behind its back now and then (a new store is made under the name while the
old one is still in use: issue 19 item 2, ``SpillError: ... No such file or
directory`` within seconds on the code before). After every round: every
object whose put returned and that was not deleted reads back identical,
nothing half-visible, ``check()`` clean, usage exact, in each store; at the
end nothing is left in /dev/shm or the spill directory. The seed is printed:
``SHMSTORE_CHAOS_SEED=<seed>`` reruns it.
"""
from __future__ import annotations

import os
import random
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import chaos  # noqa: E402

pytestmark = pytest.mark.slow


def _seed() -> int:
    seed = os.environ.get("SHMSTORE_CHAOS_SEED")
    return int(seed) if seed else random.SystemRandom().randrange(1 << 31)


def _run(rounds: int, seconds: float, until=None, max_rounds: int | None = None, **kw) -> dict:
    seed = _seed()
    print(f"chaos seed {seed} (rerun with SHMSTORE_CHAOS_SEED={seed})")
    result = chaos.Chaos(seed, workers=4, capacity="16MiB", **kw).run(rounds=rounds, seconds=seconds, until=until,
                                                                      max_rounds=max_rounds)
    print(result)
    return result


def _enough(result: dict) -> bool:
    """What the first test needs to have happened: counts, reached however many rounds it takes this machine
    (issue 30 item 11: a round is 7 s, and what fits into one depends on the machine's speed)."""
    kills = result["kills"]
    return result["verified"] > 20 and kills["worker SIGKILL"] > 10 and kills["spill SIGKILL"] > 0 \
        and result["interrupts caught"] > 0  # Ctrl-Cs the workers caught mid-operation and went on after


@pytest.mark.timeout(900)
def test_chaos_kills_lose_and_leak_nothing():
    result = _run(rounds=4, seconds=7, unlink_every=2, until=_enough, max_rounds=16)
    assert result["rounds"] >= 4 and _enough(result), result  # a few hundred to thousands of reads verified
    assert result["kills"]["names unlinked"] == result["rounds"] // 2


@pytest.mark.timeout(900)
def test_chaos_with_a_full_object_table():
    """96 entries for 4 workers that take batches of 32: they keep taking entries from each other."""
    result = _run(rounds=2, seconds=6, max_objects=96, until=lambda r: r["verified"] > 50, max_rounds=12)
    assert result["rounds"] >= 2 and result["verified"] > 50, result


@pytest.mark.stress
@pytest.mark.timeout(4 * 3600)
def test_chaos_long():
    hours = float(os.environ.get("SHMSTORE_CHAOS_HOURS", "0.25"))
    seed = _seed()
    print(f"chaos seed {seed} (rerun with SHMSTORE_CHAOS_SEED={seed})")
    result = chaos.Chaos(seed, workers=6, capacity="16MiB", unlink_every=3).run(rounds=None, seconds=20, hours=hours)
    assert result["rounds"] >= 1
