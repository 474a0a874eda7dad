"""`IdentityMap`: a dict keyed by object identity whose entries die with their key.

Why this module exists: the plugin remembers facts about TF objects it did
not create — which worker owns a table shard, the wrapper of a table's
slots — and TF variables cannot be dict keys (they are unhashable) or
weak-dict keys. Keyed by `id()` alone, such a registry only grows, holds
whatever the values reference alive, and, once an object is freed and its
id reused, hands the new object the old object's facts. An `IdentityMap`
drops an entry when its key object is garbage-collected (`weakref.finalize`),
so none of that can happen.
"""

import threading
import weakref
from typing import Any, Dict, Generic, Iterator, Optional, Tuple, TypeVar

__all__ = ["IdentityMap"]

V = TypeVar("V")


class IdentityMap(Generic[V]):
    """Maps objects (by identity, not equality) to values, for as long as each object lives.

    Keys must support weak references (TF variables, `ShardedVariable`s and
    plain Python objects do).
    """

    def __init__(self):
        self._entries: Dict[int, Tuple["weakref.ref", V]] = {}
        self._lock = threading.Lock()

    def __setitem__(self, key: Any, value: V) -> None:
        ident = id(key)
        with self._lock:
            entry = self._entry(key)
            if entry is not None:  # Already watched: one finalizer per object.
                self._entries[ident] = (entry[0], value)
                return
            ref = weakref.ref(key)
            self._entries[ident] = (ref, value)
        weakref.finalize(key, self._forget, ident, ref)

    def _forget(self, ident: int, ref: "weakref.ref") -> None:
        with self._lock:
            entry = self._entries.get(ident)
            if entry is not None and entry[0] is ref:  # Not a newer object with the same id.
                del self._entries[ident]

    def _entry(self, key: Any):
        entry = self._entries.get(id(key))
        return entry if entry is not None and entry[0]() is key else None

    def get(self, key: Any, default: Optional[V] = None) -> Optional[V]:
        entry = self._entry(key)
        return entry[1] if entry is not None else default

    def __getitem__(self, key: Any) -> V:
        entry = self._entry(key)
        if entry is None:
            raise KeyError(key)
        return entry[1]

    def __contains__(self, key: Any) -> bool:
        return self._entry(key) is not None

    def pop(self, key: Any, default: Optional[V] = None) -> Optional[V]:
        with self._lock:
            entry = self._entry(key)
            if entry is None:
                return default
            del self._entries[id(key)]
            return entry[1]

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> Iterator[V]:
        return iter([value for _, value in list(self._entries.values())])
