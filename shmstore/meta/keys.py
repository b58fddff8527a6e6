"""Keys: non-empty ``str`` of at most 255 UTF-8 bytes."""
from __future__ import annotations

from typing import Any

from ..errors import InvalidKeyError
from . import layout as L

__all__ = ["encode_key"]


def encode_key(key: Any) -> bytes:
    """UTF-8 bytes of a valid key.

    Raises:
        InvalidKeyError: not a non-empty str of at most 255 UTF-8 bytes.
    """
    if type(key) is not str:
        raise InvalidKeyError(f"keys are str, got {type(key).__name__}: {key!r}")
    try:
        kb = key.encode()
    except UnicodeEncodeError as exc:
        raise InvalidKeyError(f"key {key!r} is not valid UTF-8: {exc.reason}") from None
    if not kb or len(kb) > L.MAX_KEY:
        raise InvalidKeyError(f"key {key[:40]!r} is {len(kb)} bytes; keys are 1 to {L.MAX_KEY} UTF-8 bytes")
    return kb
