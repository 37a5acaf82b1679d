"""`ItemCache`: the runner's small caches of per-item work (media encodings, the hidden states
a talker reads at media positions), and `CacheStats`, what one counted."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["CacheStats", "ItemCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class CacheStats:
    """What an `ItemCache` holds and how its lookups went since it was built."""

    entries: int
    capacity: int
    hits: int
    misses: int


class ItemCache(Generic[K, V]):
    """Values by key, the `capacity` most recently used kept (the least recently used is
    evicted first).

    Why: an image or clip sent again, or a prompt computed again, is not encoded again. A hit
    is fast and a miss is not, so a hit tells its caller that someone sent the same item: every
    key a caller builds holds the request's cache salt, so that one salt (one tenant) never
    hits another's entry. Thread-safe: the engine's step thread and a talker's context thread
    read it at once."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def get(self, key: K) -> V | None:
        """The value kept under `key` (now the most recently used), or None."""
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self._misses += 1
                return None
            self._hits += 1
            self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Keep `value` under `key`, evicting the least recently used beyond `capacity`."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def stats(self) -> CacheStats:
        """Entries, capacity, hits and misses."""
        with self._lock:
            return CacheStats(len(self._items), self.capacity, self._hits, self._misses)

    def __repr__(self) -> str:
        s = self.stats()
        return f"<ItemCache {s.entries}/{s.capacity} hits={s.hits} misses={s.misses}>"
