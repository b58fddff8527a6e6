"""The tags, sizes and frame plan of the transfer protocol, in one place.

Control messages (named in ``wire.py``) are small pickled tuples
``(reply_tag, message, linger, thread)`` sent to a node's leader on ``TAG_REQUEST``; replies
come back on the tag the requester chose. Bulk bytes go as raw ``MPI.BYTE`` frames, never pickled, in
blocks of at most ``block_size`` (below the 2 GiB count limit), on the
cluster's bulk communicators: frame ``i`` of a transfer on stream
``i % streams``, with the reply tag.

Several streams pay off where the MPI library progresses communicators in
parallel: MPICH does with ``MPIR_CVAR_CH4_NUM_VCIS`` above 1 (each
communicator gets its own virtual communication interface, and each stream's
receiving thread copies its frames on its own core).
"""
from __future__ import annotations

from ..config import mpich_vcis, stream_count

TAG_REQUEST = 1
# a rank left the cluster by an exception (rpc.Messenger.say_left): every other rank's barrier raises
TAG_LEFT = 2
TAG_REPLY_MIN = 1000
TAG_REPLY_MAX = 30000

BATCH = 64                     # keys per batched request (and per round of a batched fetch)

INLINE_MAX = 64 << 10      # objects up to this size travel inside the reply
# larger objects up to this size in host memory come as one raw frame sent with a get's lookup answer (no Data
# request: one round trip, and one wake of the holder's service, fewer; see fetch.py)
PUSH_MAX = 4 << 20
DEFAULT_BLOCK = 256 << 20  # bytes per bulk frame
MAX_BLOCK = 1 << 30

# bulk communicators per cluster: the most streams one transfer uses objects of at least this many bytes are spread over
# every stream
STREAMS = 2
SPLIT_MIN = 8 << 20


def default_streams() -> int:
    """Streams per transfer: ``SHMSTORE_STREAMS``, else 2 where MPICH runs several VCIs, else 1.

    Raises:
        ConfigError: a bad ``SHMSTORE_STREAMS``.
    """
    chosen = stream_count()
    if chosen is not None:
        return chosen
    return STREAMS if mpich_vcis() > 1 else 1


def frames(nbytes: int, block: int, streams: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each bulk frame of an object; both ends compute the same plan.

    Frames are at most ``block`` bytes; an object of ``SPLIT_MIN`` bytes or
    more has at least one frame per stream.
    """
    if nbytes <= 0:
        return []
    pieces = max(-(-nbytes // block), streams if nbytes >= SPLIT_MIN else 1)
    step = -(-nbytes // pieces)
    return [(pos, min(step, nbytes - pos)) for pos in range(0, nbytes, step)]
