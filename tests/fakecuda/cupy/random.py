"""``cupy.random`` stand-in: what the benches and tests use."""
from __future__ import annotations

from typing import Any

import numpy as np

_rng = np.random.default_rng(0)


def randint(low: int, high: int | None = None, size: Any = None, dtype: Any = int) -> Any:
    from . import _new
    return _new(np.asarray(_rng.integers(low, high, size, dtype=dtype)))


def random(size: Any = None, dtype: Any = float) -> Any:
    from . import _new
    return _new(np.asarray(_rng.random(size, dtype=dtype)))


rand = random
