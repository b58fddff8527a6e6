"""Every tag and message kind of the transfer protocol, in one place.

Control messages are small pickled tuples ``(kind, reply_tag, *args)`` sent
to a node's leader on ``TAG_REQUEST``; replies come back on the tag the
requester chose. Bulk bytes go as raw ``MPI.BYTE`` frames, never pickled, in
blocks of at most ``block_size`` (below the 2 GiB count limit).
"""
from __future__ import annotations

TAG_REQUEST = 1
TAG_REPLY_MIN = 1000
TAG_REPLY_MAX = 30000

# request kinds
LOOKUP = "lookup"      # (key, inline_max) -> (found, meta, inline bytes | None, handle)
DATA = "data"          # (handle, block_size) -> raw frames on the reply tag
RELEASE = "release"    # (handle,) -> True
HAS = "has"            # (key,) -> bool
DELETE = "delete"      # (key,) -> bool
PULL = "pull"          # (key, from_node, block_size) -> None or error string
READ = "read"          # (key, offset, n) -> bytes | None
WOPEN = "wopen"        # (key, size) -> handle | error string
WRITE = "write"        # (handle, bytes) -> None | error string
WCLOSE = "wclose"      # (handle, abort) -> None | error string

INLINE_MAX = 64 << 10      # objects up to this size travel inside the reply
DEFAULT_BLOCK = 256 << 20  # bytes per bulk frame
MAX_BLOCK = 1 << 30
