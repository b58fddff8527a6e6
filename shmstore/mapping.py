"""A store as a :class:`collections.abc.MutableMapping`, for libraries that check for one.

``store.mapping()`` returns a :class:`StoreMapping`: dict semantics
throughout (``m[k] = v`` replaces atomically, a miss is a ``KeyError``, and
so is a key no object can have, ``m[123]``: ``InvalidKeyError`` is a
``KeyError``, so ``m.get(123)`` is None and ``m.pop(123, None)`` None; an
empty one is false, ``len``/iteration over this session's keys), values as
``Store.get`` returns them (read-only zero-copy views for arrays and bytes).
zict's ``LRU``/``Buffer``, zarr's stores and any code written against
``MutableMapping`` take it as they take a dict.
"""
from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import Store

__all__ = ["StoreMapping"]


class StoreMapping(MutableMapping[str, Any]):
    """A dict-like view of one store connection's session.

    Owns nothing: closing the store ends the view (its verbs then raise
    ``StoreClosedError``). Process-safe and thread-safe like the store; like
    a dict shared between threads, a sequence of operations (``pop``,
    ``setdefault``) is not atomic against other writers of the same key.
    Pickling sends the store's settings: the receiver connects again.
    """

    __slots__ = ("store",)

    def __init__(self, store: Store) -> None:
        self.store = store

    def __getitem__(self, key: str) -> Any:
        """The value of ``key``, as ``Store.get`` returns it.

        Raises:
            KeyError: (``ObjectNotFoundError``) no such object; (``InvalidKeyError``) no object can have ``key``.
        """
        return self.store.get(key)

    def __setitem__(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key``, replacing atomically what it holds (``put(..., overwrite=True)``).

        Raises:
            StorageFullError, ObjectLockedError, SerializationError, InvalidKeyError: as ``Store.put``.
        """
        self.store.put(key, value, overwrite=True)

    def __delitem__(self, key: str) -> None:
        """Delete ``key``.

        Raises:
            KeyError: (``ObjectNotFoundError``) no such object; (``InvalidKeyError``) no object can have ``key``.
        """
        self.store.delete(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.store

    def __iter__(self) -> Iterator[str]:
        return iter(self.store.keys())  # a snapshot: safe while the loop changes the store

    def __len__(self) -> int:
        return len(self.store)

    def clear(self) -> None:
        """Delete every object of the session (one pass, not ``popitem`` by ``popitem``)."""
        self.store.clear()

    def __reduce__(self) -> tuple[Any, tuple[Store]]:
        return (StoreMapping, (self.store,))

    def __repr__(self) -> str:
        return f"<shmstore.StoreMapping of {self.store!r}>"
