"""Human-readable byte sizes: ``parse_size("8GiB")`` and ``format_size(n)``."""
from __future__ import annotations

import re

__all__ = ["parse_size", "format_size"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: int | float | str) -> int:
    """Return ``value`` in bytes: an int, or a string such as ``"8GiB"``, ``"512M"``.

    Raises:
        ValueError: the value is negative or not a size.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _SIZE_RE.match(str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"not a size: {value!r} (use e.g. 8GiB, 512MiB, 1000000)")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise ValueError(f"size must not be negative: {value!r}")
    return int(number * _UNITS[unit])


def format_size(nbytes: int | float) -> str:
    """Return ``nbytes`` in binary units, e.g. ``'1.5 GiB'``, ``'64 B'``."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - loop always returns
