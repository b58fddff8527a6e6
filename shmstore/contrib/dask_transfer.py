"""Same-host transfers of stored arrays by reference, for :mod:`shmstore.contrib.dask` (needs ``distributed``).

Dask moves a key between processes by serializing its value on the
sender (the ``dask`` serialization family: a function per type) and
deserializing it on the receiver. Importing this module registers such a
pair for :class:`~shmstore.contrib.dask.DaskSharedArray`, the view a
:class:`~shmstore.contrib.dask.ShmStoreData` returns for a stored array:

1. The sender's serializer is given the comm's context: its own address
   and the recipient's. Where both are on one host, the view is the one
   ``data[k]`` returned (``store_ref`` set) and its mapping is open, the
   header names the store (name, node, session, key, boot id) and no frame
   follows; the mapping counts the view as lent (:meth:`ShmStoreData.lend`)
   until it is dropped. Otherwise the array goes by value, as distributed
   sends any numpy array.
2. The header also names the class, so the receiver unpickles
   ``DaskSharedArray``, which imports this module: the loader below is
   registered before distributed looks for it, in any process.
3. The receiver maps the object: through its own open mapping of that store
   (a zero-copy view, pinned by the receiver) or, in a process without one
   (a client gathering a result), through a connection opened for it,
   copying the array out and closing the connection at once (a connection
   holds a client slot, and a store lives while one is attached).

Why the sender's ``del`` cannot win the race: in Dask's ``get_data``,
the sender keeps the message, and so the lent view, until the receiver
has answered ``"OK"``, which it sends after deserializing; a ``del`` of the
key meanwhile (the active memory manager dropping this copy) is deferred
until the view goes. A receiver on another host whose address looks like
the sender's (which the boot id tells apart), or one that finds the object
gone (the sender's store removed, the sender killed and its objects swept
meanwhile), raises :class:`ReferenceLostError`: a ``TransferError`` and a
``ConnectionError``, because distributed answers an ``OSError`` met while
fetching as a lost peer (it aborts the comm, asks the scheduler, fetches the
key from another holder or has it recomputed), whereas any other exception
in deserialization fails the task that needed the key, or deadlocks the
cluster (dask/distributed#6705).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from distributed.comm.addressing import get_address_host
from distributed.protocol.numpy import deserialize_numpy_ndarray, serialize_numpy_ndarray
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from ..errors import ShmStoreError, StoreClosedError, TransferError
from ..node.views import SharedArray
from ..store import observe
from .dask import BOOT_ID, DaskSharedArray, open_mapping, transfer_stats

__all__ = ["ReferenceLostError", "dumps", "loads", "same_host"]

# smaller arrays: their bytes cost less than a lookup (and, in a client, a connection)
MIN_BY_REFERENCE = 1 << 20


class ReferenceLostError(TransferError, ConnectionError):
    """An array sent by reference cannot be mapped here: its object or store is gone, or the sender is on
    another host behind the same address. A ``ConnectionError`` so that distributed treats it as a lost peer
    (see the module's docs)."""


def same_host(context: dict[str, Any] | None) -> bool:
    """Whether a comm's serialization context joins two processes of one host (by their addresses)."""
    if not context:
        return False
    try:
        return bool(get_address_host(context["sender"]["address"]) == get_address_host(
            context["recipient"]["address"]))
    except (KeyError, TypeError, ValueError):  # no addresses (serialized outside a comm), an odd scheme
        return False


@dask_serialize.register(DaskSharedArray)  # type: ignore[no-untyped-call,untyped-decorator]
def dumps(x: DaskSharedArray, context: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[Any]]:
    """The header (and no frames) naming ``x``'s stored object, or ``x`` by value (see the module's docs)."""
    ref = x.store_ref
    if ref is not None and x.nbytes >= MIN_BY_REFERENCE and ref[0].by_reference and same_host(context):
        mapping, skey = ref
        try:
            store = mapping.store
            mapping.lend(x, skey)
        except StoreClosedError:  # the worker is closing: its view is still valid, send the bytes
            pass
        else:
            transfer_stats["sent"] += 1
            return {"shmstore": [store.name, store.node, store.session, skey, BOOT_ID],
                    "shape": list(x.shape), "dtype": x.dtype.str}, []
    if ref is not None and context:
        transfer_stats["sent_by_value"] += 1
    header, frames = serialize_numpy_ndarray(x.view(np.ndarray))
    return header, frames


@dask_deserialize.register(DaskSharedArray)  # type: ignore[no-untyped-call,untyped-decorator]
def loads(header: dict[str, Any], frames: list[Any]) -> np.ndarray:
    """The array of a header :func:`dumps` made.

    Raises:
        ReferenceLostError: a reference this process cannot resolve (another host; the object or store gone).
    """
    if "shmstore" not in header:
        return deserialize_numpy_ndarray(header, frames)  # type: ignore[no-any-return]
    name, node, session, skey, boot = header["shmstore"]
    if boot != BOOT_ID:
        raise ReferenceLostError(f"array {skey!r} was sent by reference from another host (boot id {boot}); "
                            f"its sender took this host's address for its own", skey)
    try:
        value = _resolve(name, node, session, skey)
    except ShmStoreError as exc:  # gone: the sender's store removed, or its worker killed and swept
        raise ReferenceLostError(f"cannot map array {skey!r} sent by reference from store {name!r}: {exc}", skey) \
            from exc
    shape = tuple(header["shape"])  # a list, or a tuple after msgpack
    if value.shape != shape or value.dtype.str != header["dtype"]:
        raise ReferenceLostError(f"array {skey!r} sent by reference is {value.dtype.str}{value.shape} in store "
                            f"{name!r}, the sender said {header['dtype']}{shape}", skey)
    return value


def _resolve(name: str, node: str, session: str, skey: str) -> np.ndarray:
    mapping = open_mapping(name, node, session)
    if mapping is not None:
        value = mapping.store.get(skey)
        if isinstance(value, SharedArray):
            transfer_stats["received_shared"] += 1
            return value
    with observe(name, node=node, session=session) as store:  # no mapping here: copy out, detach at once
        shared = store.get(skey)
        value = np.array(shared)
        del shared  # its pin goes before the connection closes
    transfer_stats["received_copied"] += 1
    return value
